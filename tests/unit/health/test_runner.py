"""The check runner with real child processes: order, durations, a hung check cut."""

from __future__ import annotations

import asyncio
import time

from orchestrator.health.base import Severity
from orchestrator.health.runner import run_node_checks

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
