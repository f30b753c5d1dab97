"""The supervisor's side of health checks: one round over a set of nodes, and its verdicts.

A round has two stages, each an assignment to every node and a wait with a deadline:

1. ``node``: every node runs its own checks (``health.child``, each cut at its timeout) and
   reports; the head adds what only it can judge: clock skew (the node's wall clock at send
   against the head's at receipt; a late delivery can only make a node look behind), the
   shared filesystem's other half (the head reads the file each node wrote under the
   checkpoint root) and ``agent.report`` for a node whose report never came.
2. ``network`` (level ``full``): the nodes without a fatal failure run the network test's
   ranks (``health.netcheck``) and report its table, judged by ``network.judge_network``.

Every result is journaled as one ``health`` event per (node, check), so the metrics count
failures by check and ``orchestrator status`` / ``orchestrator health`` show them. Nodes with
a fatal failure are excluded (``NodeState.EXCLUDED`` with the reason); placement then fills
their node ranks from spares. The module imports no torch: it runs in the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contracts import events as ev
from orchestrator.contracts.env import JOB
from orchestrator.health import catalog
from orchestrator.health.base import (
    CheckResult,
    Level,
    describe_failures,
    failed,
    passed,
    skipped,
)
from orchestrator.extras import needs
from orchestrator.health.context import SharedFsProbe, build_node_context
from orchestrator.health.host import is_local, local_path
from orchestrator.health.network import judge_network
from orchestrator.contracts.protocol import HealthOrder, HealthReport
from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.placement import id_key

if TYPE_CHECKING:
    from orchestrator.supervisor.context import JobContext
    from orchestrator.supervisor.nodes import NodeRecord, NodeRegistry

_POLL_S = 0.2
# The network test's ranks start a Python with torch and rendezvous: allow for that beyond
# the two measurements' own timeouts before the agent kills them.
_NET_STARTUP_S = 60.0


class HealthCoordinator:
    """Health rounds over the registry's nodes; excludes the bad ones (through the node
    state machine) and re-checks them. ``stop_requested`` ends a wait early."""

    def __init__(self, ctx: JobContext, nodes: NodeRegistry,
                 stop_requested: asyncio.Event) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.stop_requested = stop_requested
        self.cfg = ctx.cfg.health
        self._reports: dict[tuple[str, str], dict[str, tuple[HealthReport, float]]] = {}
        self._arrived = asyncio.Event()
        self._open: set[str] = set()  # nonces of the rounds in progress
        self.excluded: dict[str, str] = {}  # node -> why, for nodes this module took out
        self._retry_at: float | None = None

    # -- from the API (agents' events) -------------------------------------------------------
    def on_report(self, node_id: str, report: HealthReport, received_ts: float) -> None:
        # Only reports of a round in progress are kept: a late one, or one a node made up,
        # would otherwise hold memory for good (one report per invented nonce).
        if report.nonce not in self._open:
            return
        self._reports.setdefault((report.nonce, report.stage), {})[node_id] = (report,
                                                                             received_ts)
        self._arrived.set()

    # -- policy -----------------------------------------------------------------------------
    def level_now(self) -> Level | None:
        """Preflight's level before the first launch, after_failure's afterwards."""
        first = self.ctx.view.generation == 0
        return self.cfg.level(self.cfg.preflight if first else self.cfg.after_failure)

    async def check_new(self, level: Level, checked: set[str]) -> bool:
        """Check the usable nodes not yet in ``checked`` (adding them); False if none.

        Nodes checked earlier in the same phase join the network stage as peers, so a late
        spare or a replacement is measured against the others, not alone.
        """
        usable = sorted((n for n in self.nodes.nodes.values() if n.usable),
                        key=lambda n: id_key(n.node_id))
        fresh = [n for n in usable if n.node_id not in checked]
        if not fresh:
            return False
        await self.admit(fresh, level, peers=[n for n in usable if n.node_id in checked])
        checked.update(n.node_id for n in fresh)
        return True

    async def recheck_excluded(self, level: Level, checked: set[str]) -> None:
        """``on_insufficient: wait``: every ``retry_interval_s``, check the excluded again."""
        now = self.ctx.clock.monotonic()
        if self._retry_at is None:
            self._retry_at = now + self.cfg.retry_interval_s
            self.ctx.log.warning("too few healthy nodes; waiting and re-checking",
                                 every_s=self.cfg.retry_interval_s, excluded=self.excluded)
            return
        if now < self._retry_at:
            return
        self._retry_at = None
        nodes = self.nodes.nodes
        again = [nodes[n] for n in sorted(self.excluded, key=id_key)
                 if n in nodes and nodes[n].state is NodeState.EXCLUDED]
        if again:
            await self.admit(again, level, peers=[n for n in nodes.values() if n.usable
                                                  and n.node_id in checked])

    async def admit(self, nodes: list[NodeRecord], level: Level,
                    peers: list[NodeRecord] | None = None) -> dict[str, list[CheckResult]]:
        """Check ``nodes`` (``peers`` join the network test); exclude every node with a
        fatal failure, re-admit excluded ones that now pass."""
        results = await self.run_round(nodes, level, peers or [])
        for node in [*nodes, *(peers or [])]:
            if node.node_id not in results:
                continue
            bad = [r for r in results.get(node.node_id, []) if r.fatal_failure]
            if node.state is NodeState.LOST:
                continue
            if bad:
                reason = f"health: {describe_failures(bad)}"
                self.excluded[node.node_id] = reason
                if node.state is not NodeState.EXCLUDED:
                    self.nodes.move(node, NodeState.EXCLUDED, node_rank=None, reason=reason)
                    self.ctx.log.warning("node excluded by health checks", node=node.node_id,
                                         reason=reason)
            elif self.excluded.pop(node.node_id, None) is not None:
                self.nodes.move(node, NodeState.REGISTERED, reason="passed health checks again")
        return results

    def insufficient(self, needed: int) -> str:
        """Why the job cannot launch: each node health excluded, and why."""
        healthy = [n for n in self.nodes.nodes.values() if n.usable]
        names = "; ".join(f"{n} ({why.removeprefix('health: ')})"
                          for n, why in sorted(self.excluded.items()))
        lost = [n.node_id for n in self.nodes.with_state(NodeState.LOST)]
        return (f"health checks left {len(healthy)} healthy node(s) of the {needed} the job "
                f"needs and no spare can take the place of the bad ones: {names}"
                + (f"; lost: {', '.join(lost)}" if lost else ""))

    # -- one round --------------------------------------------------------------------------
    async def run_round(self, nodes: list[NodeRecord], level: Level,
                        peers: list[NodeRecord] | None = None) -> dict[str, list[CheckResult]]:
        """Both stages over ``nodes`` (``peers``, checked before, join the network stage);
        every result journaled; results by node."""
        nonce = secrets.token_hex(6)
        self._open.add(nonce)
        start = self.ctx.clock.monotonic()
        ids = [n.node_id for n in nodes]
        self.ctx.log.info("health round", level=level.value, nodes=ids, round=nonce)
        results = await self._node_stage(nonce, nodes, level)
        if any(c.where == "network" and c.runs_at(level) for c in catalog.CHECKS):
            healthy = [n for n in nodes if n.state is not NodeState.LOST and
                       not any(r.fatal_failure for r in results[n.node_id])]
            healthy = sorted(healthy + [p for p in peers or [] if p.usable],
                             key=lambda n: id_key(n.node_id))
            for node_id, extra in (await self._network_stage(nonce, healthy, level)).items():
                results.setdefault(node_id, []).extend(extra)
                self._journal(nonce, extra)
        for stage in ("node", "network"):  # late reports of this round are not waited for
            self._reports.pop((nonce, stage), None)
        self._open.discard(nonce)
        failed_checks = {n: [r.check for r in rs if not r.ok] for n, rs in results.items()}
        self.ctx.record(ev.HealthRound(round=nonce, level=level.value, nodes=ids,
                                       failed={n: c for n, c in failed_checks.items() if c},
                                       duration_s=round(self.ctx.clock.monotonic() - start, 3)))
        return results

    async def _node_stage(self, nonce: str, nodes: list[NodeRecord],
                          level: Level) -> dict[str, list[CheckResult]]:
        names = [c.name for c in catalog.node_checks(level)]
        timeout = sum(self.cfg.timeout_of(n) for n in names) + self.cfg.report_grace_s
        probe_dir, probe_note = self._shared_fs_dir(nonce, len(nodes))
        cluster = self.ctx.cfg.cluster
        issued = self.ctx.clock.time()
        modules = {n.module: n.feature for n in needs(self.ctx.cfg)}
        try:
            for node in nodes:
                probe = None if probe_dir is None else SharedFsProbe(
                    path=str(probe_dir / f"{nonce}.head"), content=nonce,
                    write_path=str(probe_dir / f"{nonce}.{node.node_id}"))
                ctx = build_node_context(
                    self.cfg, nonce=nonce, node_id=node.node_id, level=level, checks=names,
                    accelerator=cluster.accelerator, devices=cluster.procs_per_node,
                    checkpoint_root=self.ctx.checkpoint_root, shared_fs=probe,
                    shared_fs_note=probe_note, job_env=self.ctx.cfg.job.env,
                    modules=modules)
                await self._assign(node, HealthOrder(
                    nonce=nonce, stage="node", context=ctx.model_dump(mode="json"),
                    timeout_s=timeout))
            reports = await self._collect(nonce, "node", [n.node_id for n in nodes], timeout)
            results = {n.node_id: self._node_results(n, level, reports.get(n.node_id),
                                                     timeout, probe_dir, nonce, issued)
                       for n in nodes}
        finally:
            if probe_dir is not None:
                for path in probe_dir.glob(f"{nonce}.*"):
                    with contextlib.suppress(OSError):
                        path.unlink()
        for rs in results.values():
            self._journal(nonce, rs)
        return results

    def _node_results(self, node: NodeRecord, level: Level,
                      got: tuple[HealthReport, float] | None, timeout: float,
                      probe_dir: Path | None, nonce: str, issued: float) -> list[CheckResult]:
        def head(name: str, outcome: Any, duration: float = 0.0) -> CheckResult:
            return CheckResult.of(catalog.get(name), node.node_id, level, outcome, duration)

        if got is None:
            why = "the node was lost during the checks" if node.state is NodeState.LOST \
                else f"no report within {timeout:.0f} s"
            return [head("agent.report", failed(why), timeout)]
        report, received = got
        out = [CheckResult.model_validate(r) for r in report.results]
        took = received - issued
        out.append(head("agent.report", failed(report.error) if report.error else
                        passed(f"reported after {took:.1f} s"), took))
        skew = report.sent_ts - received
        floor = self.cfg.floors.clock_skew_s
        text = f"{abs(skew):.3f} s {'ahead of' if skew > 0 else 'behind'} the head"
        out.append(head("host.clock_skew", (passed if abs(skew) <= floor else failed)(
            text if abs(skew) <= floor else f"{text}, more than {floor:g} s",
            skew_s=round(skew, 4))))
        if probe_dir is not None:
            out = [self._confirm_shared(r, probe_dir / f"{nonce}.{node.node_id}", nonce)
                   if r.check == "host.shared_fs" else r for r in out]
        return out

    def _confirm_shared(self, r: CheckResult, path: Path, nonce: str) -> CheckResult:
        """The head's half of host.shared_fs: it must read the file the node wrote."""
        if not r.ok or r.skipped:
            return r
        try:
            seen = path.read_text()
        except OSError:
            seen = None
        if seen == f"{nonce} {r.node_id}":
            return r.model_copy(update={"message": r.message + "; the head reads its file"})
        return r.model_copy(update={"ok": False, "message": (
            f"the head does not see the file this node wrote ({path}): its checkpoint root "
            "is a different filesystem from the head's")})

    def _shared_fs_dir(self, nonce: str, count: int) -> tuple[Path | None, str]:
        root = self.ctx.checkpoint_root
        if not is_local(root):
            return None, f"the checkpoint root {root} is an object store"
        if count < 2 and self.ctx.cfg.cluster.nodes + self.ctx.cfg.cluster.spares < 2:
            return None, "a single node shares nothing"
        path = local_path(root) / ".health"
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / f"{nonce}.head").write_text(nonce)
        except OSError as exc:
            self.ctx.log.warning("health: cannot write the shared-filesystem probe",
                                 path=str(path), error=str(exc))
            return None, f"the head cannot write under {root}: {exc.strerror or exc}"
        return path, ""

    async def _network_stage(self, nonce: str, nodes: list[NodeRecord],
                             level: Level) -> dict[str, list[CheckResult]]:
        cfg, cluster = self.cfg, self.ctx.cfg.cluster
        ppn = cluster.procs_per_node
        if len(nodes) * ppn < 2 or not nodes:
            return {}
        from orchestrator.launchers.base import default_python

        timeout = cfg.timeout_of("network.allreduce") + cfg.timeout_of("network.pairwise")
        master = nodes[0]
        spec = {"nodes": [n.node_id for n in nodes], "addrs": [n.addr for n in nodes],
                "ppn": ppn,
                "backend": "nccl" if cluster.accelerator == "cuda" else "gloo",
                "allreduce_mib": cfg.network.allreduce_mib,
                "pairwise_mib": cfg.network.pairwise_mib, "iters": cfg.network.iters,
                "warmup": cfg.network.warmup, "timeout_s": timeout}
        for i, node in enumerate(nodes):
            order = HealthOrder(nonce=nonce, stage="network", timeout_s=timeout + _NET_STARTUP_S,
                                spec={**spec, "delay_s": cfg.chaos.slow_network.get(
                                    node.node_id, 0.0)})
            await self._assign(node, order, node_rank=i, nproc=ppn, world_size=len(nodes) * ppn,
                               rank_offset=i * ppn, master_addr=master.addr,
                               master_port=master.free_port,
                               entrypoint=[default_python(self.ctx.cfg), "-P", "-m",
                                           "orchestrator.health.netcheck"],
                               env={**self.ctx.cfg.job.env, JOB: self.ctx.cfg.job.name})
        ids = [n.node_id for n in nodes]
        reports = await self._collect(nonce, "network", ids, timeout + _NET_STARTUP_S + 10.0)
        measured, errors = None, []
        for node_id in ids:
            report = reports.get(node_id, (None, 0.0))[0]
            if report is not None and report.free_port:
                self.nodes.nodes[node_id].free_port = report.free_port
            if report is not None and report.measured and measured is None:
                measured = report.measured
            elif report is not None and report.error:
                errors.append(f"{node_id}: {report.error}")
        lost = [n.node_id for n in nodes if n.state is NodeState.LOST]
        if measured is None and lost:
            # A node died mid-test and took the collectives with it: that says nothing of
            # the others' network, and failing them all would fail the job for one node.
            note = skipped(f"not judged: node(s) {', '.join(lost)} were lost during the test")
            return {n: [CheckResult.of(catalog.get(c), n, level, note, 0.0)
                        for c in ("network.allreduce", "network.pairwise")]
                    for n in ids if n not in lost}
        verdicts = judge_network(ids, measured, cfg.floors)
        out: dict[str, list[CheckResult]] = {}
        for node_id, by_check in verdicts.items():
            out[node_id] = []
            for name, outcome in by_check.items():
                if measured is None and errors:
                    outcome.message += f" ({'; '.join(errors)[:500]})"
                outcome.details.setdefault("backend", spec["backend"])
                out[node_id].append(CheckResult.of(catalog.get(name), node_id, level, outcome,
                                                   (measured or {}).get("seconds", 0.0)))
        return out

    # -- plumbing ---------------------------------------------------------------------------
    async def _assign(self, node: NodeRecord, order: HealthOrder, **fields: Any) -> None:
        await self.nodes.assign(node.node_id, action="health",
                                           health=order.model_dump(), **fields)

    async def _collect(self, nonce: str, stage: str, node_ids: list[str],
                       timeout: float) -> dict[str, tuple[HealthReport, float]]:
        """Reports of this stage until every live node has sent one or the deadline passes."""
        from orchestrator.supervisor.policy import OperatorStop

        clock = self.ctx.clock
        deadline = clock.monotonic() + timeout
        nodes = self.nodes.nodes
        while True:
            self.nodes.mark_silent_lost(self.ctx.cfg.timeouts.node_lost_s)
            have = self._reports.get((nonce, stage), {})
            pending = [n for n in node_ids if n not in have and nodes[n].state is not
                       NodeState.LOST]
            if not pending or clock.monotonic() > deadline:
                return dict(have)
            if self.stop_requested.is_set():
                raise OperatorStop()
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await clock.wait_for(self._arrived.wait(), _POLL_S)

    def _journal(self, nonce: str, results: list[CheckResult]) -> None:
        for r in results:
            data = r.model_dump(mode="json")
            data["message"] = str(data.get("message", ""))[:4096]
            try:
                event = ev.HealthResult(round=nonce, **data)
            except ValueError:  # details beyond the journal's bounds: the verdict is kept
                data.pop("details", None)
                event = ev.HealthResult(round=nonce, **data)
            self.ctx.record(event)
            if not r.ok:
                self.ctx.log.warning("health check failed", node=r.node_id, check=r.check,
                                     severity=r.severity.value, message=r.message)
