"""The check runner with real child processes: order, durations, a hung check cut."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from orchestrator.health.base import Severity
from orchestrator.health.runner import ReadyChild, run_node_checks

QUICK_CPU = ["host.memory", "host.disk", "storage.checkpoint", "accelerator.inventory"]


def test_checks_run_in_order_and_report_results(make_ctx) -> None:
    results = asyncio.run(run_node_checks(make_ctx(QUICK_CPU)))
    assert [r.check for r in results] == QUICK_CPU
    assert all(r.ok and r.node_id == "local-0" and r.level.value == "full" for r in results)
    assert results[0].details["available_gib"] > 0
    assert results[2].severity is Severity.FATAL and "wrote and read back 1 MiB" in \
        results[2].message and results[2].duration_s > 0
    assert results[3].skipped and "cluster.accelerator is cpu" in results[3].message


def test_a_hung_check_is_cut_at_its_timeout_and_the_rest_still_run(make_ctx) -> None:
    ctx = make_ctx(QUICK_CPU, chaos={"hang": {"local-0": ["host.disk"]}},
                   timeouts={"host.disk": 1.0})
    start = time.monotonic()
    results = asyncio.run(run_node_checks(ctx))
    elapsed = time.monotonic() - start
    assert [r.check for r in results] == QUICK_CPU
    hung = results[1]
    assert not hung.ok and hung.message == "timed out after 1 s; the check was killed"
    assert hung.duration_s == 1.0 and hung.details == {"timeout_s": 1.0}
    # A fresh process ran the checks after the hung one.
    assert results[0].ok and results[2].ok and results[3].skipped
    assert elapsed < 1.0 + 20.0  # the timeout plus two interpreter starts, not forever


def test_a_forced_failure_keeps_what_the_check_said(make_ctx) -> None:
    ctx = make_ctx(["host.memory"], chaos={"fail": {"local-0": ["host.memory"]}})
    (result,) = asyncio.run(run_node_checks(ctx))
    assert not result.ok and result.message.startswith("forced to fail by health.chaos.fail")
    assert "GiB available" in result.message
    # Other nodes' knobs do not apply here.
    other = make_ctx(["host.memory"], node_id="local-3",
                     chaos={"fail": {"local-0": ["host.memory"]}})
    assert asyncio.run(run_node_checks(other))[0].ok


def test_an_exception_in_a_check_is_its_failure(make_ctx) -> None:
    ctx = make_ctx(["storage.checkpoint", "host.memory"])
    ctx.checkpoint_root = "nosuchproto://bucket/x"
    bad, after = asyncio.run(run_node_checks(ctx))
    assert not bad.ok and "nosuchproto" in bad.message and bad.message.startswith("ValueError")
    assert after.ok


def test_a_child_started_ahead_runs_the_next_round_and_the_next_one_waits(make_ctx) -> None:
    """The agent keeps one check process waiting, its imports done; an order's first child
    is that one (no process start on the restart's path), and the next is started after
    the round. Results are the same as a fresh child's."""
    ready = ReadyChild(refill_after_s=0)

    async def scenario() -> tuple[list, list, int, int, bool]:
        await ready.refill()
        waiting = ready._proc
        assert waiting is not None
        await asyncio.sleep(0.5)
        first = await run_node_checks(make_ctx(QUICK_CPU), ready=ready)
        used = ready._proc is not waiting and waiting.returncode is not None
        started = ready.started
        second = await run_node_checks(make_ctx(QUICK_CPU), ready=ready)
        await ready.close()
        return first, second, started, ready.started, used

    first, second, after_first, after_second, used = asyncio.run(scenario())
    assert used  # the waiting child ran the round (and exited)
    assert after_first == 2 and after_second == 3  # one ahead of each round, none in it
    for results in (first, second):
        assert [r.check for r in results] == QUICK_CPU
        assert results[0].ok and results[2].ok and results[3].skipped


def test_a_child_that_died_while_waiting_is_replaced_not_reported(make_ctx) -> None:
    """A waiting child killed before its order (the OOM killer, an operator) is not the
    node's failure: a fresh child runs the checks."""
    ready = ReadyChild(refill_after_s=0)

    async def scenario() -> list:
        await ready.refill()
        proc = ready._proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        results = await run_node_checks(make_ctx(QUICK_CPU), ready=ready)
        await ready.close()
        return results

    results = asyncio.run(scenario())
    assert [r.check for r in results] == QUICK_CPU and results[0].ok and results[2].ok
    assert ready.started == 3  # the killed one, the fresh one, the next one waiting


def test_the_next_child_is_started_a_while_after_a_round_not_beside_the_relaunch(
        make_ctx) -> None:
    """Right after a round the node's ranks start: the next child waits
    ``refill_after_s`` (its imports would take CPU from theirs), and closing the pool
    before then starts nothing."""
    ready = ReadyChild(refill_after_s=0.5)

    async def scenario() -> tuple[int, int, int]:
        await run_node_checks(make_ctx(["host.memory"]), ready=ready)
        right_after = ready.started
        await asyncio.sleep(1.5)
        later = ready.started
        await run_node_checks(make_ctx(["host.memory"]), ready=ready)
        await ready.close()  # the pending refill is cancelled
        await asyncio.sleep(0.7)
        return right_after, later, ready.started

    right_after, later, closed = asyncio.run(scenario())
    assert (right_after, later, closed) == (1, 2, 2)


def test_two_refills_at_once_leave_one_child_waiting(make_ctx) -> None:
    ready = ReadyChild()

    async def scenario() -> list[int]:
        await asyncio.gather(ready.refill(), ready.refill())
        assert ready._proc is not None
        pids = [ready._proc.pid]
        await ready.close()
        return pids

    (pid,) = asyncio.run(scenario())
    assert ready.started == 2
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # closed: nothing left behind
