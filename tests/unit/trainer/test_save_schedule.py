"""When a step copies its state into the memory tier: never at the same step as the durable
tier (both at one step blocked training over 0.2 s on 2 x H200), never at the last step, and
never more than one step later than its interval says."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.loop import memory_copy_due

TRIED = {"schedules": 0}


def test_a_durable_steps_copy_moves_to_the_next_step() -> None:
    due = [s for s in range(1, 401) if memory_copy_due(s, 20, 150, 400)]
    assert 300 not in due and 301 in due and 280 in due and 320 in due
    assert 150 not in due and 151 not in due  # 150 is no multiple of 20: nothing moves
    assert 400 not in due  # the last step: a resume reads its durable save
    assert [s for s in range(1, 41) if memory_copy_due(s, 5, 10, 40)] == \
        [5, 11, 15, 21, 25, 31, 35]


def test_off_and_every_step() -> None:
    assert not any(memory_copy_due(s, 0, 10, 100) for s in range(1, 101))
    # A durable save every step: nothing to move the copy to; both stay at one step.
    assert [s for s in range(1, 6) if memory_copy_due(s, 2, 1, 10)] == [2, 4]
    # A copy every step: the durable step's goes, the next step copies anyway.
    assert [s for s in range(8, 13) if memory_copy_due(s, 1, 10, 100)] == [8, 9, 11, 12]


@settings(max_examples=400, deadline=None)
@given(memory=st.integers(1, 60), durable=st.integers(2, 300), last=st.integers(1, 1500))
def test_no_copy_beside_a_durable_save_and_none_late_by_more_than_a_step(
        memory: int, durable: int, last: int) -> None:
    TRIED["schedules"] += 1
    due = [s for s in range(1, last + 1) if memory_copy_due(s, memory, durable, last)]
    assert last not in due
    assert not [s for s in due if s % durable == 0]
    for s in range(memory, last, memory):  # each interval's copy, at its step or the next
        assert s in due or (s % durable == 0 and (s + 1 in due or s + 1 >= last))
    assert all(s % memory == 0 or (s - 1) % memory == 0 for s in due)


def test_fuzz_counts() -> None:
    assert TRIED["schedules"] >= 400
