"""The agent's side of health checks: run the order of a ``health`` assignment, report back.

A ``node`` order runs the node's checks in a child process (``health.runner``), each cut at
its timeout. A ``network`` order starts this node's ranks of the network test through the
same ``RankSet`` a training generation uses, waits for them (killing them at the order's
timeout) and reports the table they measured. One order runs at a time; any other assignment
cancels it (its processes are killed), so a supervisor that moved on never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.contracts import env as ec
from orchestrator.agent.ranks import Rank, RankSet, RankSetup
from orchestrator.health.context import NodeContext
from orchestrator.health.runner import ReadyChild, run_node_checks
from orchestrator.logs import get_logger
from orchestrator.contracts.protocol import Assignment, HealthReport

_TAIL = 5  # log lines of a failed network-test rank carried in the report


class HealthWork:
    def __init__(self, node_id: str, run_dir: Path, rank_env: Callable[[], dict[str, str]],
                 report: Callable[[HealthReport], None], new_port: Callable[[], int]) -> None:
        self.node_id = node_id
        self.run_dir = run_dir
        self._rank_env = rank_env
        self._report = report
        self._new_port = new_port
        self._key: tuple[str, str] | None = None
        self._task: asyncio.Task | None = None
        # The node stage's check process, started ahead of each order (``ReadyChild``).
        self.ready = ReadyChild()
        self._readying: asyncio.Task | None = None
        self.log = get_logger("orchestrator.agent.health").bind(node=node_id)

    def prepare(self) -> None:
        """Start the first check process ahead of the first order (the preflight)."""
        if self._readying is None:
            self._readying = asyncio.create_task(self.ready.refill(), name="health-ready")

    def order(self, a: Assignment) -> None:
        """Start the assignment's health order (a re-issued one that already ran is a no-op)."""
        h = a.health
        assert h is not None
        if (h.nonce, h.stage) == self._key:
            return
        self.cancel()
        self._key = (h.nonce, h.stage)
        self._task = asyncio.create_task(self._run(a), name=f"health-{h.stage}")

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self.log.info("health order cancelled", key=self._key)
            self._task.cancel()

    async def close(self) -> None:
        self.cancel()
        for task in (self._task, self._readying):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.ready.close()

    async def _run(self, a: Assignment) -> None:
        h = a.health
        assert h is not None
        start = time.monotonic()
        if h.stage == "node":
            try:
                results = await run_node_checks(NodeContext.model_validate(h.context),
                                                ready=self.ready)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported, the supervisor decides
                results, error = [], f"the checks could not run: {type(exc).__name__}: {exc}"
            report = HealthReport(nonce=h.nonce, stage="node", sent_ts=time.time(),
                                  results=[r.model_dump(mode="json") for r in results],
                                  error=error)
        else:
            measured, error = await self._network(a)
            report = HealthReport(nonce=h.nonce, stage="network", measured=measured,
                                  error=error, free_port=self._new_port(), sent_ts=time.time())
        self.log.info("health stage done", stage=h.stage, nonce=h.nonce,
                      seconds=round(time.monotonic() - start, 2), error=report.error)
        self._report(report)

    async def _network(self, a: Assignment) -> tuple[dict[str, Any] | None, str | None]:
        h = a.health
        assert h is not None and h.spec is not None
        out = self.run_dir / "health" / h.nonce
        env = {**self._rank_env(), **ec.health_env(h.spec, str(out))}
        env.pop(ec.AGENT_SOCKET)  # no heartbeats: the preload hook stays out of the test
        exits: dict[int, str] = {}

        async def on_exit(r: Rank, tail: list[str]) -> None:
            if r.exit_code != 0:
                how = r.signal or f"exit code {r.exit_code}"
                exits[r.rank] = f"rank {r.rank} ({how}): {' | '.join(tail[-_TAIL:])}"[-500:]

        ranks = RankSet(a, env, out / "logs", on_exit, RankSetup(run_dir=out))
        error = None
        try:
            await ranks.start()
            deadline = time.monotonic() + h.timeout_s
            while ranks.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if ranks.alive:
                error = f"the network test did not finish in {h.timeout_s:.0f} s"
        finally:
            await ranks.stop(grace=2.0)
        report = out / f"rank-{a.rank_offset:05d}.json"
        if report.exists():
            return json.loads(report.read_text()), None
        return None, error or "; ".join(exits.values()) or "no report written"
