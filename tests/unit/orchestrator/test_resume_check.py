"""The preload hook reads a rank's optimizer step count at its first step; the supervisor
says once per generation when ranks disagree."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli.console import describe
from orchestrator.supervisor.resumes import ResumeCheck
from orchestrator.worker.hook import StepCounter, optimizer_state_step


def _adam(steps_before: int) -> torch.optim.Optimizer:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    for _ in range(steps_before):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    return opt


def test_the_hook_reports_what_the_optimizer_had_done_before_this_process() -> None:
    resumed: list[int] = []
    steps: list[int] = []
    counter = StepCounter(steps.append, resumed.append)
    source = _adam(7)  # a snapshot's optimizer, loaded into this process's optimizer
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(source.state_dict())
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        counter(opt)
    assert resumed == [7] and steps == [1, 2, 3]  # said once, at the first step
    assert optimizer_state_step(_adam(0)) is None  # no state yet
    plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    plain.step()
    assert optimizer_state_step(plain) is None  # SGD keeps no step: nothing to compare


def test_the_state_dcp_creates_with_a_zero_step_is_no_training_step() -> None:
    """DCP's state-dict helpers step an empty optimizer once (zero gradients, lr 0) to
    create its state; through the real global hook, that step is neither counted nor taken
    for a resume. A plain SGD's state-dict at every save does it again."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.optim.optimizer import register_optimizer_step_post_hook

    source_model = torch.nn.Linear(2, 1)  # a snapshot's optimizer, 7 steps in
    source = torch.optim.Adam(source_model.parameters())
    for _ in range(7):
        source_model(torch.ones(1, 2)).sum().backward()
        source.step()
    resumed: list[int] = []
    steps: list[int] = []
    handle = register_optimizer_step_post_hook(StepCounter(steps.append, resumed.append))
    try:
        saved = get_optimizer_state_dict(source_model, source)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.Adam(model.parameters())
        set_optimizer_state_dict(model, opt, saved)  # steps ``opt`` once to create its state
        assert steps == [] and resumed == []
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        assert steps == [1] and resumed == [7]

        counted = StepCounter(steps.append)  # a process of its own: counts from 0
        handle.remove()
        handle = register_optimizer_step_post_hook(counted)
        steps.clear()
        plain_model = torch.nn.Linear(2, 1)
        plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
        for _ in range(3):
            plain_model(torch.ones(1, 2)).sum().backward()
            plain.step()
            plain.zero_grad()
            get_optimizer_state_dict(plain_model, plain)  # a save: a zero step each time
        assert steps == [1, 2, 3]
    finally:
        handle.remove()


def test_once_per_generation_at_the_first_disagreement() -> None:
    check = ResumeCheck()
    check.begin(2)
    assert check.note(2, 0, 10) is None
    assert check.note(1, 1, 0) is None  # an older generation's report
    said = check.note(2, 1, 0)
    assert said and "rank 0 from step 10, rank 1 from step 0" in said
    assert check.note(2, 2, 3) is None  # said once
    check.begin(3)
    assert check.note(3, 0, 10) is None and check.note(3, 1, 10) is None
    level, text = describe({"kind": "resume_mismatch", "generation": 2, "message": said})
    assert level == "warning" and text.startswith("generation 2: ranks resumed")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(-3, 10**9)), max_size=64))
def test_said_exactly_when_two_ranks_disagree(reports: list[tuple[int, int]]) -> None:
    check = ResumeCheck()
    check.begin(1)
    said = [check.note(1, rank, step) for rank, step in reports]
    kept: dict[int, int] = {}
    first = None
    for i, (rank, step) in enumerate(reports):
        if step >= 0:
            kept[rank] = step
            if first is None and len(set(kept.values())) > 1:
                first = i
    assert [i for i, s in enumerate(said) if s] == ([] if first is None else [first])
