"""Run a node's checks in a child process and cut any check at its timeout.

Checks can hang where no Python timeout reaches: an NVML call into a wedged driver, a
``statvfs`` on a dead NFS mount, a ``neuron-ls`` that never returns. So they run in a child
process (``orchestrator.health.child``) in its own session; the parent follows its progress
line by line and, when a check overruns its timeout, kills the child's whole process group,
reports that check as failed ("timed out") and starts a fresh child for the checks after it.
A child that dies mid-check (a segfault in a driver library) fails that check the same way.
The total time is therefore bounded by the sum of the timeouts plus process start-ups.

The first child of a round can be started ahead (``ReadyChild``): the agent keeps one
waiting, its interpreter up and the checks' modules imported, for the next order. After a
failure the round is on the restart's path, and a child's start was 0.26-0.29 s of it on
a GPU host.
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
# After a round, how long until the next check process is started ahead (``ReadyChild``).
REFILL_AFTER_S = 15.0
_STDERR_LINES = 20


class _Stale(Exception):
    """A child started ahead had died before its order (nothing it did can be reported)."""


class ReadyChild:
    """One check process started ahead of the next order, waiting for its context on
    stdin (``child.main``: its imports are done by then). ``take`` hands it over, or a
    fresh one; ``refill`` starts the next (``after_round``: a while after a round). Owned
    by the agent, one per node."""

    def __init__(self, python: str | None = None, refill_after_s: float = REFILL_AFTER_S,
                 ) -> None:
        self._python = python or sys.executable
        self._proc: asyncio.subprocess.Process | None = None
        self._later: asyncio.Task | None = None
        self.refill_after_s = refill_after_s
        self.started = 0  # processes this pool started

    async def fresh(self) -> asyncio.subprocess.Process:
        """A child started now (for the one that died waiting)."""
        self.started += 1
        return await _spawn(self._python)

    async def take(self) -> tuple[asyncio.subprocess.Process, bool]:
        """(a check process, whether it was started ahead)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            return proc, True
        return await self.fresh(), False

    async def refill(self) -> None:
        """Start the next child unless one is waiting."""
        if self._proc is not None and self._proc.returncode is None:
            return
        proc = await self.fresh()
        if self._proc is not None and self._proc.returncode is None:  # another refill won
            _kill_group(proc)
            await _reap(proc)
            return
        self._proc = proc

    async def after_round(self) -> None:
        """Start the next child ``refill_after_s`` from now, in the background: right after
        a round the node's ranks are starting, and the child's imports would take CPU from
        theirs (on a 2-core host the process group's set-up took 0.5 s longer)."""
        if self.refill_after_s <= 0:
            await self.refill()
        elif self._later is None or self._later.done():
            self._later = asyncio.create_task(self._refill_later(), name="health-refill")

    async def _refill_later(self) -> None:
        await asyncio.sleep(self.refill_after_s)
        await self.refill()

    async def close(self) -> None:
        if self._later is not None:
            self._later.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._later
        proc, self._proc = self._proc, None
        if proc is not None:
            _kill_group(proc)
            await _reap(proc)


async def _spawn(python: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        # -P: a user's trainer.py in the working directory cannot shadow our modules.
        python, "-P", "-m", "orchestrator.health.child", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def run_node_checks(ctx: NodeContext, *, python: str | None = None,
                          startup_s: float = STARTUP_S,
                          ready: ReadyChild | None = None) -> list[CheckResult]:
    """Every check of ``ctx.checks``, in order, each cut at ``ctx.timeouts[name]``.
    ``ready``: the first child is the one it holds (a fresh one when it has none or it
    died waiting), and it starts the next when the round is done."""
    python = python or sys.executable
    results: list[CheckResult] = []
    remaining = list(ctx.checks)
    first = True
    try:
        while remaining:
            sub = ctx.model_copy(update={"checks": remaining})
            if first and ready is not None:
                proc, ahead = await ready.take()
                try:
                    done = await _one_child(sub, startup_s, proc, ahead=ahead)
                except _Stale:
                    done = await _one_child(sub, startup_s, await ready.fresh())
            else:
                done = await _one_child(sub, startup_s, await _spawn(python))
            first = False
            if not done:  # the child could not even start: nothing would go better next time
                break
            results.extend(done)
            remaining = remaining[len(done):]
    finally:
        if ready is not None:
            await ready.after_round()
    return results


async def _one_child(ctx: NodeContext, startup_s: float, proc: asyncio.subprocess.Process,
                     *, ahead: bool = False) -> list[CheckResult]:
    """Run checks until the child finishes, overruns or dies; one result per check tried.
    ``ahead``: the child was started before its order; found dead with nothing said, it
    raises ``_Stale`` (the caller starts a fresh one) instead of failing every check."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stderr: deque[str] = deque(maxlen=_STDERR_LINES)
    drain = asyncio.create_task(_drain(proc.stderr, stderr))
    results: list[CheckResult] = []
    current: str | None = None
    started = time.perf_counter()
    try:
        try:
            proc.stdin.write(ctx.model_dump_json().encode())
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            if ahead:
                raise _Stale from None
            raise
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
                    if ahead:
                        raise _Stale
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
