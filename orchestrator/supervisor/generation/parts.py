"""The platform parts of one generation: launch, observe, stop, stack dumps, adoption.

torch elastic splits its agent into ``_start_workers``, ``_monitor_workers`` and
``_stop_workers`` under one template loop; these are ours. The supervisor's loop
(``core.Supervisor._drive``) decides what happens next from what these return; they change
no job state themselves (node states go through the registry's state machine, events
through the recorder). Every deadline and sleep reads the one clock.

Each launch (or adoption) gets its own ``judge.Generation``: the observe and stop loops hand
it what the intake queued, and it returns the launch's outcome. The intake only learns
which launch its news is for. Between batches a turn of the observe loop hands the periodic
work to its owners: the ``Generation`` (calibration, stragglers), ``SupersededNodes`` and
the ``ChaosDesk``; the training timeout, which outlives a launch, is held here.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from typing import Any

from orchestrator.contracts import events as ev
from orchestrator.contracts.rundir import is_remote, stack_file_name
from orchestrator.contracts.state import Cause, JobState, NodeState
from orchestrator.supervisor.chaos import ChaosDesk
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.generation.hangs import TrainingTimeout, collective_timeout_s
from orchestrator.supervisor.generation.judge import Generation, Observation
from orchestrator.supervisor.generation.outcome import Outcome
from orchestrator.supervisor.intake import IntakeFeed
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.placement import Placement
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.superseded import SupersededNodes

# The signal that asks a rank of the built-in trainer for a checkpoint at its next step
# boundary (orchestrator.worker installs the handler).
CHECKPOINT_SIGNAL = "SIGUSR2"
# How often the observe loop wakes without news, to check silences and timeouts.
TICK_S = 0.2
# The agents confirm a stop within the ranks' grace; this much more covers the round trips:
# 5 s, plus 5 ms per node waited on (2,048 confirmations are 2,048 requests for the
# supervisor to take in), on the service clock (time the supervisor was late is added).
_STOP_CONFIRM_EXTRA_S = 5.0
_STOP_CONFIRM_PER_NODE_S = 0.005
# The observe and stop loops take at most this many queued observations per turn of the
# loop (about two bursts' answers, ``nodes._ASSIGN_BURST``). A launch or a stop queues a
# ``ranks_started``, ``ranks_stopped`` or ``ranks_exited`` from every node while the
# assignments go out; taken 4,096 at a time, 1,024 nodes' journal records, folds and
# metrics ran in one block of the loop and the heartbeats waited behind it (the first
# launch and the stops: most of the late beats left at 1,024 x 8). Silences and hangs are
# still checked once per batch (oldest-first, ``deadlines``: cheap).
_BATCH = 64


class GenerationParts:
    """Launch, observe and stop one generation of the job's ranks.

    ``stop_requested`` ends an observation early; ``transition`` is the supervisor's one way
    to move the job (called only for LAUNCHING -> RUNNING, which happens mid-observation);
    ``chaos`` gives each launch its fault-injection plan and sends interval kills;
    ``superseded`` tells nodes back with an old generation's ranks to stop them;
    ``intake`` is the part of the message intake they use (``Intake.feed``).
    """

    def __init__(self, ctx: JobContext, nodes: NodeRegistry, intake: IntakeFeed,
                 stability: StabilityHook, stop_requested: asyncio.Event,
                 transition: Callable[[JobState], None], *, chaos: ChaosDesk,
                 superseded: SupersededNodes) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.nodes = nodes
        self.intake = intake
        self.stability = stability
        self.chaos = chaos
        self.superseded = superseded
        # Calibrated from the steps of every launch and carried over from the journal's
        # last ``calibration``: each launch's ``Generation`` judges hangs by it and journals
        # it as it moves; the ranks' collective timeout is set above it.
        self.training_timeout = TrainingTimeout(
            ctx.cfg.timeouts, ctx.view.calibration.get("max_interval_s"),
            ctx.view.calibration.get("intervals") or 0)
        self.stop_requested = stop_requested
        self._transition = transition
        self.current: Generation | None = None  # the launch observed (or adopted) last

    # -- the launch's judge ------------------------------------------------------------------
    def begin(self, generation: int, world_size: int, adopting: bool = False) -> Generation:
        """A new ``Generation`` for the launch (or adoption) of ``generation``; the intake's
        news of ranks is for it from now on."""
        self.current = self._generation(generation, world_size)
        self.intake.begin_generation(generation, world_size, adopting=adopting,
                                     live_ranks=self.current.set_started)
        self.chaos.begin_generation()
        return self.current

    def judging(self, generation: int) -> Generation:
        """The ``Generation`` that judges ``generation``: the one launched or adopted. A
        supervisor restarted mid-generation and stopped before it adopted any has none:
        then one of no ranks, which journals what the agents say and counts no exit."""
        if self.current is not None and self.current.number == generation:
            return self.current
        return self._generation(generation, 0)

    def _generation(self, generation: int, world_size: int) -> Generation:
        intake = self.intake
        return Generation(generation, world_size, ctx=self.ctx, nodes=self.nodes,
                          progress=intake.progress, training_timeout=self.training_timeout,
                          divergence=self.stability.divergence,
                          mark_lost=intake.mark_silent_nodes_lost,
                          on_worker=intake.worker_event, stragglers=intake.stragglers_tick)

    # -- launch ------------------------------------------------------------------------------
    async def launch(self, generation: int, placement: Placement,
                     replace: list[int] | None = None) -> None:
        """Launch ``generation`` on ``placement``. With ``replace`` (an in-job recovery),
        the previous generation's live ranks join it in place and the ranks named there
        are started anew."""
        nodes = self.nodes
        in_place = replace is not None
        rank0 = next(n for n, r in placement.active.items() if r == 0)
        master = nodes.nodes[rank0]
        ppn = self.cfg.cluster.procs_per_node
        env = self.generation_env(generation, resume_max_step=self.stability.resume_limit())
        self.stability.launched()  # a rollback's limit holds for one launch only
        entrypoint, preload = self.entrypoint(), self.preload()  # the same for every node
        assignments = {}
        for node_id, node_rank in placement.active.items():
            assignments[node_id] = {
                "action": "run", "generation": generation, "node_rank": node_rank,
                "nproc": ppn, "world_size": self.cfg.cluster.world_size,
                "rank_offset": node_rank * ppn, "master_addr": master.addr,
                "master_port": master.free_port, "entrypoint": entrypoint,
                "env": env, "signals": [], "profiles": [], "preload": preload,
                "standby_prepare": self.standby_prepare(), "in_place": in_place,
                "replace": [r for r in replace or [] if node_rank * ppn <= r <
                            (node_rank + 1) * ppn]}
        view = self.ctx.view
        after = view.ended_by if generation > 1 else None
        # Checked (its 2,048 assignments walked by the JSON bounds: 0.13 s at 2,048 nodes)
        # in a thread, so the loop keeps serving beats meanwhile; nothing else holds
        # ``assignments`` until it is journaled.
        launched = await asyncio.to_thread(
            ev.GenerationLaunched, generation=generation,
            world_size=self.cfg.cluster.world_size, master_addr=master.addr,
            master_port=master.free_port, nodes=placement.active, spares=placement.spares,
            after_cause=after, resume_step=view.newest_checkpoint_step,
            assignments=assignments, in_place=in_place, replaced=sorted(replace or []))
        self.begin(generation, self.cfg.cluster.world_size)
        self.ctx.record(launched, durable=True)
        for node_id, assignment in assignments.items():
            await nodes.assign(node_id, **assignment)
        for node_id in placement.spares:
            await nodes.assign(node_id, action="idle", generation=None)
        for node in nodes.with_state(NodeState.EXCLUDED):
            await nodes.assign(node.node_id, action="idle", generation=None)

    def preload(self) -> list[str]:
        """What a spare interpreter imports ahead of a restart: the built-in trainer's
        modules; for a user's script (``python [flags] SCRIPT.py``) torch and the worker
        SDK, the imports every such script pays."""
        if not self.cfg.job.warm_start:
            return []
        if self.cfg.job.entrypoint:
            return list(SCRIPT_PRELOAD)
        modules = ["trainer.main", "trainer.build", "trainer.loop"]
        if self.cfg.trainer.parallelism.compile:  # TorchDynamo and Inductor, seconds of them
            modules.append("trainer.warm_compile")
        return modules

    def standby_prepare(self) -> str | None:
        """The function a spare runs to become a warm standby for in-job replacements
        (``restart.standby``), or None: plain spares."""
        r = self.cfg.restart
        if not self.preload() or not (r.in_job and r.standby):
            return None
        return "trainer.standby:prepare"

    def entrypoint(self) -> list[str]:
        from orchestrator.launchers.base import default_python

        if self.cfg.job.entrypoint:
            return own_python(list(self.cfg.job.entrypoint), default_python(self.cfg))

        # -P: the rank's working directory (a user's `trainer.py`, say) cannot shadow ours.
        return [default_python(self.cfg), "-P", "-m", "trainer"]

    def generation_env(self, generation: int, *, resume_max_step: int | None) -> dict[str, str]:
        """What a generation's ranks need beyond torch.distributed's variables.

        ``resume_max_step`` is the newest step the ranks may resume from (a rollback's limit,
        ``StabilityHook.resume_limit``), None for any; the collective timeout is set above
        the training timeout held here, and the chaos desk gives the fault-injection plan."""
        # The S3 endpoint (MinIO, ...) as botocore reads it, so every S3 client of a rank
        # (checkpoints, data, a user script's boto3) uses it; job.env can still override it.
        endpoint = self.cfg.checkpoint.endpoint_url
        # The job's checkpoint signing key (a path, never the key itself: the assignment is
        # journaled); generated once at 0600 when none is given, beside a local checkpoint
        # root (the run directory by default), so every run that shares those checkpoints
        # (a requeued Slurm job's next attempt, say) shares the key; else in the run dir.
        from orchestrator.contracts.env import GenerationEnv
        from trainer.checkpoint import signing

        root = self.ctx.checkpoint_root
        key_home = signing.default_key_path(root).parent if root and \
            not is_remote(root) else self.ctx.rundir.root

        # In-job recovery: NCCL's watchdog aborts a communicator whose peer failed and
        # raises in the rank (2, CleanUpOnly) instead of ending the process (torchrun's 1,
        # TearDown), so a survivor lives to rejoin.
        nccl = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"} if self.cfg.restart.in_job else {}
        return {
            **({"AWS_ENDPOINT_URL_S3": endpoint} if endpoint else {}),
            **nccl,
            **self.cfg.job.env,
            **signing.generation_env(key_home, self.cfg.job.env),
            **GenerationEnv(
                job=self.cfg.job.name, generation=generation,
                checkpoint_root=self.ctx.checkpoint_root,
                skip_windows=self.ctx.view.skip_windows, lr_scale=self.ctx.view.lr_scale,
                # 0 is a limit too (a rollback to before the first checkpoint: start afresh).
                resume_max_step=resume_max_step,
                collective_timeout_s=collective_timeout_s(
                    self.cfg.timeouts, self.training_timeout,
                    own_script=self.cfg.job.entrypoint is not None),
                chaos=self.chaos.plan(),
                in_job_wait_s=self.cfg.restart.in_job_wait_s if self.cfg.restart.in_job
                else None,
                run_id=self.ctx.view.run_id, lineage=self.ctx.view.lineage(generation),
            ).to_env(),
        }

    # -- observe -----------------------------------------------------------------------------
    async def observe(self, generation: int, *, adopting: bool = False,
                      within_s: float | None = None) -> Outcome | None:
        """LAUNCHING/RUNNING: observe until the generation completes (None) or fails.

        Moves LAUNCHING -> RUNNING once every rank has started. An operator's stop ends the
        observation with an ``operator`` outcome, unless ``within_s`` bounds it instead (the
        ranks' final checkpoint after a stop): then TimeoutError when it runs out."""
        clock = self.ctx.clock
        judge = self.judging(generation)
        launch_deadline = clock.monotonic() + self.cfg.timeouts.launch_s
        end = None if within_s is None else clock.monotonic() + within_s
        while True:
            if end is None and self.stop_requested.is_set():
                return Outcome(Cause.OPERATOR, {})
            if end is not None and clock.monotonic() > end:
                raise TimeoutError
            outcome = judge.judge(await self._next_batch())
            # Every rank started within the batch that also ends the generation: it ran.
            if self.ctx.view.state is JobState.LAUNCHING and judge.all_started():
                self._transition(JobState.RUNNING)
            if outcome is not None:
                return outcome if outcome.cause is not Cause.COMPLETED else None
            if self.ctx.view.state is JobState.LAUNCHING and \
                    clock.monotonic() > launch_deadline:
                return Outcome(Cause.WORKER_EXIT if not adopting else Cause.NODE_LOST,
                               {"message": "ranks did not start within "
                                           f"{self.cfg.timeouts.launch_s:.0f} s"})
            # A turn's periodic work, in the order it always ran (the journal of a turn
            # keeps its order): calibration and stragglers, superseded nodes, then kills.
            judge.tick()
            await self.superseded.stop(generation)
            await self.chaos.tick(generation)

    async def _next_batch(self) -> list[Observation]:
        """What is queued (waiting up to one tick for the first): judged as one batch, so
        silences and hangs are checked once per batch, not once per observation."""
        queue = self.intake.queue
        try:
            batch = [await self.ctx.clock.wait_for(queue.get(), TICK_S)]
        except TimeoutError:
            return []
        while len(batch) < _BATCH and not queue.empty():
            batch.append(queue.get_nowait())
        if len(batch) == _BATCH:  # more may be queued: the beats get a turn before them
            await asyncio.sleep(0)
        return batch

    async def adopt(self, generation: int) -> Outcome | None:
        """After a supervisor restart mid-run: re-attach to the running generation.

        Agents kept their ranks training and re-register on their own; once every node of
        the generation is back, it gets its assignment re-issued unchanged (a no-op for the
        agent). Returns the outcome when the generation cannot go on (a node did not come
        back, or the supervisor died while stopping it), else None: observe on."""
        launch = self.ctx.view.launches[-1]
        judge = self.begin(generation, launch["world_size"], adopting=True)
        assignments: dict[str, dict[str, Any]] = launch["assignments"]
        clock = self.ctx.clock
        deadline = clock.monotonic() + self.cfg.timeouts.node_lost_s
        while clock.monotonic() < deadline and not set(assignments) <= set(self.nodes.nodes):
            if self.stop_requested.is_set():
                break
            await clock.sleep(TICK_S)
        missing = sorted(set(assignments) - set(self.nodes.nodes))
        for node_id, assignment in assignments.items():
            if node_id not in missing:
                node = self.nodes.nodes[node_id]
                if node.generation == generation:  # registered before we were listening
                    judge.set_started(node_id, sorted(node.ranks))
                await self.nodes.assign(node_id, **assignment)
        if self.ctx.view.state is JobState.STOPPING:
            return Outcome(Cause.NODE_LOST, {
                "message": "the supervisor died while stopping this generation"})
        if missing:
            return Outcome(Cause.NODE_LOST, {
                "node_id": missing[0],
                "message": f"node(s) {', '.join(missing)} did not come back after the "
                           "supervisor restart"})
        return None

    # -- stop --------------------------------------------------------------------------------
    async def final_checkpoint(self, generation: int) -> str:
        """An operator's stop: ask every rank for a checkpoint at its next step boundary
        (SIGUSR2; the ranks agree on the step and exit once it is committed) and wait for
        them, bounded by ``timeouts.stop_checkpoint_s``. Returns what happened, in words."""
        limit = self.cfg.timeouts.stop_checkpoint_s
        if limit <= 0:
            return "no final checkpoint (timeouts.stop_checkpoint_s is 0)"
        before = self.ctx.view.newest_checkpoint_step
        if self.cfg.job.entrypoint and (not self.cfg.job.framework_hooks or before is None):
            # A script of the user's own answers the request only through a framework hook
            # (orchestrator.worker.hooks), and a script that has committed a checkpoint
            # through the orchestrator has one; any other saves on its own schedule (the
            # request would only set a flag it never reads).
            return "no final checkpoint (job.entrypoint is a script of your own that has " \
                   "committed no checkpoint through a framework hook)"
        for node in self.nodes.active():
            if node.node_rank is None or node.state is not NodeState.ACTIVE:
                continue
            ranks = sorted(node.ranks) or range(
                node.node_rank * self.cfg.cluster.procs_per_node,
                (node.node_rank + 1) * self.cfg.cluster.procs_per_node)
            # One assignment change per node carries all its ranks' requests.
            await self.nodes.send_signals(node.node_id,
                                          [(rank, CHECKPOINT_SIGNAL) for rank in ranks])
        self.ctx.log.info("stop: asked the ranks for a final checkpoint", within_s=limit)
        try:
            outcome = await self.observe(generation, within_s=limit)
        except TimeoutError:
            return f"no final checkpoint within {limit:.0f} s"
        newest = self.ctx.view.newest_checkpoint_step
        if outcome is not None or newest == before or newest is None:
            why = f" ({outcome.cause.value})" if outcome is not None else ""
            return f"no final checkpoint{why}; the newest is step {newest}"
        return f"final checkpoint at step {newest}"

    async def dump_stacks(self, generation: int) -> list[str]:
        """Every rank writes its Python stacks (faulthandler on SIGUSR1) before the kill;
        its agent reads a stopped rank's from outside (py-spy) and leaves it stopped, so a
        rank judged hung cannot wake and train on until its kill."""
        ppn = self.cfg.cluster.procs_per_node
        for node in self.nodes.active():
            if node.node_rank is None or node.state is not NodeState.ACTIVE:
                continue
            ranks = range(node.node_rank * ppn, (node.node_rank + 1) * ppn)
            # One assignment change per node carries all its ranks' orders.
            await self.nodes.send_signals(node.node_id, [(r, "SIGUSR1") for r in ranks])
        stacks = str(self.ctx.rundir.stacks)
        wanted = [stack_file_name(generation, r) for r in range(self.cfg.cluster.world_size)]
        clock = self.ctx.clock
        deadline = clock.monotonic() + self.cfg.timeouts.stack_dump_wait_s
        done: set[str] = set()
        while clock.monotonic() < deadline:
            # Off the loop: at 2,048 x 8 a look is a listing of 16k names and a stat of each
            # one not yet seen written; on the loop that held it up to 35 ms at a time, 0.19 s
            # a hang (bench/supervisor/stack_scan.py), and the beats waited behind it.
            done |= await asyncio.to_thread(written_since, stacks, frozenset(done))
            if len(done) >= len(wanted) and done.issuperset(wanted):
                break
            await clock.sleep(0.25)
        found = [os.path.join(stacks, name) for name in wanted if name in done]
        self.ctx.log.warning("hang: stacks dumped", files=len(found), of=len(wanted),
                             dir=stacks)
        return found

    async def stop(self, generation: int) -> None:
        """STOPPING: stop every rank of the generation, wait for agents to confirm; a node
        that does not confirm in time is LOST."""
        nodes, judge = self.nodes, self.judging(generation)
        waiting = [n for n in nodes.active() if n.state is NodeState.ACTIVE]
        for node in waiting:
            await nodes.assign(node.node_id, action="stop", generation=generation)
        limit = self.cfg.timeouts.stop_grace_s + _STOP_CONFIRM_EXTRA_S + \
            _STOP_CONFIRM_PER_NODE_S * len(waiting)
        deadline = nodes.service_time() + limit
        pending = waiting
        while nodes.service_time() < deadline:
            self.intake.mark_silent_nodes_lost()
            # Confirmations mark their node as they arrive (Intake.on_events); the queue is
            # drained here only to journal what the agents said.
            pending = [n for n in pending if n.state is NodeState.ACTIVE
                       and n.stopped_generation != generation]
            if not pending:
                # Every node confirmed on arrival; what they said (their stops and exits)
                # is journaled before the next generation, when it would be a straggler.
                while not self.intake.queue.empty():
                    judge.judge(await self._next_batch())
                return
            judge.judge(await self._next_batch())
        for node in waiting:
            if node.stopped_generation != generation and node.state is NodeState.ACTIVE:
                nodes.move(node, NodeState.LOST, reason="did not confirm the stop in time "
                           f"({limit:.1f} s for {len(waiting)} nodes)")


# A script's spare: what any torch training script imports first.
SCRIPT_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "orchestrator.worker")


def written_since(folder: str, seen: frozenset[str]) -> set[str]:
    """Names in ``folder`` not in ``seen`` whose file is non-empty (written): one listing,
    and a stat only for names not seen written before. A missing folder has none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    fresh = set()
    for name in names:
        if name in seen:
            continue
        try:
            if os.stat(os.path.join(folder, name)).st_size > 0:
                fresh.add(name)
        except OSError:
            continue  # removed meanwhile, or not readable: not a stack file for us
    return fresh


_BARE_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def own_python(argv: list[str], python: str) -> list[str]:
    """A bare ``python``/``python3`` entrypoint runs on the orchestrator's own interpreter
    (``launcher.python``, else the one running it), as torchrun starts scripts with its own
    ``sys.executable``: looked up on the ranks' PATH it can be another Python without the
    orchestrator (an unactivated venv: every rank died in the preload hook). A path is kept
    as given."""
    if argv and _BARE_PYTHON.fullmatch(argv[0]):
        return [python, *argv[1:]]
    return argv
