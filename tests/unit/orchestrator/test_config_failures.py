"""A failure that repeats identically before the first step is a configuration error: the
policy gives up after one restart, with the reason (error file, else the rank's last line)
on the root cause's line; a bare `python` entrypoint runs on the orchestrator's interpreter."""

from __future__ import annotations

from typing import Any

from orchestrator.config import load_config
from orchestrator.journal.view import JobView
from orchestrator.supervisor.generation.parts import own_python
from orchestrator.supervisor.generation.outcome import exit_reason
from orchestrator.supervisor.policy import RestartPolicy

HOOK = ("orchestrator preload hook failed: ModuleNotFoundError: No module named "
        "'orchestrator' (sys.path=['/x'])")


def _failure(gen: int, *, code: int | None = 3, signal: str | None = None,
             tail: list[str] | None = None, error: str | None = None, rank: int = 0) -> dict:
    return {"kind": "failure", "generation": gen, "cause": "worker_exit", "rank": rank,
            "node_id": f"local-{rank}", "exit_code": code, "signal": signal,
            "message": f"rank {rank} exited", "log_tail": tail if tail is not None else
            [f"==== generation {gen} rank {rank} started 2026-11-22 18:00:00 ====", "Traceback",
             f"[rank{rank}]: {HOOK}", ""], **({"error": error} if error else {})}


def _view(*events: dict[str, Any]) -> JobView:
    return JobView.from_events({"seq": i, "ts": 100.0 + i, **e} for i, e in enumerate(events))


def _decide(*events: dict[str, Any]):
    return RestartPolicy(load_config(None, []).restart).decide(_view(*events))


def test_the_reason_is_the_error_file_else_the_last_line_of_an_exit_code() -> None:
    assert exit_reason(_failure(1)) == HOOK  # the [rankN]: prefix and the blank line dropped
    assert exit_reason(_failure(1, error="ValueError: bad\n  more")) == "ValueError: bad more"
    assert exit_reason(_failure(1, code=None, signal="SIGKILL")) is None  # killed: no reason
    assert exit_reason(_failure(1, tail=["==== generation 1 rank 0 started x ===="])) is None
    assert len(exit_reason(_failure(1, tail=["x" * 5000])) or "") == 300


def test_the_same_exit_before_the_first_step_twice_in_a_row_is_a_config_error() -> None:
    decision = _decide(_failure(1, rank=0), _failure(2, rank=1))
    assert not decision.restart
    # A log line's own time (the trainer's "[17:58:38 rank 1]") differs, the error does not.
    timed = _decide(_failure(1, tail=["[17:58:38 rank 1] chaos: failing at start-up"]),
                    _failure(2, tail=["[17:58:47 rank 1] chaos: failing at start-up"]))
    assert not timed.restart
    assert decision.reason.startswith("configuration error: generations 1 and 2 failed the "
                                      "same way before their first step")


def test_anything_else_is_restarted() -> None:
    once = [_failure(1)]
    assert _decide(*once).restart
    stepped = [_failure(1), {"kind": "first_step", "generation": 2, "step": 1}, _failure(2)]
    assert _decide(*stepped).restart  # generation 2 trained: not before its first step
    other = [_failure(1), _failure(2, tail=["RuntimeError: NCCL timeout"])]
    assert _decide(*other).restart
    killed = [_failure(1, code=None, signal="SIGKILL"), _failure(2, code=None, signal="SIGKILL")]
    assert _decide(*killed).restart
    code = [_failure(1, code=3), _failure(2, code=1)]
    assert _decide(*code).restart
    apart = [_failure(1), _failure(3)]  # not consecutive generations
    assert _decide(*apart).restart


def test_a_bare_python_is_the_orchestrators_own() -> None:
    me = "/venv/bin/python"
    assert own_python(["python", "train.py"], me) == [me, "train.py"]
    assert own_python(["python3.11", "-u", "t.py"], me) == [me, "-u", "t.py"]
    assert own_python(["/opt/conda/bin/python", "t.py"], me) == ["/opt/conda/bin/python", "t.py"]
    assert own_python(["pythonista", "t.py"], me) == ["pythonista", "t.py"]
    assert own_python(["bash", "run.sh"], me) == ["bash", "run.sh"]
