"""The supervisor: one asyncio process that drives a job through its state machine.

Template loop per generation (after torch elastic's ``_invoke_run``): health-check and place
nodes, launch, observe until the generation completes or fails, stop it, decide (restart
with backoff, or give up). Launch, stop and observe are the platform parts; agents carry
them out. Every state change goes through ``transition()``, which writes one journal event
and one log line.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.config import Config, config_hash
from orchestrator.health.base import Level
from orchestrator.health.coordinator import HealthCoordinator
from orchestrator.journal import Journal, read_events
from orchestrator.jobview import JobView
from orchestrator.launchers import AgentSpec, Launcher, build_launcher
from orchestrator.logs import get_logger
from orchestrator.rundir import RunDir
from orchestrator.state import Cause, JobState, NodeState, check_transition
from orchestrator.supervisor.bookkeeper import BookKeeper
from orchestrator.supervisor.discovery import ScrapeTarget
from orchestrator.supervisor.hangs import collective_timeout_s
from orchestrator.supervisor.intake import Intake, Observation
from orchestrator.supervisor.metrics import SupervisorMetrics
from orchestrator.supervisor.placement import Placement, _id_key, place
from orchestrator.supervisor.policy import GenerationFailed, OperatorStop, RestartPolicy
from orchestrator.supervisor.stability import StabilityHook

# How often the observe loop wakes without news, to check silences and timeouts.
_TICK_S = 0.2


class JobFailed(Exception):
    """The job cannot go on (not enough nodes, budget spent): FAILED with this reason."""

    def __init__(self, reason: str, cause: Cause | None = None) -> None:
        super().__init__(reason)
        self.cause = cause


@dataclass
class Outcome:
    """How a generation ended: ``cause`` and the facts behind it."""

    cause: Cause
    detail: dict[str, Any]


class Supervisor:
    def __init__(self, cfg: Config, run: RunDir, *, clock: Clock = SYSTEM_CLOCK,
                 registry: CollectorRegistry | None = None,
                 launcher: Launcher | None = None, resumed: bool = False,
                 health_only: Level | None = None) -> None:
        self.cfg = cfg
        self.health_only = health_only  # `orchestrator health`: stop after HEALTH_CHECK
        self.rundir = run
        self.clock = clock
        self.resumed = resumed
        self.log = get_logger("orchestrator.supervisor")
        self.view = JobView.from_events(read_events(run.journal))
        self.journal = Journal(run.journal, clock=clock.time)
        self.metrics = SupervisorMetrics(registry or CollectorRegistry(), cfg.job.name)
        self.metrics.set_info(cfg.trainer.model.preset, cfg.cluster.accelerator)
        self.books = BookKeeper(run, self.metrics, clock)  # replays the run dir into metrics
        self.policy = RestartPolicy(cfg.restart)
        self.token = run.ensure_token(os.environ.get("ORCH_TOKEN") or None)
        self.launcher = launcher or build_launcher(cfg, self.record)
        self.intake = Intake(self)
        self.stability = StabilityHook(self)
        self.health = HealthCoordinator(self)
        self.advertise_host = cfg.launcher.advertise_host or _default_advertise_host(cfg)
        self.url = ""
        self.stop_requested = asyncio.Event()
        self.stop_reason = ""
        self.checkpoint_root = run.checkpoint_root(cfg.checkpoint.url)

    # -- journal and state -----------------------------------------------------------------
    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write a journal event and fold it into the view and the metrics."""
        event = self.journal.append(kind, **fields)
        self.view.apply(event)
        self.metrics.on_event(event)
        return event

    def transition(self, target: JobState, *, cause: Cause | None = None,
                   reason: str | None = None, **fields: Any) -> None:
        """The one way the job changes state: checked, journaled, logged once."""
        current = self.view.state
        check_transition(current, target)
        self.record("transition", **{"from": current.value, "to": target.value,
                                     "cause": cause.value if cause else None,
                                     "reason": reason, "generation": self.view.generation,
                                     **fields})
        self.log.info("job state", from_state=current.value, to_state=target.value,
                      cause=cause.value if cause else None, reason=reason,
                      generation=self.view.generation)

    def request_stop(self, reason: str = "operator") -> None:
        self.stop_reason = reason
        self.stop_requested.set()

    # -- lifecycle -------------------------------------------------------------------------
    async def run(self) -> JobState:
        """Serve the API, drive the job to a terminal state, shut down. Returns the state."""
        from orchestrator.supervisor.server import ApiServer

        server = ApiServer(self)
        port = await server.start(self.cfg.metrics.host, self._listen_port())
        self.url = f"{server.scheme}://{self.advertise_host}:{port}"
        self.rundir.write_json(self.rundir.supervisor_info, {
            "pid": os.getpid(), "url": self.url, "port": port, "host": self.advertise_host,
            "started": self.clock.time()})
        self.log.info("supervisor listening", url=self.url, run_dir=str(self.rundir.root),
                      metrics=f"{self.url}/metrics")
        target = ScrapeTarget(self.cfg.metrics.targets_file, self.cfg.metrics.linger_s,
                              self.advertise_host, port)
        books = asyncio.create_task(self.books.run(), name="books")
        try:
            if not self.view.job:
                self._record_created()
            gap = self.clock.time() - self.view.last_ts if self.resumed and self.view.last_ts \
                else None
            self.record("supervisor_started", pid=os.getpid(), url=self.url,
                        resumed=self.resumed, gap_s=gap)
            if not self.view.state.terminal:
                await self._drive()
        finally:
            books.cancel()
            self.books.refresh()
            await self._shutdown()
            await target.retire(self.view.state.terminal)
            self.stability.save_cache()
            await server.stop()
            self.journal.close()
        return self.view.state

    def _listen_port(self) -> int:
        if self.resumed:  # agents know the old URL: listen where they look
            info = self.rundir.read_supervisor_info()
            if info and info.get("port"):
                return int(info["port"])
        return self.cfg.metrics.port

    def _record_created(self) -> None:
        self.rundir.config.write_text(_dump_yaml(self.cfg))
        self.record("job_created", job=self.cfg.job.name, run_dir=str(self.rundir.root),
                    config_hash=config_hash(self.cfg), world_size=self.cfg.cluster.world_size,
                    nodes=self.cfg.cluster.nodes, spares=self.cfg.cluster.spares,
                    steps=self.cfg.trainer.steps, checkpoint_root=self.checkpoint_root,
                    launcher=self.cfg.launcher.kind)

    def agent_spec(self) -> AgentSpec:
        from orchestrator.launchers.base import default_python

        return AgentSpec(self.url, self.token, self.rundir, default_python(self.cfg))

    async def _drive(self) -> None:
        adopt = False
        try:
            await self._provision()
            adopt = self.resumed and self.view.state in (JobState.LAUNCHING, JobState.RUNNING,
                                                         JobState.STOPPING)
            while True:
                try:
                    if adopt:
                        adopt = False
                        await self._adopt_generation()
                    else:
                        await self._run_generation()
                    return
                except GenerationFailed as failed:
                    # A pending rollback is carried out whatever stopped the generation: a
                    # rank that crashed on a NaN still diverged first.
                    failed_gen = failed.failure.get("generation")
                    refusal = self.stability.refusal(self.view, failed_gen)
                    decision = self.policy.decide(self.view)
                    if refusal or not decision.restart:
                        self.transition(JobState.FAILED, cause=failed.cause,
                                        reason=refusal or decision.reason)
                        return
                    self.transition(JobState.RECOVERING, cause=failed.cause,
                                    delay_s=decision.delay_s)
                    self._roll_back_if_pending(failed)
                    await self._sleep_or_stop(decision.delay_s)
        except OperatorStop:
            self.transition(JobState.STOPPED, cause=Cause.OPERATOR, reason=self.stop_reason)
        except JobFailed as exc:
            self.transition(JobState.FAILED, cause=exc.cause, reason=str(exc))

    def _roll_back_if_pending(self, failed: GenerationFailed) -> None:
        try:
            self.stability.roll_back(self.view, failed.failure)
        except OSError as exc:  # resuming the abandoned lineage later would be worse
            raise JobFailed(f"rollback could not discard the abandoned checkpoints: {exc}") \
                from exc

    async def _provision(self) -> None:
        """PENDING: get one agent per node started (or adopt those already running)."""
        spawned = {e["node_id"]: e["pid"] for e in read_events(self.rundir.journal)
                   if e["kind"] == "agent_spawned"}
        if spawned:
            await self.launcher.adopt(self.agent_spec(), spawned)
        else:
            await self.launcher.start(self.agent_spec())

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop_requested.wait(), seconds)
        except TimeoutError:
            return
        raise OperatorStop()

    # -- one generation ----------------------------------------------------------------------
    async def _run_generation(self) -> None:
        if self.view.state is not JobState.HEALTH_CHECK:
            self.transition(JobState.HEALTH_CHECK)
        if self.health_only is not None:
            await self._check_health_only(self.health_only)
            return
        placement = await self._select_nodes()
        self.transition(JobState.LAUNCHING)
        generation = self.view.generation + 1
        await self._launch(generation, placement)
        await self._finish(generation, await self._watch(generation))

    async def _adopt_generation(self) -> None:
        """After a supervisor restart mid-run: re-attach to the running generation.

        Agents kept their ranks training and re-register on their own; once every node of
        the generation is back, it gets its assignment re-issued unchanged (a no-op for the
        agent) and observation carries on. A node that does not come back is node_lost.
        """
        generation = self.view.generation
        launch = self.view.launches[-1]
        self.intake.begin_generation(generation, launch["world_size"], adopting=True)
        assignments: dict[str, dict[str, Any]] = launch["assignments"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeouts.node_lost_s
        while loop.time() < deadline and not set(assignments) <= set(self.intake.nodes.nodes):
            if self.stop_requested.is_set():
                break
            await asyncio.sleep(_TICK_S)
        missing = sorted(set(assignments) - set(self.intake.nodes.nodes))
        for node_id, assignment in assignments.items():
            if node_id not in missing:
                node = self.intake.nodes.nodes[node_id]
                if node.generation == generation:  # registered before we were listening
                    self.intake.started[node_id] = sorted(node.ranks)
                await self.intake.nodes.assign(node_id, **assignment)
        if self.view.state is JobState.STOPPING:
            outcome: Outcome | None = Outcome(Cause.NODE_LOST, {
                "message": "the supervisor died while stopping this generation"})
        elif missing:
            outcome = Outcome(Cause.NODE_LOST, {
                "node_id": missing[0],
                "message": f"node(s) {', '.join(missing)} did not come back after the "
                           "supervisor restart"})
        else:
            outcome = await self._watch(generation, adopting=True)
        await self._finish(generation, outcome)

    async def _finish(self, generation: int, outcome: Outcome | None) -> None:
        if outcome is None:
            self.intake.progress.journal_progress()
            self.transition(JobState.COMPLETED, cause=Cause.COMPLETED)
            return
        if self.view.state is not JobState.STOPPING:
            self.transition(JobState.STOPPING, cause=outcome.cause)
        if outcome.cause is Cause.HANG:
            outcome.detail["stacks"] = await self._dump_stacks(generation)
        await self._stop_generation(generation)
        if outcome.cause is Cause.OPERATOR:
            raise OperatorStop()
        outcome = self._explain_by_lost_node(outcome)
        failure = self.intake.root_cause(generation, outcome.cause, outcome.detail)
        self.record("failure", **failure)
        self.log.error("generation failed", **{k: v for k, v in failure.items()
                                               if k != "log_tail"})
        self._blame_node(failure)
        raise GenerationFailed(outcome.cause, failure)

    def _explain_by_lost_node(self, outcome: Outcome) -> Outcome:
        """A node of the generation that went silent explains its peers' failing exits.

        When a node dies, ranks elsewhere fail within milliseconds (their collectives lose
        a peer) and report before the node's silence can be established; the root cause is
        still the node, which shows by its not confirming the stop.
        """
        if outcome.cause is not Cause.WORKER_EXIT:
            return outcome
        members = set(self.view.launches[-1]["nodes"]) if self.view.launches else set()
        lost = [n for n in self.intake.nodes.with_state(NodeState.LOST) if n.node_id in members]
        if not lost:
            return outcome
        node = lost[0]
        exit_msg = outcome.detail.get("rank")
        return Outcome(Cause.NODE_LOST, {
            "node_id": node.node_id,
            "message": f"node {node.node_id} was lost (agent silent); the exit of rank "
                       f"{exit_msg} on another node followed from it"})

    def _blame_node(self, failure: dict[str, Any]) -> None:
        """Exclude a node blamed for too many failures, when a spare can take its rank."""
        node_id = failure.get("node_id")
        node = self.intake.nodes.nodes.get(node_id or "")
        if node is None or node.state is not NodeState.ACTIVE:
            return
        r = self.cfg.restart
        now = self.clock.time()
        recent = [f for f in self.view.failures if f.get("node_id") == node_id
                  and now - (f.get("ts") or now) <= r.node_failure_window_s]
        if len(recent) < r.node_failure_limit:
            return
        spares = [n for n in self.intake.nodes.with_state(NodeState.SPARE)]
        if not spares:
            self.log.warning("node keeps failing but no spare can replace it", node=node_id,
                             failures=len(recent))
            return
        self.intake.set_node_state(
            node, NodeState.EXCLUDED, node_rank=None,
            reason=f"{len(recent)} failures in {r.node_failure_window_s:.0f} s")
        node.node_rank = None
        self.log.warning("node excluded", node=node_id, failures=len(recent),
                         replacement=spares[0].node_id)

    async def _select_nodes(self) -> Placement:
        """HEALTH_CHECK: wait for enough live nodes, check them (excluding the bad ones),
        place node ranks and spares."""
        needed, ppn = self.cfg.cluster.nodes, self.cfg.cluster.procs_per_node
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeouts.register_s
        replaced: set[str] = set()
        level, checked = self.health.level_now(), set[str]()
        while True:
            self.intake.mark_silent_nodes_lost()
            placement = place(list(self.intake.nodes.nodes.values()), needed, ppn)
            # Check once enough nodes are here; newcomers (spares, replacements) on arrival.
            if level is not None and (placement.complete or self.health.excluded) and \
                    await self.health.check_new(level, checked):
                continue
            if placement.complete:
                break
            for node in self.intake.nodes.with_state(NodeState.LOST):
                if node.node_id not in replaced and len(replaced) < placement.missing:
                    replaced.add(node.node_id)
                    if await self.launcher.replace(self.agent_spec(), node.node_id):
                        self.log.info("restarting lost node's agent", node=node.node_id)
            # Before giving up on health grounds, let nodes still starting or being replaced
            # arrive (until the registration deadline): they may be the spares needed.
            more_coming = loop.time() <= deadline and (
                len(self.intake.nodes.nodes) < self.launcher.wanted_nodes
                or bool(self.intake.nodes.with_state(NodeState.LOST)))
            if level is not None and self.health.excluded and not more_coming:
                if self.cfg.health.on_insufficient == "fail":
                    raise JobFailed(self.health.insufficient(needed), Cause.HEALTH_CHECK)
                await self.health.recheck_excluded(level, checked)
            elif loop.time() > deadline:
                have = needed - placement.missing
                raise JobFailed(f"only {have} of {needed} nodes are available after "
                                f"{self.cfg.timeouts.register_s:.0f} s")
            if self.stop_requested.is_set():
                raise OperatorStop()
            await asyncio.sleep(_TICK_S)
        await self.intake.apply_placement(placement)
        return placement

    async def _check_health_only(self, level: Level) -> None:
        """``orchestrator health``: one round over every node that registers, then stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeouts.register_s
        nodes = self.intake.nodes.nodes
        while len(nodes) < self.launcher.wanted_nodes and loop.time() < deadline:
            if self.stop_requested.is_set():
                raise OperatorStop()
            await asyncio.sleep(_TICK_S)
        usable = sorted((n for n in nodes.values() if n.usable),
                        key=lambda n: _id_key(n.node_id))
        results = await self.health.run_round(usable, level) if usable else {}
        fatal = sorted({n for n, rs in results.items() if any(r.fatal_failure for r in rs)})
        self.transition(JobState.STOPPED, cause=Cause.OPERATOR, reason=(
            f"health check only: {len(usable)} of {self.launcher.wanted_nodes} node(s) "
            f"checked, {len(fatal)} with a fatal failure"
            + (f" ({', '.join(fatal)})" if fatal else "")))

    async def _launch(self, generation: int, placement: Placement) -> None:
        nodes = self.intake.nodes
        rank0 = next(n for n, r in placement.active.items() if r == 0)
        master = nodes.nodes[rank0]
        ppn = self.cfg.cluster.procs_per_node
        env = self._generation_env(generation)
        self.intake.resume_max_step = None  # a rollback's limit holds for one launch only
        assignments = {}
        for node_id, node_rank in placement.active.items():
            assignments[node_id] = {
                "action": "run", "generation": generation, "node_rank": node_rank,
                "nproc": ppn, "world_size": self.cfg.cluster.world_size,
                "rank_offset": node_rank * ppn, "master_addr": master.addr,
                "master_port": master.free_port, "entrypoint": self._entrypoint(),
                "env": env, "signals": [], "preload": self._preload()}
        after = self.view.failures[-1]["cause"] if self.view.failures else None
        self.intake.begin_generation(generation, self.cfg.cluster.world_size)
        self.record("generation_launched", generation=generation,
                    world_size=self.cfg.cluster.world_size, master_addr=master.addr,
                    master_port=master.free_port, nodes=placement.active,
                    spares=placement.spares, after_cause=after,
                    resume_step=self.view.newest_checkpoint_step,
                    assignments=assignments)
        for node_id, assignment in assignments.items():
            await nodes.assign(node_id, **assignment)
        for node_id in placement.spares:
            await nodes.assign(node_id, action="idle", generation=None)
        for node in nodes.with_state(NodeState.EXCLUDED):
            await nodes.assign(node.node_id, action="idle", generation=None)

    def _preload(self) -> list[str]:
        """What a spare interpreter imports ahead of a restart (the built-in trainer's
        modules; a user's own script gets fresh processes)."""
        if self.cfg.job.entrypoint or not self.cfg.job.warm_start:
            return []
        return ["trainer.main", "trainer.build", "trainer.loop"]

    def _entrypoint(self) -> list[str]:
        if self.cfg.job.entrypoint:
            return list(self.cfg.job.entrypoint)
        from orchestrator.launchers.base import default_python

        return [default_python(self.cfg), "-m", "trainer"]

    def _generation_env(self, generation: int) -> dict[str, str]:
        """What a generation's ranks need beyond torch.distributed's variables."""
        chaos = self.cfg.chaos
        # The S3 endpoint (MinIO, ...) as botocore reads it, so every S3 client of a rank
        # (checkpoints, data, a user script's boto3) uses it; job.env can still override it.
        endpoint = self.cfg.checkpoint.endpoint_url
        return {
            **({"AWS_ENDPOINT_URL_S3": endpoint} if endpoint else {}),
            **self.cfg.job.env,
            "ORCH_JOB": self.cfg.job.name,
            "ORCH_GENERATION": str(generation),
            "ORCH_CHECKPOINT_ROOT": self.checkpoint_root,
            "ORCH_SKIP_WINDOWS": json.dumps(self.view.skip_windows),
            "ORCH_LR_SCALE": repr(self.view.lr_scale),
            # 0 is a limit too (a rollback to before the first checkpoint: start afresh).
            "ORCH_RESUME_MAX_STEP": "" if self.intake.resume_max_step is None
                                    else str(self.intake.resume_max_step),
            "ORCH_COLLECTIVE_TIMEOUT_S": str(round(collective_timeout_s(
                self.cfg.timeouts, self.intake.training_timeout), 1)),
            "ORCH_CHAOS": json.dumps({"poison_batches": chaos.poison_batches,
                                      "fail_at_start_rank": chaos.fail_at_start_rank,
                                      "slow_checkpoint_s": chaos.slow_checkpoint_s,
                                      "slow_first_step_s": chaos.slow_first_step_s,
                                      "kills": self.intake.chaos.pending()}),
        }

    async def _watch(self, generation: int, adopting: bool = False) -> Outcome | None:
        """LAUNCHING/RUNNING: observe until the generation completes (None) or fails."""
        intake = self.intake
        loop = asyncio.get_running_loop()
        launch_deadline = loop.time() + self.cfg.timeouts.launch_s
        while True:
            if self.stop_requested.is_set():
                return Outcome(Cause.OPERATOR, {"reason": self.stop_reason})
            try:
                obs: Observation | None = await asyncio.wait_for(intake.queue.get(), _TICK_S)
            except TimeoutError:
                obs = None
            outcome = intake.judge(generation, obs)
            if outcome is not None:
                return outcome if outcome.cause is not Cause.COMPLETED else None
            if self.view.state is JobState.LAUNCHING:
                if intake.all_started(generation):
                    self.transition(JobState.RUNNING)
                elif loop.time() > launch_deadline:
                    return Outcome(Cause.WORKER_EXIT if not adopting else Cause.NODE_LOST,
                                   {"message": "ranks did not start within "
                                               f"{self.cfg.timeouts.launch_s:.0f} s"})
            await intake.tick(generation)

    async def _dump_stacks(self, generation: int) -> list[str]:
        """Every rank writes its Python stacks (faulthandler on SIGUSR1) before the kill.

        SIGCONT follows so a stopped process wakes to take the pending SIGUSR1; it is about
        to be stopped for good anyway.
        """
        nodes = self.intake.nodes
        ppn = self.cfg.cluster.procs_per_node
        for node in nodes.active():
            if node.node_rank is None or node.state is not NodeState.ACTIVE:
                continue
            for local in range(ppn):
                rank = node.node_rank * ppn + local
                await nodes.send_signal(node.node_id, rank, "SIGUSR1")
                await nodes.send_signal(node.node_id, rank, "SIGCONT")
        stacks = self.rundir.stacks
        wanted = [stacks / f"gen{generation:04d}-rank{r:05d}.txt"
                  for r in range(self.cfg.cluster.world_size)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeouts.stack_dump_wait_s
        while loop.time() < deadline:
            if all(p.exists() and p.stat().st_size > 0 for p in wanted):
                break
            await asyncio.sleep(0.1)
        found = [str(p) for p in wanted if p.exists() and p.stat().st_size > 0]
        self.log.warning("hang: stacks dumped", files=len(found), of=len(wanted),
                         dir=str(stacks))
        return found

    async def _stop_generation(self, generation: int) -> None:
        """STOPPING: stop every rank of the generation, wait for agents to confirm."""
        nodes = self.intake.nodes
        waiting = [n for n in nodes.active() if n.state is NodeState.ACTIVE]
        for node in waiting:
            await nodes.assign(node.node_id, action="stop", generation=generation)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeouts.stop_grace_s + 5.0
        while loop.time() < deadline:
            self.intake.mark_silent_nodes_lost()
            pending = [n for n in waiting if n.state is NodeState.ACTIVE
                       and n.stopped_generation != generation]
            if not pending:
                return
            try:
                obs = await asyncio.wait_for(self.intake.queue.get(), _TICK_S)
                self.intake.judge(generation, obs)
            except TimeoutError:
                pass
        for node in waiting:
            if node.stopped_generation != generation and node.state is NodeState.ACTIVE:
                self.intake.set_node_state(node, NodeState.LOST,
                                           reason="did not confirm the stop in time")

    async def _shutdown(self) -> None:
        """Tell agents to exit once the job is over; leave them running otherwise."""
        if not self.view.state.terminal:
            return
        for node_id in list(self.intake.nodes.nodes):
            await self.intake.nodes.assign(node_id, action="exit")
        await asyncio.sleep(0.3)  # one long-poll round trip for the agents to see it
        await self.launcher.close(timeout=self.cfg.timeouts.stop_grace_s + 5.0)


def _default_advertise_host(cfg: Config) -> str:
    """Simulated nodes reach us on loopback; real ones by this host's name."""
    if cfg.launcher.kind == "local":
        return "127.0.0.1"
    import socket

    return socket.getfqdn()


def _dump_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
