"""The compile phases a (re)started rank's ``startup`` event carries: the compiler's own
timed phases, summed, the longest first, in the journal's ``Startup`` bounds."""

from __future__ import annotations

import sys

import pytest

from orchestrator.contracts.worker_events import Startup
from trainer import loop


def test_no_compile_no_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert loop.first_compile_seconds() == {}


def test_the_longest_phases_summed_and_named_for_the_journal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo import utils

    metrics = {f"phase.{i}": [0.01 * i] for i in range(20)}
    metrics["_compile.compile_inner"] = [1.25, 2.0]
    metrics["OutputGraph.call_user_compiler"] = [3.0]
    metrics["empty"] = []
    monkeypatch.setattr(utils, "compilation_time_metrics", metrics)
    out = loop.first_compile_seconds()
    assert len(out) == loop._COMPILE_PHASES
    assert out["compile_phase_phase_19"] == 0.19 and out["compile_phase_compile_compile_inner"] == 3.25
    assert "compile_phase_outputgraph_call_user_compiler" in out and "compile_phase_empty" not in out
    assert "compile_phase_phase_0" not in out  # 0 s: not among the longest
    event = Startup(first_step_done=1.7e9, **out)
    assert event.model_extra == out


def test_a_standby_of_a_compiling_job_computes_inductors_key_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement's first compile found the key computed: the standby paid it."""
    from torch._inductor import codecache

    import trainer.warm_compile  # noqa: F401 - what the agent preloads when the job compiles
    from trainer import standby

    calls: list[int] = []

    monkeypatch.setattr(codecache, "torch_key", lambda: calls.append(1) or b"k")
    monkeypatch.delenv("RANK", raising=False)  # and no ORCH_* (conftest): no slots, no cache
    monkeypatch.setattr(standby, "PREPARED", {})
    standby.prepare(0)
    assert standby.PREPARED["inductor_key"] is True and calls == [1]
    monkeypatch.setattr(codecache, "torch_key", lambda: (_ for _ in ()).throw(OSError("x")))
    assert standby.inductor_key() is False  # best effort: the rank computes it then


def test_what_the_standby_compiled_ahead_is_not_the_first_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replacement whose standby compiled the step reports only its own compile."""
    from torch._dynamo import utils

    from trainer import standby

    metrics = {"_compile.compile_inner": [2.0, 0.25], "OutputGraph.call_user_compiler": [1.5]}
    monkeypatch.setattr(utils, "compilation_time_metrics", metrics)
    monkeypatch.setattr(standby, "PREPARED", {"compile_totals": {
        "_compile.compile_inner": 2.0, "OutputGraph.call_user_compiler": 1.5}})
    assert loop.first_compile_seconds() == {"compile_phase_compile_compile_inner": 0.25}
    monkeypatch.setattr(standby, "PREPARED", {})
    assert loop.first_compile_seconds()["compile_phase_compile_compile_inner"] == 2.25
