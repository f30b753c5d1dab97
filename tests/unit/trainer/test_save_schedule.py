"""When a step copies its state into the memory tier: every memory interval, and at every
step the durable tier saves (that save takes its tensors from the copy: one device-to-host
copy for both tiers); the last step's copy only serves its durable save (never committed:
no recovery rolls back to it)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.loop import memory_copy_due

TRIED = {"schedules": 0}


def _plan(memory: int, durable: int, last: int) -> dict[int, str]:
    out = {}
    for s in range(1, last + 1):
        how = memory_copy_due(s, memory, s % durable == 0 or s == last, last)
        if how is not None:
            out[s] = how
    return out


def test_a_durable_step_copies_and_commits_at_its_own_step() -> None:
    plan = _plan(20, 150, 400)
    assert plan[150] == plan[300] == plan[280] == plan[320] == "commit"
    assert 151 not in plan and 301 not in plan
    assert plan[400] == "source"  # the last step: its durable save's source only
    assert _plan(5, 10, 40) == {s: "commit" for s in range(5, 40, 5)} | {40: "source"}


def test_off_and_every_step() -> None:
    # No memory interval: only the durable steps copy (as their saves' source).
    assert _plan(0, 10, 30) == {10: "commit", 20: "commit", 30: "source"}
    assert _plan(2, 1, 4) == {1: "commit", 2: "commit", 3: "commit", 4: "source"}
    # An operator's stop at a step off every interval saves durably: it copies first.
    assert memory_copy_due(17, 20, True, 400) == "commit"
    assert memory_copy_due(17, 20, False, 400) is None


@settings(max_examples=400, deadline=None)
@given(memory=st.integers(0, 60), durable=st.integers(1, 300), last=st.integers(1, 1500))
def test_every_durable_step_has_a_copy_and_every_interval_commits(
        memory: int, durable: int, last: int) -> None:
    TRIED["schedules"] += 1
    plan = _plan(memory, durable, last)
    assert plan[last] == "source"
    assert all(s in plan for s in range(durable, last + 1, durable))
    if memory:
        assert all(plan[s] == "commit" for s in range(memory, last, memory))
    assert all(s % durable == 0 or (memory and s % memory == 0) or s == last for s in plan)
    assert [s for s, how in plan.items() if how == "source"] == [last]


def test_fuzz_counts() -> None:
    assert TRIED["schedules"] >= 400
