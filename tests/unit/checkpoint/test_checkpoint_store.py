"""Choosing the checkpoint to restore across two tiers (both local directories here; the
S3 tier itself is exercised against moto in tests/integration/test_checkpoints_s3.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _checkpoint_files import TRUST, flip_byte, make_step

from trainer.checkpoint import layout
from trainer.checkpoint.store import LOCAL, REMOTE, CheckpointStore, Tier, resolve


def copy_step(src_root: Path, dst_root: Path, step: int) -> None:
    import shutil

    name = layout.step_dir_name(step)
    shutil.copytree(src_root / name, dst_root / name)


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Path, Path, CheckpointStore]:
    local, remote = tmp_path / "local" / "job", tmp_path / "remote" / "job"
    local.mkdir(parents=True)
    remote.mkdir(parents=True)
    store = CheckpointStore(Tier.at(str(local), LOCAL), Tier.at(str(remote), REMOTE),
                            trust=TRUST)
    return local, remote, store


def _select(store: CheckpointStore, **kw):
    skipped: list[tuple[str, int, list[str]]] = []
    choice = store.select(on_skip=lambda t, i, p: skipped.append((t, i.step, p)),
                          log=lambda m: None, **kw)
    return choice, skipped


def test_same_step_in_both_tiers_prefers_the_local_copy(tiers) -> None:
    local, remote, store = tiers
    for s in (10, 20):
        make_step(local, s)
        copy_step(local, remote, s)
    choice, skipped = _select(store)
    assert (choice.step, choice.tier, choice.fetched_from) == (20, LOCAL, None)
    assert skipped == []


def test_newest_only_remote_is_fetched_and_committed_locally(tiers) -> None:
    local, remote, store = tiers
    make_step(local, 10)
    make_step(remote, 20)  # the local tier lost it (wiped node, new machine)
    choice, _ = _select(store)
    assert choice.step == 20 and choice.tier == LOCAL
    assert choice.fetched_from == str(remote / "step-00000020")
    assert layout.verify(choice.url).ok and choice.url == str(local / "step-00000020")


def test_corrupt_local_copy_falls_back_to_the_remote_copy_of_the_same_step(tiers) -> None:
    local, remote, store = tiers
    make_step(local, 20)
    copy_step(local, remote, 20)
    flip_byte(local / "step-00000020" / "__0_0.distcp")
    choice, skipped = _select(store)
    assert choice.step == 20 and choice.fetched_from is not None
    assert [(t, s) for t, s, _ in skipped] == [(LOCAL, 20)]
    assert "blake3" in skipped[0][2][0]
    assert layout.verify(str(local / "step-00000020")).ok  # repaired from the remote copy


def test_corrupt_remote_copy_is_skipped_and_leaves_no_local_commit(tiers) -> None:
    local, remote, store = tiers
    make_step(local, 10)
    make_step(remote, 20)
    data = remote / "step-00000020" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])  # truncated
    choice, skipped = _select(store)
    assert choice.step == 10 and choice.tier == LOCAL
    assert skipped[0][:2] == (REMOTE, 20) and "size" in skipped[0][2][0]
    assert not (local / "step-00000020").exists()


def test_different_copies_of_a_step_pick_the_newer_manifest(tiers) -> None:
    local, remote, store = tiers
    make_step(remote, 20, {"__0_0.distcp": b"older run", ".metadata": b"m"})
    time.sleep(0.01)
    make_step(local, 20, {"__0_0.distcp": b"newer run", ".metadata": b"m"})
    assert _select(store)[0].fetched_from is None
    layout.remove(str(remote / "step-00000020"))
    make_step(remote, 20, {"__0_0.distcp": b"newest of all", ".metadata": b"m"})
    choice, _ = _select(store)
    assert choice.fetched_from is not None
    assert (Path(choice.url) / "__0_0.distcp").read_bytes() == b"newest of all"


def test_everything_corrupt_means_a_fresh_start_and_max_step_is_honoured(tiers) -> None:
    local, remote, store = tiers
    make_step(local, 10)
    make_step(local, 30)
    assert _select(store, max_step=20)[0].step == 10
    flip_byte(local / "step-00000010" / "__0_0.distcp")
    flip_byte(local / "step-00000030" / "__0_0.distcp")
    choice, skipped = _select(store)
    assert choice is None and [s for _, s, _ in skipped] == [30, 10]


def test_unreachable_remote_tier_restores_from_local(tmp_path: Path) -> None:
    local = tmp_path / "local" / "job"
    local.mkdir(parents=True)
    make_step(local, 10)

    class Down(Tier):
        def committed(self):
            raise ConnectionError("no route to S3")

    remote = Down(REMOTE, str(tmp_path / "remote"), Tier.at(str(tmp_path)).fs)
    logs: list[str] = []
    choice = CheckpointStore(Tier.at(str(local), LOCAL), remote).select(log=logs.append)
    assert choice.step == 10 and "unreachable" in logs[0]


def test_resolve_step_dirs_job_roots_and_checkpoint_roots(tmp_path: Path) -> None:
    job = tmp_path / "ckpt" / "myjob"
    make_step(job, 10)
    assert resolve(str(job)) == (str(job), None)
    assert resolve(str(job / "step-00000010")) == (str(job), 10)
    with pytest.raises(ValueError, match="job\\(s\\) myjob"):
        resolve(str(tmp_path / "ckpt"))
    with pytest.raises(FileNotFoundError):
        resolve(str(tmp_path / "nope"))
