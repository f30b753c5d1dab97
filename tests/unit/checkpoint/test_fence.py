"""The generation as a fencing token on checkpoints: the reader's rule against a brute-force
statement of it, the lineage in the environment, a deposed generation's checkpoint passed
over by the store's selection in both tiers, and its writes (a save's commit, an upload)
refused once a newer generation has claimed the root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoint_files import KEY, TRUST, make_step
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import env as ec
from trainer.checkpoint import fence, layout
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.fence import Claim, Fence, Fenced
from trainer.checkpoint.retry import no_retry
from trainer.checkpoint.store import LOCAL, REMOTE, CheckpointStore, Tier, open_store
from trainer.checkpoint.upload import Uploader
from trainer.config import CheckpointConfig

RUN = "run-0123456789abcdef"

lineages = st.lists(st.tuples(st.integers(1, 12), st.integers(-1, 200)), max_size=12).map(
    lambda pairs: tuple(sorted({g: s for g, s in pairs}.items())))


def brute(reader: int, lineage: tuple[tuple[int, int], ...], writer: int, step: int) -> bool:
    """Admitted: not from a newer generation, and no generation launched after the writer
    (up to the reader) resumed below the step."""
    if writer > reader:
        return False
    return all(step <= resume for gen, resume in lineage if writer < gen <= reader)


@settings(max_examples=400, deadline=None)
@given(lineages, st.integers(0, 12), st.integers(0, 12), st.integers(0, 220))
def test_the_reader_rule_is_the_lineage_rule(lineage: tuple, reader: int, writer: int,
                                             step: int) -> None:
    f = Fence(reader, lineage, RUN)
    manifest = {"generation": writer, "step": step, "run": RUN}
    assert f.admits(manifest) == brute(reader, lineage, writer, step)
    if not f.admits(manifest):
        assert f.refusal(manifest).startswith("fenced: ")
    # Another run's checkpoint, one without a token, or a reader without one: no verdict.
    assert f.admits({**manifest, "run": "run-other"})
    assert f.admits({"step": step})
    assert Fence(None, lineage, RUN).admits(manifest)
    assert Fence(reader, lineage, None).admits(manifest)


def test_a_checkpoint_written_after_the_next_generation_resumed_is_fenced() -> None:
    # Generation 1 trained to step 50; generation 2 was launched from step 40 (the newest
    # the supervisor knew): generation 1's step 50 is a deposed generation's write.
    f = Fence(2, ((1, -1), (2, 40)), RUN)
    assert f.admits({"run": RUN, "generation": 1, "step": 40})
    why = f.refusal({"run": RUN, "generation": 1, "step": 50})
    assert why is not None and "generation 2 resumed from step 40" in why
    assert f.admits({"run": RUN, "generation": 2, "step": 50})
    stale = Fence(1, ((1, -1),), RUN)  # a reader of generation 1, after 2 began
    assert "this reader is deposed" in (stale.refusal({"run": RUN, "generation": 2,
                                                       "step": 50}) or "")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), st.builds(json.dumps, st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["run", "lineage", "x"]), kids, max_size=3), max_leaves=12))))
def test_any_lineage_value_parses_or_is_an_error_naming_the_variable(raw: str) -> None:
    try:
        run, pairs = ec.get_lineage({ec.LINEAGE: raw})
    except ec.EnvError as exc:
        assert exc.name == ec.LINEAGE
        return
    if run is None:
        assert raw.strip() == ""
        return
    assert all(g >= 0 and s >= -1 for g, s in pairs)
    back = ec.GenerationEnv(generation=3, run_id=run, lineage=pairs).to_env()
    assert ec.get_lineage(back) == (run, pairs)


def test_the_generation_env_carries_the_lineage_to_the_rank() -> None:
    env = ec.GenerationEnv(generation=3, run_id=RUN, lineage=[(1, -1), (2, 30), (3, 60)])
    parsed = ec.GenerationEnv.from_env(env.to_env())
    assert (parsed.run_id, parsed.lineage, parsed.generation) == (RUN, [(1, -1), (2, 30),
                                                                        (3, 60)], 3)
    assert ec.LINEAGE not in ec.GenerationEnv(generation=1).to_env()


def _store(root: Path, f: Fence, remote: Path | None = None) -> CheckpointStore:
    primary = Tier.at(str(root), LOCAL)
    far = Tier.at(str(remote), REMOTE) if remote is not None else None
    return CheckpointStore(primary, far, no_retry, TRUST, f)


def test_selection_passes_over_a_deposed_generations_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "job"
    make_step(root, 40, generation=1, run=RUN)
    make_step(root, 50, generation=1, run=RUN)  # committed by generation 1 after the cut
    skipped: list[tuple[int, list[str]]] = []
    store = _store(root, Fence(2, ((1, -1), (2, 40)), RUN))
    found = store.select(on_skip=lambda tier, info, problems: skipped.append(
        (info.step, problems)))
    assert found is not None and found.step == 40
    assert skipped[0][0] == 50 and skipped[0][1][0].startswith("fenced: ")
    assert store.refused[0].signature == "signed"  # refused for its token, not its key
    # Without a token (plain torchrun) or for another run, nothing is fenced.
    assert _store(root, Fence()).select().step == 50
    assert _store(root, Fence(2, ((1, -1), (2, 40)), "run-other")).select().step == 50


def test_a_fenced_remote_copy_is_not_fetched(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    local.mkdir()
    make_step(remote, 30, generation=1, run=RUN)
    make_step(remote, 60, generation=1, run=RUN)
    store = _store(local, Fence(3, ((1, -1), (2, 30), (3, 30)), RUN), remote)
    found = store.select()
    assert found is not None and found.step == 30 and found.fetched_from is not None
    assert not (local / "step-00000060").exists()  # never fetched, never written locally
    assert store.refused[0].step == 60 and store.refused[0].problems[0].startswith("fenced")


def test_claims_fence_writers_of_older_generations_of_the_same_run(tmp_path: Path) -> None:
    fs = Tier.at(str(tmp_path)).fs
    assert fence.read_claim(fs, str(tmp_path)) is None
    fence.check_claim(fs, str(tmp_path), Fence(1, (), RUN))  # nothing claimed: fine
    assert fence.claim(fs, str(tmp_path), Fence(3, (), RUN), 40)
    assert fence.read_claim(fs, str(tmp_path)) == Claim(RUN, 3, 40)
    with pytest.raises(Fenced, match="generation 3 has claimed"):
        fence.check_claim(fs, str(tmp_path), Fence(2, (), RUN))
    fence.check_claim(fs, str(tmp_path), Fence(3, (), RUN))
    fence.check_claim(fs, str(tmp_path), Fence(2, (), "run-other"))  # another run's claim
    assert not fence.claim(fs, str(tmp_path), Fence(2, (), RUN), 10)  # an older one
    assert fence.claim(fs, str(tmp_path), Fence(1, (), "run-next"), None)  # a new run
    assert fence.read_claim(fs, str(tmp_path)) == Claim("run-next", 1, -1)
    (tmp_path / fence.FENCE_FILE).write_text("{not json")
    assert fence.read_claim(fs, str(tmp_path)) is None  # a malformed claim fences nothing


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_claim_file_parses_or_is_ignored(raw: bytes) -> None:
    claim = Claim.parse(raw)
    if claim is not None:
        assert claim.generation >= 0 and claim.resume_step >= -1
        assert Claim.parse(claim.to_json()) == claim


def _typed(event: tuple[str, dict[str, Any]]) -> None:
    """The report passes the supervisor's model of its name, and a forged one does not."""
    from orchestrator.contracts import worker_events as we

    name, data = event
    assert we.model_for(name) is we.CheckpointFenced
    assert we.validate_worker_data(name, 0, data)["step"] == data["step"]
    with pytest.raises(ValueError, match="step"):
        we.validate_worker_data(name, 0, {**data, "step": -1})


def test_a_deposed_uploader_does_not_commit_the_remote_copy(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()
    make_step(local, 50, generation=1, run=RUN)
    events: list[tuple[str, dict[str, Any]]] = []
    up = Uploader(Tier.at(str(local), LOCAL), Tier.at(str(remote), REMOTE), keep_last=2,
                  keep_every=None, attempts=1, backoff_s=0.01, backoff_max_s=0.01,
                  report=lambda name, **d: events.append((name, d)), log=lambda m: None,
                  trust=TRUST)
    up.fence = Fence(1, ((1, -1),), RUN)
    fence.claim(Tier.at(str(remote)).fs, str(remote), Fence(2, (), RUN), 40)
    up.submit(50)
    assert up.wait(30)
    up.close()
    assert up.fenced == [50] and up.uploaded == []
    assert [n for n, _ in events] == ["checkpoint_fenced"]
    assert not (remote / "step-00000050" / layout.MANIFEST).exists()
    _typed(events[-1])


def test_a_deposed_rank_zero_does_not_commit_its_save(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    cfg = CheckpointConfig(url=str(root), async_save=False)
    events: list[tuple[str, dict[str, Any]]] = []

    def saver(generation: int) -> Checkpointer:
        store = open_store(cfg, "job", str(root), no_retry, trust=TRUST,
                           fence=Fence(generation, tuple((g, 10 * (g - 1) or -1)
                                                         for g in range(1, generation + 1)),
                                       RUN))
        return Checkpointer(cfg, store, rank=0, world_size=1, group=None, meta={"job": "job"},
                            report=lambda name, **d: events.append((name, d)),
                            log=lambda m: None)

    state = {"w": torch.arange(8, dtype=torch.float32)}
    old = saver(1)
    old.save(10, state, 0)
    old.wait()
    manifest = layout.read_manifest(old.store.primary.step_url(10))
    assert manifest["generation"] == 1 and manifest["run"] == RUN
    new = saver(2)
    assert new.choose().step == 10  # generation 2 resumes from step 10 and claims the root
    old.save(20, state, 0)  # generation 1 goes on saving: deposed
    old.wait()
    assert [n for n, _ in events] == ["checkpoint_committed", "checkpoint_fenced"]
    assert not Path(old.store.primary.step_url(20)).exists()
    _typed(events[-1])
    assert old.failures_in_a_row == 0  # not a save failure: the worker is on its way out
    new.save(20, state, 0)
    new.wait()
    assert events[-1][0] == "checkpoint_committed" and new.choose().step == 20
    assert KEY  # the job's key signed every manifest above
