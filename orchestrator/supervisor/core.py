"""The supervisor: one asyncio process that drives a job through its state machine.

Template loop per generation (after torch elastic's ``_invoke_run``): health-check and place
nodes, launch, observe until the generation completes or fails, stop it, decide (restart
with backoff, or give up). Launch, stop and observe are the platform parts; agents carry
them out. Every state change goes through ``transition()``, which writes one journal event
and one log line.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from orchestrator.allocation import mismatch as allocation_mismatch
from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.config import Config, config_hash
from orchestrator.contracts import events as ev
from orchestrator.contracts.env import read_token
from orchestrator.contracts.events import Envelope, Event
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.state import Cause, JobState, NodeState, check_transition
from orchestrator.health.base import Level
from orchestrator.journal.store import Journal, SkipReport, read_journal
from orchestrator.journal.view import JobView
from orchestrator.launchers import AgentSpec, Launcher, build_launcher
from orchestrator.logs import get_logger
from orchestrator.roottasks import RootTaskFailed, RootTasks
from orchestrator.supervisor import recovery
from orchestrator.supervisor.bookkeeper import BookKeeper
from orchestrator.supervisor.chaos import ChaosDesk
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.deadlines import LoopLag
from orchestrator.supervisor.discovery import ScrapeTarget
from orchestrator.supervisor.gcpolicy import long_lived_heap
from orchestrator.supervisor.generation.outcome import JobFailed, Outcome
from orchestrator.supervisor.generation.parts import GenerationParts
from orchestrator.supervisor.health_rounds import HealthCoordinator
from orchestrator.supervisor.intake import Intake
from orchestrator.supervisor.leader import Leadership
from orchestrator.supervisor.metrics import SupervisorMetrics
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.policy import OperatorStop, RestartPolicy
from orchestrator.supervisor.profiles import ProfileDesk
from orchestrator.supervisor.recorder import Recorder
from orchestrator.supervisor.selection import NodeSelection
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.superseded import SupersededNodes

if TYPE_CHECKING:
    from orchestrator.supervisor.gateway.server import ApiWiring


class _Adopt:
    """Carried into the first handler when a restarted supervisor re-attaches."""


_ADOPT = _Adopt()


@dataclass(frozen=True)
class Next:
    """What a state handler returns: the next state, why, and what the next handler needs."""

    state: JobState
    cause: Cause | None = None
    reason: str | None = None
    delay_s: float | None = None
    carry: Any = None


class Supervisor:
    def __init__(self, cfg: Config, run: RunDir, *, clock: Clock = SYSTEM_CLOCK,
                 registry: CollectorRegistry | None = None,
                 launcher: Launcher | None = None, resumed: bool = False,
                 health_only: Level | None = None, leadership: Leadership | None = None,
                 advertise_host: str | None = None) -> None:
        self.cfg = cfg
        self.health_only = health_only  # `orchestrator health`: stop after HEALTH_CHECK
        self.rundir = run
        self.clock = clock
        self.resumed = resumed
        self.log = get_logger("orchestrator.supervisor")
        self.journal_skipped = SkipReport()
        view = JobView.from_events(read_journal(run.journal, self.journal_skipped))
        self.journal = Journal(run.journal, clock=clock.time)
        self.metrics = SupervisorMetrics(registry or CollectorRegistry(), cfg.job.name)
        self.metrics.set_info(cfg.trainer.model.preset, cfg.cluster.accelerator)
        growth = cfg.stability.growth
        self.metrics.set_thresholds(growth.ratio if growth.enabled else None)
        self.books = BookKeeper(run, self.metrics, clock)  # replays the run dir into metrics
        # With a standby: this process leads (its term's epoch on every order) until
        # ``leadership`` says otherwise; then it writes and orders nothing more.
        self.leadership = leadership
        guard = leadership.check if leadership is not None else None
        self.recorder = Recorder(self.journal, view, self.metrics, guard)
        self.checkpoint_root = run.checkpoint_root(cfg.checkpoint.url)
        self.ctx = JobContext(cfg, run, clock, self.recorder, self.log, self.checkpoint_root)
        self.policy = RestartPolicy(cfg.restart)
        self.token = run.ensure_token(read_token(os.environ) or None)
        self.launcher = launcher or build_launcher(cfg, self.record)
        self.stop_requested = asyncio.Event()
        self.stop_reason = ""
        self.stop_checkpoint = True
        # How late our own loop is: silences are judged without that time (deadlines).
        self.lag = LoopLag(clock, on_late=self._late)
        self.nodes = NodeRegistry(clock, self.record, self.metrics.set_nodes, lag=self.lag)
        if leadership is not None and leadership.term is not None:
            self.nodes.epoch, self.nodes.guard = leadership.term.epoch, guard
        self.stability = StabilityHook(self.ctx)
        self.health = HealthCoordinator(self.ctx, self.nodes, self.stop_requested)
        self.chaos = ChaosDesk(self.ctx, self.nodes)
        self.superseded = SupersededNodes(self.ctx, self.nodes)
        self.intake = Intake(self.ctx, self.nodes, self.stability, self.health.on_report,
                             note_superseded=self.superseded.note,
                             chaos_fired=self.chaos.mark_fired)
        self.parts = GenerationParts(self.ctx, self.nodes, self.intake.feed(), self.stability,
                                     self.stop_requested, self.transition, chaos=self.chaos,
                                     superseded=self.superseded)
        self.profiles = ProfileDesk(self.ctx, self.nodes, self.intake)
        self.selection = NodeSelection(self.ctx, self.intake, self.health, self.launcher,
                                       self.agent_spec, self.stop_requested)
        self.advertise_host = advertise_host or cfg.launcher.advertise_host or \
            _default_advertise_host(cfg)
        self.url = ""

    @property
    def view(self) -> JobView:
        return self.recorder.view

    # -- journal and state -----------------------------------------------------------------
    def record(self, event: Event, *, durable: bool = False) -> Envelope:
        """Write a journal event and fold it into the view and the metrics."""
        return self.recorder.record(event, durable=durable)

    def transition(self, target: JobState, *, cause: Cause | None = None,
                   reason: str | None = None, delay_s: float | None = None) -> None:
        """The one way the job changes state: checked, journaled (on disk before the next
        step acts on it), logged once."""
        current = self.view.state
        check_transition(current, target)
        self.record(ev.Transition(**{"from": current}, to=target, cause=cause,
                                  reason=None if reason is None else reason[:4096],
                                  generation=self.view.generation, delay_s=delay_s),
                    durable=True)
        self.log.info("job state", from_state=current.value, to_state=target.value,
                      cause=cause.value if cause else None, reason=reason,
                      generation=self.view.generation)

    def _late(self, seconds: float) -> None:
        self.metrics.late.labels(self.cfg.job.name).inc(seconds)
        if seconds >= 1.0:
            self.log.warning("supervisor loop late: node-loss deadlines extended by as much",
                             late_s=round(seconds, 2), late_total_s=round(self.lag.late_s, 2))

    def request_stop(self, reason: str = "operator", checkpoint: bool = True) -> None:
        """Stop the job (the API's /v1/stop, SIGTERM, Ctrl-C). With ``checkpoint``, ranks
        of the built-in trainer first save at their next step boundary (bounded by
        ``timeouts.stop_checkpoint_s``), so `up --resume` loses nothing."""
        if not self.stop_requested.is_set():
            self.stop_reason = reason[:500]
            self.stop_checkpoint = checkpoint
        self.stop_requested.set()

    # -- lifecycle -------------------------------------------------------------------------
    async def run(self) -> JobState:
        """Serve the API, drive the job to a terminal state, shut down. Returns the state.
        Full garbage collections are rare meanwhile (``gcpolicy``: at 2,048 nodes each
        held the loop 0.3 s, every few seconds)."""
        with long_lived_heap():
            return await self._run()

    def api_wiring(self) -> ApiWiring:
        """What the HTTP API may reach: these parts and callables, not the supervisor."""
        from orchestrator.supervisor.gateway.server import ApiWiring

        return ApiWiring(cfg=self.cfg, token=self.token, intake=self.intake,
                         rundir=self.rundir, metrics=self.metrics, log=self.log,
                         view=lambda: self.view, request_stop=self.request_stop,
                         ledger=self.books.refresh, order_profile=self.profiles.order)

    async def _run(self) -> JobState:
        from orchestrator.supervisor.gateway.server import ApiServer

        server = ApiServer(self.api_wiring())
        port = await server.start(self.cfg.metrics.host, self._listen_port())
        self.url = f"{server.scheme}://{self.advertise_host}:{port}"
        self.rundir.write_json(self.rundir.supervisor_info, {
            "pid": os.getpid(), "url": self.url, "port": port, "host": self.advertise_host,
            "started": self.clock.time()})
        self.log.info("supervisor listening", url=self.url, run_dir=str(self.rundir.root),
                      metrics=f"{self.url}/metrics")
        target = ScrapeTarget(self.cfg.metrics.targets_file, self.cfg.metrics.linger_s,
                              self.advertise_host, port)
        roots = RootTasks({"books": self.books.run(), "loop-lag": self.lag.run()},
                          owner="supervisor")
        try:
            if not self.view.job:
                self._record_created()
            gap = self.clock.time() - self.view.last_ts if self.resumed and self.view.last_ts \
                else None
            if self.journal_skipped.lines:
                self.record(ev.JournalSkipped(lines=self.journal_skipped.lines,
                                              reasons=self.journal_skipped.reasons))
                self.log.warning("journal lines skipped", lines=self.journal_skipped.lines,
                                 reasons=self.journal_skipped.reasons[:5])
            self.record(ev.SupervisorStarted(pid=os.getpid(), url=self.url,
                                             resumed=self.resumed, gap_s=gap,
                                             epoch=self.nodes.epoch or None), durable=True)
            if self.resumed and self.view.state is JobState.STOPPED:
                # The operator continues a stopped job: a new segment, fresh agents, from
                # the newest checkpoint; the books leave the stopped time out.
                self.transition(JobState.PENDING, reason="continued by the operator "
                                "(up --resume)")
            if self.view.state is JobState.PENDING:
                self._refuse_misfit(allocation_mismatch(self.cfg, os.environ))
            if not self.view.state.terminal:
                await self._drive_beside(roots)
        finally:
            await roots.cancel()
            self.books.refresh()
            await self._shutdown()
            await target.retire(self.view.state.terminal)
            self.stability.save_cache()
            await server.stop()
            self.journal.close()
            if self.leadership is not None and self.view.state.terminal:
                await self.leadership.resign()
        return self.view.state

    async def _drive_beside(self, roots: RootTasks) -> None:
        """The template loop, with the root tasks supervised beside it: one that fails
        (raises) stops the job's driving and the supervisor with its error, named, rather
        than leaving the books or the loop-lag watch dead while the job goes on."""
        drive = asyncio.create_task(self._drive(), name="supervisor:drive")
        driven = asyncio.Event()
        drive.add_done_callback(lambda _: driven.set())
        try:
            await roots.wait(driven)
        except BaseException as exc:  # a root task failed, or this task was cancelled
            if isinstance(exc, RootTaskFailed):
                self.log.error("supervisor root task failed; stopping", task=exc.name,
                               error=f"{type(exc.error).__name__}: {exc.error}",
                               exc_info=exc.error)
            drive.cancel()
            await asyncio.wait([drive])
            raise
        await drive  # its result, or its error

    def _listen_port(self) -> int:
        if self.resumed:  # agents know the old URL: listen where they look
            info = self.rundir.read_supervisor_info()
            if info and info.get("port"):
                return int(info["port"])
        return self.cfg.metrics.port

    def _record_created(self) -> None:
        self.rundir.config.write_text(_dump_yaml(self.cfg))
        self.record(ev.JobCreated(
            job=self.cfg.job.name, run_dir=str(self.rundir.root),
            config_hash=config_hash(self.cfg), world_size=self.cfg.cluster.world_size,
            nodes=self.cfg.cluster.nodes, spares=self.cfg.cluster.spares,
            # A script of the user's own: the trainer's step total is not its total.
            steps=0 if self.cfg.job.entrypoint else self.cfg.trainer.steps,
            checkpoint_root=self.checkpoint_root,
            launcher=self.cfg.launcher.kind, own_script=bool(self.cfg.job.entrypoint)),
            durable=True)

    def agent_spec(self) -> AgentSpec:
        from orchestrator.launchers.base import default_python

        # Every supervisor that may lead, this one first: agents follow a standby that takes
        # over (``agent.client``).
        heads = [self.url, *(u.rstrip("/") for u in self.cfg.leader.urls
                             if u.rstrip("/") != self.url)]
        return AgentSpec(",".join(heads), self.token, self.rundir, default_python(self.cfg))

    # -- the template loop ---------------------------------------------------------------
    async def _drive(self) -> None:
        """Drive the job through its states: one handler per state returns the next state
        (with the value the next handler needs); this loop makes the move through
        ``transition`` and checks for an operator's stop once per iteration."""
        handlers = {
            JobState.PENDING: self._on_pending,
            JobState.HEALTH_CHECK: self._on_health_check,
            JobState.LAUNCHING: self._on_launching,
            JobState.RUNNING: self._on_running,
            JobState.STOPPING: self._on_stopping,
            JobState.RECOVERING: self._on_recovering,
        }
        try:
            await self.launcher_start()
        except RuntimeError as exc:  # a launcher that cannot start here (srun, an allocation)
            if self.view.state is not JobState.PENDING:
                raise
            self._refuse_misfit(str(exc))
            return
        # A restarted supervisor finds its job mid-generation: re-attach before observing.
        carry: Any = _ADOPT if self.resumed and self.view.state in (
            JobState.LAUNCHING, JobState.RUNNING, JobState.STOPPING) else None
        while not self.view.state.terminal:
            state = self.view.state
            try:
                nxt = self._operator_stop(state) or await handlers[state](carry)
            except OperatorStop:
                nxt = self._operator_stop(state, always=True)
            except JobFailed as exc:
                nxt = Next(JobState.FAILED, cause=exc.cause, reason=str(exc))
            if nxt is None:
                raise RuntimeError(f"no way out of {state.value}")  # a bug: never swallowed
            self.transition(nxt.state, cause=nxt.cause, reason=nxt.reason, delay_s=nxt.delay_s)
            carry = nxt.carry

    def _refuse_misfit(self, problem: str | None) -> None:
        """A config that does not fit where the job runs (the allocation's size, a launcher
        that cannot start): a ``config`` failure in the journal and FAILED, before anything
        starts; a restart cannot fix it (never a traceback, never a PENDING job left)."""
        if not problem:
            return
        self.record(ev.Failure(cause=Cause.CONFIG, message=problem[:4096]), durable=True)
        self.log.error("the job does not fit where it runs", reason=problem)
        self.transition(JobState.FAILED, cause=Cause.CONFIG, reason=problem)

    def _operator_stop(self, state: JobState, always: bool = False) -> Next | None:
        """The move an operator's stop makes from ``state`` (None when none was asked for).
        A running generation is stopped first (STOPPING); otherwise the job is STOPPED."""
        if not (always or self.stop_requested.is_set()):
            return None
        if state in (JobState.LAUNCHING, JobState.RUNNING):
            return Next(JobState.STOPPING, cause=Cause.OPERATOR,
                        carry=Outcome(Cause.OPERATOR, {
                            "reason": self.stop_reason,
                            "checkpoint": self.stop_checkpoint and state is JobState.RUNNING}))
        if state is JobState.STOPPING:
            return None  # the stop under way finishes first, then STOPPED
        return Next(JobState.STOPPED, cause=Cause.OPERATOR, reason=self.stop_reason)

    async def launcher_start(self) -> None:
        """Get one agent per node started (or adopt those a dead supervisor started)."""
        spawned: dict[str, int] = {}
        for env in read_journal(self.rundir.journal):
            if isinstance(env.event, ev.AgentSpawned):
                spawned[env.event.node_id] = env.event.pid
            elif isinstance(env.event, ev.Transition) and env.event.to is JobState.PENDING:
                spawned = {}  # a continued job's agents were told to exit: start anew
        if spawned and self.leadership is not None:
            # A standby taking over (maybe on another host): the agent pids in the journal
            # are not ours to judge; the agents find this supervisor on their own, and one
            # that does not is a lost node like any other.
            await self.launcher.adopt(self.agent_spec(), {})
        elif spawned:
            await self.launcher.adopt(self.agent_spec(), spawned)
        else:
            await self.launcher.start(self.agent_spec())

    async def _on_pending(self, carry: Any) -> Next:
        return Next(JobState.HEALTH_CHECK)

    async def _on_health_check(self, carry: Any) -> Next:
        if self.health_only is not None:
            reason = await self.selection.check_only(self.health_only)
            return Next(JobState.STOPPED, cause=Cause.OPERATOR, reason=reason)
        return Next(JobState.LAUNCHING, carry=await self.selection.select())

    async def _on_launching(self, carry: Any) -> Next:
        if carry is _ADOPT:
            return await self._observed(self.view.generation, adopting=True)
        generation = self.view.generation + 1
        if isinstance(carry, recovery.InPlace):
            await self.parts.launch(generation, carry.placement, replace=carry.replace)
        else:
            await self.parts.launch(generation, carry)
        return await self._observed(generation)

    async def _on_running(self, carry: Any) -> Next:
        return await self._observed(self.view.generation, adopting=carry is _ADOPT)

    async def _observed(self, generation: int, adopting: bool = False) -> Next:
        """Observe a generation (after re-attaching to it, when adopting) to its end."""
        outcome = await self.parts.adopt(generation) if adopting else None
        if outcome is None:
            outcome = await self.parts.observe(generation, adopting=adopting)
        if outcome is not None and outcome.cause is Cause.OPERATOR:
            stop = self._operator_stop(self.view.state, always=True)
            assert stop is not None  # LAUNCHING or RUNNING: a stop goes through STOPPING
            return stop
        if outcome is not None:
            return Next(JobState.STOPPING, cause=outcome.cause, carry=outcome)
        self.intake.progress.journal_progress()
        if self.view.state is JobState.LAUNCHING:  # finished before its starts were seen
            self.transition(JobState.RUNNING)
        return Next(JobState.COMPLETED, cause=Cause.COMPLETED)

    async def _on_stopping(self, carry: Any) -> Next:
        generation = self.view.generation
        outcome: Outcome = carry if isinstance(carry, Outcome) else Outcome(
            Cause.NODE_LOST, {"message": "the supervisor died while stopping this generation"})
        if carry is _ADOPT:
            outcome = await self.parts.adopt(generation) or outcome
        if outcome.cause is Cause.HANG:
            outcome.detail["stacks"] = await self.parts.dump_stacks(generation)
        saved = None
        if outcome.cause is Cause.OPERATOR and outcome.detail.get("checkpoint"):
            saved = await self.parts.final_checkpoint(generation)
        if outcome.cause is Cause.OPERATOR:
            await self.parts.stop(generation)
            return Next(JobState.STOPPED, cause=Cause.OPERATOR,
                        reason=self.stop_reason + (f"; {saved}" if saved else ""))
        outcome = self._explain_by_lost_node(outcome)
        path = self._recovery_path(generation, outcome) if carry is not _ADOPT else \
            recovery.Path(recovery.RESTART, "the supervisor restarted while stopping")
        if not path.in_job:
            await self.parts.stop(generation)
            # A node that died with its ranks shows as lost only once the stop has waited
            # for its agent's confirmation.
            outcome = self._explain_by_lost_node(outcome)
        failure = self.parts.judging(generation).root_cause(outcome.cause, outcome.detail)
        failure.update(recovery_path=path.kind, recovery_reason=path.reason[:4096])
        self.record(ev.Failure(**failure), durable=True)
        self.log.error("generation failed", **{k: v for k, v in failure.items()
                                               if k != "log_tail"})
        if not path.in_job:
            self._blame_node(failure)
        # A pending rollback is carried out whatever stopped the generation: a rank that
        # crashed on a NaN still diverged first.
        refusal = self.stability.refusal(self.view, failure.get("generation"))
        decision = self.policy.decide(self.view)
        if refusal or not decision.restart:
            if path.in_job:  # the survivors wait for an order that will not come
                await self.parts.stop(generation)
            return Next(JobState.FAILED, cause=outcome.cause,
                        reason=refusal or decision.reason)
        if path.in_job:
            return Next(JobState.RECOVERING, cause=outcome.cause, delay_s=0.0,
                        carry=recovery.InPlace(recovery.placement_of(self.view),
                                               path.replace))
        return Next(JobState.RECOVERING, cause=outcome.cause, delay_s=decision.delay_s,
                    carry=failure)

    def _recovery_path(self, generation: int, outcome: Outcome) -> recovery.Path:
        """In place, or every rank restarted (``supervisor.recovery``); a node that would
        be blamed for one failure too many is replaced by a spare, which a restart does."""
        replace = recovery.failed_ranks(outcome.cause, outcome.detail,
                                         self.parts.judging(generation).exits,
                                         self.cfg.timeouts.heartbeat_interval_s,
                                         self.cfg.cluster.world_size)
        blamed = self._blame_due(outcome.detail.get("node_id"))
        if blamed:
            return recovery.Path(recovery.RESTART, blamed)
        if self.stability.divergence(generation) is not None:
            return recovery.Path(recovery.RESTART, "a stability rollback is pending: every "
                                 "rank restarts with its skip window")
        return recovery.choose_path(self.cfg, self.view, outcome.cause,
                                    {"generation": generation}, replace,
                                    self.intake.progress.current, self.nodes)

    async def _on_recovering(self, carry: Any) -> Next:
        if isinstance(carry, recovery.InPlace):
            return Next(JobState.LAUNCHING, carry=carry)
        failure = carry if isinstance(carry, dict) else (
            self.view.failures[-1] if self.view.failures else {})
        self.intake.stragglers.exclude_at_restart(self.nodes)  # with action: exclude
        try:
            self.stability.roll_back(self.view, failure)
        except OSError as exc:  # resuming the abandoned lineage later would be worse
            raise JobFailed(f"rollback could not discard the abandoned checkpoints: {exc}") \
                from exc
        # The backoff the RECOVERING transition journaled (a restarted supervisor too).
        await self._sleep_or_stop(self.view.recovery_delay_s or 0.0)
        return Next(JobState.HEALTH_CHECK)

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await self.clock.wait_for(self.stop_requested.wait(), seconds)
        except TimeoutError:
            return
        raise OperatorStop()

    def _explain_by_lost_node(self, outcome: Outcome) -> Outcome:
        """A node of the generation that went silent explains its peers' failing exits.

        When a node dies, ranks elsewhere fail within milliseconds (their collectives lose
        a peer) and report before the node's silence can be established; the root cause is
        still the node, which shows by its not confirming the stop.
        """
        if outcome.cause is not Cause.WORKER_EXIT:
            return outcome
        members = set(self.view.launches[-1]["nodes"]) if self.view.launches else set()
        lost = [n for n in self.nodes.with_state(NodeState.LOST) if n.node_id in members]
        if not lost:
            return outcome
        node = lost[0]
        exit_msg = outcome.detail.get("rank")
        return Outcome(Cause.NODE_LOST, {
            "node_id": node.node_id,
            "message": f"node {node.node_id} was lost (agent silent); the exit of rank "
                       f"{exit_msg} on another node followed from it"})

    def _blame_due(self, node_id: str | None) -> str | None:
        """Why the next failure of ``node_id`` gets it excluded (it reaches
        ``restart.node_failure_limit`` in the window, and a spare can take its place), or
        None. Counts the failure being judged, which is not journaled yet."""
        node = self.nodes.nodes.get(node_id or "")
        if node is None or node.state is not NodeState.ACTIVE:
            return None
        r = self.cfg.restart
        now = self.clock.time()
        recent = [f for f in self.view.failures if f.get("node_id") == node_id
                  and now - (f.get("ts") or now) <= r.node_failure_window_s]
        if len(recent) + 1 < r.node_failure_limit or not self.nodes.with_state(NodeState.SPARE):
            return None
        return (f"node {node_id} failed {len(recent) + 1} times in "
                f"{r.node_failure_window_s:.0f} s: a spare replaces it")

    def _blame_node(self, failure: dict[str, Any]) -> None:
        """Exclude a node blamed for too many failures, when a spare can take its rank."""
        node_id = failure.get("node_id")
        node = self.nodes.nodes.get(node_id or "")
        if node is None or node.state is not NodeState.ACTIVE:
            return
        r = self.cfg.restart
        now = self.clock.time()
        recent = [f for f in self.view.failures if f.get("node_id") == node_id
                  and now - (f.get("ts") or now) <= r.node_failure_window_s]
        if len(recent) < r.node_failure_limit:
            return
        spares = self.nodes.with_state(NodeState.SPARE)
        if not spares:
            self.log.warning("node keeps failing but no spare can replace it", node=node_id,
                             failures=len(recent))
            return
        self.nodes.move(node, NodeState.EXCLUDED, node_rank=None,
                        reason=f"{len(recent)} failures in {r.node_failure_window_s:.0f} s")
        self.log.warning("node excluded", node=node_id, failures=len(recent),
                         replacement=spares[0].node_id)

    async def _shutdown(self) -> None:
        """Tell agents to exit once the job is over; leave them running otherwise."""
        if not self.view.state.terminal:
            return
        for node_id in list(self.intake.nodes.nodes):
            await self.intake.nodes.assign(node_id, action="exit")
        await self.clock.sleep(0.3)  # one long-poll round trip for the agents to see it
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
