"""The memory tier's format and one rank's save / plan / load, in this process (world 1).

Two ranks, partner copies and fallbacks under real jobs: tests/integration/test_memory_tier_jobs.py.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fakes import Box
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.agent.memory import NodeMemory
from trainer.checkpoint import memory_format as mf
from trainer.checkpoint import signing
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.memory_slots import DigestAhead
from trainer.state import Progress

KEY = b"k" * 32
TRUST = signing.Trust(KEY)



def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(7, 5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {"model": Box({"w": model.weight, "b": model.bias,
                          "i": torch.arange(3, dtype=torch.int64),
                          "h": torch.randn(4, generator=g).to(torch.bfloat16)}),
            "extra": Box({"lr": 0.5, "betas": (0.9, 0.95), "names": ["a", "b"], "n": None}),
            "progress": Progress(seed, seed * 10)}


def tier(tmp_path: Path, *, world: int = 1, rank: int = 0, **kw: Any) -> MemoryTier:
    mem = NodeMemory(tmp_path, tmp_path / "run", "n0")
    mem.provision([rank], world, 1, 4 * 2**20, partner=False)
    args = {"rank": rank, "world_size": world, "procs_per_node": 1, "job": "j",
            "config_hash": "c", "generation": 1, "partner": False, "group": None,
            "trust": lambda: TRUST, "log": lambda _m: None, **kw}
    return MemoryTier(mem.path, **args)


def test_save_plan_load_round_trip_is_bit_exact(tmp_path: Path) -> None:
    t = tier(tmp_path)
    src = state(1)
    t.save(5, 50, src)
    t.wait()
    t.save(10, 100, state(2))
    t.wait()  # the other slot: both stay committed
    dst = state(3)
    plan = t.plan(durable_step=5, max_step=None)
    assert plan.use and plan.step == 10, plan.reason
    t.load(plan, dst)
    want = state(2)
    for k in ("w", "b", "i", "h"):
        assert torch.equal(dst["model"].value[k], want["model"].value[k])
    assert dst["extra"].value == {"lr": 0.5, "betas": (0.9, 0.95), "names": ["a", "b"],
                                  "n": None}
    assert (dst["progress"].step, dst["progress"].tokens) == (2, 20)
    # A restart capped at step 7 (a rollback) takes the older copy.
    assert t.plan(durable_step=None, max_step=7).step == 5


def test_a_third_save_overwrites_the_older_slot(tmp_path: Path) -> None:
    t = tier(tmp_path)
    for step in (5, 10, 15):
        t.save(step, 0, state(step))
        t.wait()
    steps = sorted(c.manifest.step for c in t.slots.copies("own", 0))
    assert steps == [10, 15]


def test_a_save_never_overwrites_the_step_every_rank_holds(tmp_path: Path) -> None:
    """A peer still committing step 10 (the newest step every rank holds is 5): this rank's
    save of 15 overwrites its copy of 10, never 5, so a death now still leaves a step all
    ranks can restore."""
    t = tier(tmp_path)
    for step in (5, 10):
        t.save(step, 0, state(step))
        t.wait()
    t.save(15, 0, state(15), keep=5)
    t.wait()
    assert sorted(c.manifest.step for c in t.slots.copies("own", 0)) == [5, 15]
    t.save(20, 0, state(20), keep=15)
    t.wait()
    assert sorted(c.manifest.step for c in t.slots.copies("own", 0)) == [15, 20]
    # No common step yet (a peer has none): the older slot goes, as without the rule.
    t.save(25, 0, state(25), keep=None)
    t.wait()
    assert sorted(c.manifest.step for c in t.slots.copies("own", 0)) == [20, 25]


def test_a_copy_serves_its_step_and_its_slot_waits_for_the_hold(tmp_path: Path) -> None:
    """``copy_of`` hands a durable save the copy of its own step only; a held slot is not
    written again until the hold is done (the save into the other slot does not wait); a
    copy made with ``commit=False`` is never committed."""
    t = tier(tmp_path)
    t.save(10, 100, state(10))
    copy = t.copy_of(10)
    assert copy is not None and t.copy_of(9) is None and copy.keys == ("extra", "model",
                                                                        "progress")
    assert [s.shape for s in copy.segments][:4] == [[5, 7], [5], [3], [4]]
    held: concurrent.futures.Future = concurrent.futures.Future()
    copy.hold(held)
    t.save(20, 200, state(20))  # the other slot
    t.wait()
    assert t.copy_of(10) is None and t.copy_of(20) is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        third = pool.submit(t.save, 30, 300, state(30), 20)  # into the held slot
        done, _ = concurrent.futures.wait([third], timeout=0.5)
        assert not done  # waiting for the hold
        assert bytes(copy.buf[:copy.segments[0].nbytes]) == _raw(state(10)["model"].value["w"])
        held.set_result(None)
        assert third.result(timeout=30) < 30
    t.wait()
    assert sorted(c.manifest.step for c in t.slots.copies("own", 0)) == [20, 30]
    # The last step's copy: the durable save's source, never committed.
    t.save(40, 400, state(40), keep=30, commit=False)
    t.wait()
    assert t.copy_of(40) is not None
    assert sorted(c.manifest.step for c in t.slots.copies("own", 0)) == [30]
    t.close()


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def test_older_than_durable_is_not_used(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.save(5, 0, state(1))
    t.wait()
    plan = t.plan(durable_step=10, max_step=None)
    assert not plan.use and "at or after the durable step 10" in plan.reason


@pytest.mark.parametrize("damage, reason", [
    ("flip", "digest mismatch"), ("manifest", "torn or malformed manifest"),
    ("key", "forged"), ("world", "world size 2, this run has 1"),
    ("config", "config hash"), ("gone", "no memory copy")])
def test_a_damaged_copy_is_never_loaded(tmp_path: Path, damage: str, reason: str) -> None:
    t = tier(tmp_path)
    t.save(5, 0, state(1))
    t.wait()
    (copy,) = t.slots.copies("own", 0)
    bin_path = t.slots.path("own", 0, copy.slot, "bin")
    json_path = bin_path.with_suffix(".json")
    if damage == "flip":
        with open(bin_path, "r+b") as f:
            f.seek(copy.manifest.segments[0].offset + 3)
            f.write(b"\xff")
    elif damage == "manifest":
        json_path.write_bytes(json_path.read_bytes()[:-20])
    elif damage == "key":
        t._trust = lambda: signing.Trust(b"x" * 32)
    elif damage == "world":  # signed with the key, for another world layout
        raw = json.loads(json_path.read_text())
        raw.pop("signature")
        raw["rank"], raw["world_size"] = 1, 2
        json_path.write_bytes(mf.encode(mf.sign(raw, KEY)))
    elif damage == "config":
        t.config_hash = "other"
    else:
        json_path.unlink()
    plan = t.plan(durable_step=None, max_step=None)
    assert not plan.use
    assert reason in plan.reason or (damage == "manifest" and "no memory copy" in plan.reason)


def _restart(tmp_path: Path, old: MemoryTier, max_step: int | None = None,
             ) -> tuple[MemoryTier, DigestAhead]:
    """A new rank's tier over the same slots, with the digest started ahead of it."""
    ahead = DigestAhead(old.slots.root, 0, max_step)
    args = {"rank": 0, "world_size": 1, "procs_per_node": 1, "job": "j", "config_hash": "c",
            "generation": 2, "partner": False, "group": None, "trust": lambda: TRUST,
            "log": lambda _m: None, "ahead": ahead}
    return MemoryTier(old.slots.root, **args), ahead


def test_the_digest_ahead_is_the_plans_and_the_plan_digests_nothing_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest own copy is digested in a thread from the worker's start (before the
    process groups); the restore takes that digest instead of reading 6.8 GB again, and
    compares it at the load, not in the plan: the model is built while it is computed."""
    from trainer.checkpoint import memory as memory_mod
    from trainer.checkpoint import memory_restore

    old = tier(tmp_path)
    old.save(5, 0, state(1))
    old.wait()
    old.save(10, 0, state(2))
    old.wait()
    new, ahead = _restart(tmp_path, old)
    calls: ClassVar[list[int]] = []
    for module in (memory_mod, memory_restore):
        real = module.digest_of
        monkeypatch.setattr(module, "digest_of",
                            lambda buf, m, real=real: calls.append(m.step) or real(buf, m))
    plan = new.plan(durable_step=None, max_step=None)
    assert plan.use and plan.step == 10 and calls == [], (plan.reason, calls)
    assert plan.digest_pending and "digest_checked" not in plan.at
    dst = state(3)
    new.load(plan, dst)
    assert not plan.digest_pending and "digest_checked" in plan.at and calls == []
    assert ahead.error is None and ahead.seconds > 0
    assert torch.equal(dst["model"].value["w"], state(2)["model"].value["w"])
    # Without a digest ahead the plan digests the copy itself, before anything is built.
    plain = MemoryTier(old.slots.root, rank=0, world_size=1, procs_per_node=1, job="j",
                       config_hash="c", generation=2, partner=False, group=None,
                       trust=lambda: TRUST, log=lambda _m: None)
    plan = plain.plan(durable_step=None, max_step=None)
    assert plan.use and not plan.digest_pending and calls == [10], calls
    # Capped below the newest (a rollback): the older copy was not digested ahead.
    capped, _ = _restart(tmp_path, old, max_step=7)
    assert capped.plan(durable_step=None, max_step=7).step == 5


def test_a_copy_corrupted_before_the_restart_fails_its_digest_ahead(tmp_path: Path) -> None:
    old = tier(tmp_path)
    old.save(5, 0, state(1))
    old.wait()
    (copy,) = old.slots.copies("own", 0)
    with open(old.slots.path("own", 0, copy.slot, "bin"), "r+b") as f:
        f.seek(copy.manifest.segments[0].offset + 3)
        f.write(b"\xff")
    new, ahead = _restart(tmp_path, old)
    plan = new.plan(durable_step=None, max_step=None)
    assert plan.use and plan.digest_pending, plan.reason  # compared at the load
    dst = state(3)
    before = dst["model"].value["w"].clone()
    with pytest.raises(ValueError, match="digest mismatch"):
        new.load(plan, dst)
    assert torch.equal(dst["model"].value["w"], before), "a torn copy was loaded"
    assert ahead.digest(copy.slot, copy.manifest) not in (None, copy.manifest.digest)
    # Uncommitted: no later restart picks it again.
    assert new.plan(durable_step=None, max_step=None).reason == "no memory copy"


def test_a_copy_committed_again_after_the_digest_ahead_is_digested_afresh(
        tmp_path: Path) -> None:
    """The digest is kept under the digest its manifest claimed: another commit of the
    slot (another manifest) is not matched to it, and is digested by the plan."""
    old = tier(tmp_path)
    old.save(5, 0, state(1))
    old.wait()
    new, ahead = _restart(tmp_path, old)
    (first,) = old.slots.copies("own", 0)
    assert ahead.digest(first.slot, first.manifest) == first.manifest.digest
    old.save(10, 0, state(2))
    old.wait()
    old.save(15, 0, state(4))
    old.wait()  # the slot of step 5 now holds step 15
    again = next(c for c in old.slots.copies("own", 0) if c.slot == first.slot)
    assert again.manifest.step == 15 and ahead.digest(again.slot, again.manifest) is None
    plan = new.plan(durable_step=None, max_step=None)
    assert plan.use and plan.step == 15, plan.reason


def test_layout_mismatch_raises_before_loading_anything(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.save(5, 0, state(1))
    t.wait()
    plan = t.plan(durable_step=None, max_step=None)
    other = state(2)
    other["model"].value["w"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="model.w"):
        t.load(plan, other)


def test_invalidate_after_drops_an_abandoned_future(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.save(5, 0, state(1))
    t.wait()
    t.save(10, 0, state(2))
    t.wait()
    assert t.invalidate_after(5) == ["own r0 step 10"]
    assert [c.manifest.step for c in t.slots.copies("own", 0)] == [5]


def test_a_state_larger_than_its_slot_turns_the_tier_off(tmp_path: Path) -> None:
    mem = NodeMemory(tmp_path, tmp_path / "run", "n0")
    slot = mem.provision([0], 1, 1, 8 * 4096, partner=False)
    t = MemoryTier(mem.path, rank=0, world_size=1, procs_per_node=1, job="j",
                   config_hash="c", generation=1, partner=False, group=None,
                   trust=lambda: TRUST, log=lambda _m: None)
    big = {"m": Box({"w": torch.zeros(slot)})}
    t.save(5, 0, big)
    t.wait()
    assert t.disabled_reason is not None and "raise checkpoint.memory_max_bytes" in \
        t.disabled_reason
    assert t.slots.copies("own", 0) == []


def test_agent_provision_sizes_frees_and_starts_empty(tmp_path: Path) -> None:
    mem = NodeMemory(tmp_path, tmp_path / "run", "n1")
    slot = mem.provision([2, 3], 4, 2, 64 * 2**20, partner=True)
    names = sorted(p.name for p in mem.path.iterdir())
    assert names == sorted(f"{k}-r{r}-{s}.bin" for k, r in
                           (("own", 2), ("own", 3), ("partner", 0), ("partner", 1))
                           for s in "ab")
    assert slot * len(names) <= 64 * 2**20 and mem.usage() < 64 * 2**20
    (mem.path / "own-r2-a.json").write_text("{}")
    again = NodeMemory(tmp_path, tmp_path / "run", "n1")  # a restarted agent
    again.provision([2, 3], 4, 2, 64 * 2**20, partner=True)
    assert not (mem.path / "own-r2-a.json").exists()
    again.free()
    assert not mem.path.exists()


# -- the manifest parser, fuzzed ----------------------------------------------------------
def _valid() -> dict[str, Any]:
    return {"format": mf.FORMAT, "job": "j", "config_hash": "c", "rank": 0, "world_size": 2,
            "step": 5, "tokens": 10, "generation": 1, "keys": ["a"],
            "segments": [{"offset": 0, "nbytes": 12, "dtype": "float32", "shape": [3]}],
            "objects": {"offset": 64, "nbytes": 30}, "data_bytes": 94,
            "digest": "blake3:" + "0" * 64}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000))
def test_parser_never_raises_anything_but_value_error_on_bytes(raw: bytes) -> None:
    try:
        mf.parse_manifest(raw)
    except ValueError:
        pass


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(_valid())), json_values,
       st.sampled_from(["set", "drop", "extra"]))
def test_a_mutated_manifest_parses_only_when_still_consistent(field: str, value: Any,
                                                              how: str) -> None:
    data = _valid()
    if how == "set":
        data[field] = value
    elif how == "drop":
        data.pop(field)
    else:
        data["x_" + field] = value
    try:
        m = mf.parse_manifest(json.dumps(data).encode())
    except ValueError as exc:
        assert str(exc)
        return
    # Whatever parsed is self-consistent: rank inside the world, aligned, non-overlapping
    # segments ending at data_bytes; and only a field with a default may be missing.
    assert how in ("set", "drop") and 0 <= m.rank < m.world_size
    ends = [s.offset + s.nbytes for s in [*m.segments, m.objects]]
    assert ends[-1] == m.data_bytes and all(s.offset % mf.ALIGN == 0 for s in m.segments)
    if how == "drop":
        assert field in ("config_hash", "generation")


def test_slot_names_parse_back() -> None:
    assert mf.parse_slot_name(mf.slot_name("partner", 12, "b", "json")) == \
        ("partner", 12, "b", "json")
    for bad in ("own-r1-c.bin", "../own-r1-a.bin", "own-r-1-a.bin", "x"):
        assert mf.parse_slot_name(bad) is None


class FakePin:
    """Stands in for ``cudaHostRegister`` (no GPU here): records what it was asked."""

    calls: ClassVar[list[int]] = []

    def __init__(self, buf: Any, nbytes: int) -> None:
        FakePin.calls.append(nbytes)
        self.ok = True

    def release(self) -> None:
        self.ok = False


def _wait_until(cond: Any, timeout: float = 10.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_standby_made_before_the_first_copies_pins_each_slot_as_it_is_committed(
        tmp_path: Path) -> None:
    """A standby started with the job finds no copy to page-lock; its pinner locks each
    slot once its first copy is committed, then stops, and the rank it becomes takes the
    slots with both locked."""
    from trainer.checkpoint.memory_slots import Slots, watch_own_slots

    FakePin.calls = []
    writer = tier(tmp_path)  # the rank that trains (another process in a real job)
    pinner = watch_own_slots(writer.slots.root, 0, interval_s=0.01, pin=FakePin)
    assert not _wait_until(lambda: FakePin.calls, timeout=0.2)  # nothing committed yet
    writer.save(5, 50, state(1))
    writer.wait()
    assert _wait_until(lambda: len(FakePin.calls) == 1)
    writer.save(10, 100, state(2))
    writer.wait()
    assert _wait_until(lambda: not pinner.is_alive())  # both slots: done
    taken = Slots.shared(writer.slots.root)
    assert taken.pinned_slots == {"a", "b"} and len(taken.pinned) == 2
    assert all(n > 0 and n % 4096 == 0 for n in FakePin.calls) and len(FakePin.calls) == 2


def test_the_hand_off_stops_the_pinner_before_a_later_copy(tmp_path: Path) -> None:
    """Once the rank's memory tier takes the slots, the standby's pinner touches nothing:
    the tier owns them from then on."""
    from trainer.checkpoint.memory_slots import Slots, watch_own_slots

    FakePin.calls = []
    writer = tier(tmp_path)
    pinner = watch_own_slots(writer.slots.root, 0, interval_s=0.01, pin=FakePin)
    taken = Slots.shared(writer.slots.root)
    assert not pinner.is_alive() or _wait_until(lambda: not pinner.is_alive())
    writer.save(5, 50, state(1))
    writer.wait()
    assert not _wait_until(lambda: FakePin.calls, timeout=0.2)
    assert taken.pinned_slots == set() and taken is pinner.slots
