"""Run a node's checks in a child process and cut any check at its timeout.

Checks can hang where no Python timeout reaches: an NVML call into a wedged driver, a
``statvfs`` on a dead NFS mount, a ``neuron-ls`` that never returns. So they run in a child
process (``orchestrator.health.child``) in its own session; the parent follows its progress
line by line and, when a check overruns its timeout, kills the child's whole process group,
reports that check as failed ("timed out") and starts a fresh child for the checks after it.
A child that dies mid-check (a segfault in a driver library) fails that check the same way.
The total time is therefore bounded by the sum of the timeouts plus process start-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import deque

from orchestrator.health import catalog
from orchestrator.health.base import CheckResult, failed
from orchestrator.health.context import NodeContext

# Interpreter start and imports before the first check (and between two checks, where
# nothing should take long). Generous: a node under load can take seconds to import.
STARTUP_S = 60.0
_STDERR_LINES = 20


async def run_node_checks(ctx: NodeContext, *, python: str | None = None,
                          startup_s: float = STARTUP_S) -> list[CheckResult]:
    """Every check of ``ctx.checks``, in order, each cut at ``ctx.timeouts[name]``."""
    results: list[CheckResult] = []
    remaining = list(ctx.checks)
    while remaining:
        done = await _one_child(ctx.model_copy(update={"checks": remaining}),
                                python or sys.executable, startup_s)
        if not done:  # the child could not even start: nothing would go better next time
            break
        results.extend(done)
        remaining = remaining[len(done):]
    return results


async def _one_child(ctx: NodeContext, python: str, startup_s: float) -> list[CheckResult]:
    """Run checks until the child finishes, overruns or dies; one result per check tried."""
    proc = await asyncio.create_subprocess_exec(
        # -P: a user's trainer.py in the working directory cannot shadow our modules.
        python, "-P", "-m", "orchestrator.health.child", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stderr: deque[str] = deque(maxlen=_STDERR_LINES)
    drain = asyncio.create_task(_drain(proc.stderr, stderr))
    results: list[CheckResult] = []
    current: str | None = None
    started = time.perf_counter()
    try:
        proc.stdin.write(ctx.model_dump_json().encode())
        proc.stdin.close()
        while True:
            limit = ctx.timeouts.get(current, 0.0) if current else startup_s
            try:
                line = await asyncio.wait_for(proc.stdout.readline(),
                                              max(0.0, started + limit - time.perf_counter()))
            except TimeoutError:
                if current is None:
                    return _all_failed(ctx, f"the check process did not start within "
                                            f"{startup_s:.0f} s", startup_s)
                results.append(_cut(ctx, current, limit))
                return results
            if not line:  # the child exited
                await _reap(proc)
                if current is not None:
                    results.append(_died(ctx, current, proc.returncode, stderr,
                                         time.perf_counter() - started))
                elif not results and ctx.checks:
                    return _all_failed(ctx, "the check process exited before any check "
                                            f"(code {proc.returncode}): {_tail(stderr)}", 0.0)
                return results
            msg = json.loads(line)
            if "start" in msg:
                current, started = msg["start"], time.perf_counter()
            elif "result" in msg:
                results.append(CheckResult.model_validate(msg["result"]))
                current, started = None, time.perf_counter()
    finally:
        _kill_group(proc)
        await _reap(proc)
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain


def _cut(ctx: NodeContext, name: str, limit: float) -> CheckResult:
    outcome = failed(f"timed out after {limit:g} s; the check was killed",
                     timeout_s=limit)
    return CheckResult.of(catalog.get(name), ctx.node_id, ctx.level, outcome, limit)


def _died(ctx: NodeContext, name: str, code: int | None, stderr: deque[str],
          duration: float) -> CheckResult:
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 \
        else f"exit code {code}"
    outcome = failed(f"the check process died ({how}): {_tail(stderr)}")
    return CheckResult.of(catalog.get(name), ctx.node_id, ctx.level, outcome, duration)


def _all_failed(ctx: NodeContext, message: str, duration: float) -> list[CheckResult]:
    return [CheckResult.of(catalog.get(n), ctx.node_id, ctx.level, failed(message), duration)
            for n in ctx.checks]


def _tail(lines: deque[str]) -> str:
    return " | ".join(lines)[-600:] or "no output"


async def _drain(stream: asyncio.StreamReader, keep: deque[str]) -> None:
    while line := await stream.readline():
        keep.append(line.decode(errors="replace").rstrip())


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # Always, even after a clean exit: a tool a check started (neuron-ls, nccom-test) may
    # still run in the group. The group id stays reserved while any member lives.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        await proc.wait()
