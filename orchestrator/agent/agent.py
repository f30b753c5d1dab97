"""The node agent: registers with the supervisor, runs its assignment, relays heartbeats.

It keeps its ranks training when the supervisor goes away, holds their progress and exits,
and re-registers when a supervisor answers again at the same URL. Rank exits are reported
the moment ``waitpid`` returns, not at the next heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.contracts import env as ec
from orchestrator.agent.client import SupervisorClient, SupervisorError, Unreachable
from orchestrator.agent.health import HealthWork
from orchestrator.agent.keyservice import KeyService, make_undumpable
from orchestrator.agent.lease import SupervisorLease
from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
from orchestrator.agent.memory import NodeMemory, read_tier_pages
from orchestrator.agent.nodeconfig import NodeConfig, preload_pythonpath
from orchestrator.agent.rank_env import huge_page_malloc
from orchestrator.agent.ranks import Rank, RankSet, RankSetup
from orchestrator.roottasks import RootTaskFailed, RootTasks
from orchestrator.agent.warm import SpareKind, WarmPool
from orchestrator.logs import get_logger
from orchestrator.contracts.protocol import (
    Assignment,
    Heartbeat,
    ProfileOrder,
    RankExit,
    RankInfo,
    RanksStarted,
    RanksStopped,
    RegisterRequest,
    RegisterResponse,
    WorkerEvent,
    keep_valid_records,
)
from orchestrator.contracts.rundir import STACKS_DIR, stack_file_name
from orchestrator.contracts.steprecord import MAX_RECORDS_PER_BEAT

# Events held while the supervisor is unreachable; beyond this the oldest are dropped.
_MAX_QUEUED_EVENTS = 10_000
# Answers that refuse a beat for what it says (not for a supervisor that is not ready):
# its records are not sent again.
_REFUSED = (400, 403, 409, 413, 422)


class Agent:
    def __init__(self, head_url: str, token: str, node_id: str, *, addr: str, procs: int,
                 run_dir: Path, orphan_timeout_s: float = 0.0) -> None:
        self.node_id = node_id
        self.addr = addr
        self.procs = procs
        self.run_dir = run_dir
        self.orphan_timeout_s = orphan_timeout_s
        self.client = SupervisorClient(head_url, token, node_id=node_id)
        self.log = get_logger("orchestrator.agent").bind(node=node_id)
        self.hub = LocalHub(on_event=self._on_worker_event, on_closed=self._on_channel_closed)
        self.keys = KeyService(self._running_ranks)
        self.sock = LocalSocketServer(self.hub, keys=self.keys.answer)
        self.ranks: RankSet | None = None
        self.warm = WarmPool()
        self._warm_task: asyncio.Task | None = None
        self.version = 0
        self.heartbeat_s = 0.5
        self.beat_url: str | None = None  # the supervisor's heartbeat process, if it has one
        self._beat_front_after = 0.0  # monotonic time before which beats skip it
        self.config_path = run_dir / "agents" / node_id / "config.json"
        self._events: list[dict[str, Any]] = []
        self._events_ready = asyncio.Event()
        self._registered = asyncio.Event()
        self._exit = asyncio.Event()
        self._done_signals: set[int] = set()
        self._done_profiles: set[int] = set()
        self._last_contact = time.monotonic()
        self.node_config = NodeConfig.unknown()
        self._free_port = self.node_config.free_port()
        self._port_announced = False  # registered again with the job's own port choice
        self.health = HealthWork(node_id, run_dir, self._rank_env, self._queue, self._renew_port)
        self.memory: NodeMemory | None = None  # the memory tier's files, while on
        self.lease = SupervisorLease(self.log)  # ranks stop when the supervisor is gone

    # -- main --------------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until told to exit (0) or until a root task fails (1: its error is logged with
        its traceback and printed on stderr)."""
        # The checkpoint key is in this process's memory: closed to the ranks (same user).
        if not make_undumpable():
            self.log.warning("could not make the agent undumpable: processes of its user "
                             "may read its memory")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._exit.set)
        await self.sock.start()
        self.health.prepare()
        failure: RootTaskFailed | None = None
        async with self.client:
            roots = RootTasks({
                "register": self._register_loop(), "heartbeat": self._heartbeat_loop(),
                "assignment": self._assignment_loop(), "events": self._event_loop(),
                "orphan_watch": self._orphan_watch(), "lease": self.lease.watch(
                    lambda: self.node_config.lease_s, self._running, self._lease_stop),
                "follow": self.lease.follow(self.client, lambda: self.heartbeat_s,
                                            self._registered.clear)})
            try:
                await roots.wait(self._exit)
            except RootTaskFailed as exc:
                failure = exc
                self.log.error("agent root task failed; stopping", task=exc.name,
                               error=f"{type(exc.error).__name__}: {exc.error}",
                               exc_info=exc.error)
            await self.health.close()
            if self._warm_task is not None:
                self._warm_task.cancel()
            await self.warm.retire()
            if self.ranks is not None and self.ranks.alive:
                await self.ranks.stop(grace=10.0 if failure is None else 3.0)
            await self._flush_events(timeout=3.0)
            await roots.cancel()
        if self.memory is not None:  # the memory tier lives as long as its agent
            self.memory.free()
        await self.sock.close()
        self.log.info("agent exiting", failed=failure is not None)
        if failure is not None:
            # The launcher's capture of stderr (agents/<node>.out) shows it too.
            print(f"agent {self.node_id}: {failure}", file=sys.stderr, flush=True)
            return 1
        return 0

    def _running_ranks(self) -> tuple[dict[int, int], dict[str, str]] | None:
        """The key service's view: this generation's live ranks' pids, and its environment
        (where the supervisor names the key)."""
        if self.ranks is None or not self.ranks.alive:
            return None
        pids = {r.rank: r.pid for r in self.ranks.ranks if r.alive and r.pid is not None}
        return pids, self.ranks.assignment.env

    def _contact(self) -> None:
        self._last_contact = time.monotonic()
        self.lease.renew()

    def _running(self) -> int | None:
        return self.ranks.generation if self.ranks is not None and self.ranks.alive else None

    async def _lease_stop(self) -> None:
        await self._stop_ranks(report=True, generation=self._running())

    async def _register_loop(self) -> None:
        """Register now, and again whenever the supervisor forgets us (restart)."""
        while True:
            if self._registered.is_set():
                await asyncio.sleep(0.2)
                continue
            req = RegisterRequest(
                node_id=self.node_id, host=socket.gethostname(), addr=self.addr,
                procs=self.procs, agent_pid=os.getpid(), free_port=self._port(),
                generation=self.ranks.generation if self.ranks else None,
                assignment_version=self.version,
                ranks=self._rank_infos())
            try:
                data = await self.client.request_retrying(
                    "POST", "/v1/register", json=req.model_dump(mode="json"),
                    give_up_after=30.0)
            except (Unreachable, SupervisorError) as exc:
                self.log.warning("register failed; retrying", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            resp = RegisterResponse.model_validate(data)
            if not self.lease.accepts(resp.epoch):  # a deposed leader: try the next URL
                self.client.rotate()
                await asyncio.sleep(0.5)
                continue
            self.heartbeat_s = resp.heartbeat_interval_s
            self.beat_url = None if resp.heartbeat_port is None else \
                self.client.url_at_port(resp.heartbeat_port)
            self._beat_front_after = 0.0
            self.node_config = NodeConfig.from_config(resp.config, self.node_id)
            self.config_path.parent.mkdir(parents=True, exist_ok=True)
            self.config_path.write_text(json.dumps(resp.config))
            if self.ranks is None or not self.ranks.alive:
                self._free_port = self.node_config.free_port()
                if self._free_port != req.free_port and not self._port_announced:
                    # The job's config (job.master_port[_range]) came with this answer: say
                    # the port it chose at once, before the supervisor places rank 0 here.
                    self._port_announced = True
                    continue
            self._contact()
            self._registered.set()
            self.log.info("registered", head=self.client.head_url,
                          beats_to=self.beat_url or self.client.head_url)

    def _next_port(self, in_use: int | None) -> None:
        """A rendezvous port for the next generation other than ``in_use`` (this one's):
        an in-job recovery's new process groups need a store of their own while the old
        one may still be open."""
        for _ in range(8):
            self._free_port = self.node_config.free_port()
            if self._free_port != in_use:
                return

    def _port(self) -> int | None:
        return self._free_port

    def _rank_infos(self) -> list[RankInfo]:
        if self.ranks is None:
            return []
        infos = []
        for r in self.ranks.ranks:
            info = r.info()
            beat = self.hub.beats.get(r.rank)
            if beat is not None and beat.generation in (None, self.ranks.generation):
                info.step, info.phase = beat.step, beat.phase
                info.last_step_ts, info.beat_ts = beat.last_step_ts, beat.ts
                info.step_interval_max = beat.interval_max
                info.progress = beat.progress if beat.progress in ("sdk", "hook") else None
                info.finished = beat.finished
                info.recoverable = beat.recoverable
                info.step_time, info.data_wait = beat.step_time, beat.data_wait
            infos.append(info)
        return infos

    def _forget_registration(self, exc: SupervisorError) -> None:
        if exc.status == 404 and self._registered.is_set():
            self.log.warning("supervisor does not know this node; re-registering")
            self._registered.clear()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self._registered.is_set():
                continue
            running = self.ranks.generation if self.ranks else None
            generation, records = self.hub.take_records(MAX_RECORDS_PER_BEAT)
            if generation != running:
                records = []  # a generation that no longer runs here: the supervisor refuses them
            # One bad record (a user's metric that is a list, a 10 kB string) must not make
            # the beat unsendable, nor end this loop: it is dropped, and said once a beat.
            records, dropped = keep_valid_records(records)
            if dropped:
                self.log.warning("step records dropped: not valid for the protocol",
                                 dropped=dropped)
            try:
                hb = Heartbeat(node_id=self.node_id, generation=running,
                               free_port=self._port(), ranks=self._rank_infos(),
                               records=records)
            except ValidationError as exc:
                self.log.error("heartbeat not sent: its ranks' figures are not valid",
                               error=str(exc)[:500])
                continue
            try:
                await self._send_beat(hb.model_dump(mode="json"))
                self._contact()
            except (Unreachable, SupervisorError) as exc:
                refused = isinstance(exc, SupervisorError) and exc.status in _REFUSED
                # Keep the records for the next beat (the supervisor may be restarting),
                # unless it refused them: sent again, they would be refused again.
                if records and not refused and generation == self.hub.records_generation:
                    self.hub.records[:0] = records
                if isinstance(exc, SupervisorError):
                    self._forget_registration(exc)

    async def _send_beat(self, body: dict[str, Any]) -> None:
        """To the supervisor's heartbeat process when it has one; if that cannot be
        reached, to the supervisor itself (and for the next 30 s too)."""
        timeout = self.node_config.beat_timeout_s
        if self.beat_url is not None and time.monotonic() >= self._beat_front_after:
            try:
                await self.client.request("POST", "/v1/heartbeat", json=body, timeout=timeout,
                                          base=self.beat_url)
                return
            except Unreachable as exc:
                self._beat_front_after = time.monotonic() + 30.0
                self.log.warning("heartbeat process unreachable; beating to the supervisor's "
                                 "own port for 30 s", url=self.beat_url, error=str(exc))
        await self.client.request("POST", "/v1/heartbeat", json=body, timeout=timeout)

    async def _assignment_loop(self) -> None:
        while True:
            await self._registered.wait()
            try:
                data = await self.client.request(
                    "GET", "/v1/assignment",
                    params={"node_id": self.node_id, "after": self.version, "timeout": 20},
                    timeout=30.0)
                self._contact()
            except Unreachable:
                await asyncio.sleep(0.5)
                continue
            except SupervisorError as exc:
                self._forget_registration(exc)
                await asyncio.sleep(0.5)
                continue
            if data and not self.lease.accepts(data.get("epoch")):
                self.client.rotate()  # a deposed leader's order: never carried out
                await asyncio.sleep(0.5)
            elif data:
                await self._reconcile(Assignment.model_validate(data))

    async def _reconcile(self, a: Assignment) -> None:
        """Make what runs here match the assignment."""
        if a.version <= self.version:
            return
        self.version = a.version
        for order in a.signals:
            if order.id not in self._done_signals:
                self._done_signals.add(order.id)
                if self.ranks is not None:
                    await self._signal(order.rank, order.signal)
        for profile in a.profiles:
            if profile.id not in self._done_profiles:
                self._done_profiles.add(profile.id)
                self._profile(profile)
        current = self.ranks.generation if self.ranks is not None else None
        if a.action == "health" and a.health is not None:
            if self.ranks is not None and self.ranks.alive:
                await self._stop_ranks(report=True, generation=current)
            self.health.order(a)
            return
        self.health.cancel()
        # In place even when none of this node's ranks is left (its only rank died and
        # was reaped before the order came): the ones started are replacements all the
        # same, and the node's memory-tier slots hold the state the job rolls back to.
        if a.action == "run" and a.generation != current and a.in_place and \
                self.ranks is not None and not self.ranks.stopping:
            await self._recover_in_place(a)
        elif a.action == "run" and a.generation != current:
            await self._stop_ranks(report=False)
            await self._start_ranks(a)
        elif a.action == "stop":
            await self._stop_ranks(report=True, generation=a.generation)
        elif a.action == "idle" and self.ranks is not None and self.ranks.alive:
            await self._stop_ranks(report=True, generation=self.ranks.generation)
        elif a.action == "exit":
            await self._stop_ranks(report=True, generation=current)
            self._exit.set()

    def _profile(self, order: ProfileOrder) -> None:
        """A profile order: each of its ranks running here gets a ``profile`` line."""
        running = self.ranks is not None and self.ranks.generation == order.generation
        mine = {r.rank for r in self.ranks.ranks} if running and self.ranks else set()
        for rank in order.ranks:
            if rank in mine:
                self.hub.send_order(rank, {"t": "profile", "id": order.id,
                                           "start_step": order.start_step,
                                           "steps": order.steps})
        self.log.info("profile order", id=order.id, start_step=order.start_step,
                      steps=order.steps, ranks=sorted(mine & set(order.ranks)))

    async def _signal(self, rank: int, sig: str) -> None:
        """A signal order. SIGUSR1 asks for the rank's stacks: sent where faulthandler will
        answer it, read from outside (py-spy) where it would kill or wait (a stopped rank)."""
        assert self.ranks is not None
        if sig == "SIGUSR1":
            out = self.run_dir / STACKS_DIR / stack_file_name(self.ranks.generation or 0, rank)
            how = await self.ranks.dump_stacks(rank, out)
            self.log.warning("stack dump order", rank=rank, how=how)
            return
        sent = self.ranks.send_signal(rank, sig)
        self.log.warning("signal order", rank=rank, signal=sig, sent=sent)

    def _rank_env(self) -> dict[str, str]:
        """The environment every rank (and health-check rank) of this node starts from: the
        agent's own minus the control-API token, the agent's ORCH_* variables, and the
        preload hook's directory leading PYTHONPATH."""
        env = ec.without_secrets(os.environ)
        env.update(ec.AgentEnv(agent_socket=self.sock.path, config_path=str(self.config_path),
                               node_id=self.node_id, heartbeat_interval_s=self.heartbeat_s,
                               run_dir=str(self.run_dir)).to_env())
        env["PYTHONPATH"] = preload_pythonpath(env.get("PYTHONPATH"))
        env.pop(ec.HOOK_PID, None)
        return env

    def _renew_port(self) -> int:
        """A fresh rendezvous port after the network test used the last one."""
        self._free_port = self.node_config.free_port()
        return self._free_port

    def _memory_env(self, a: Assignment, provision: bool = True) -> dict[str, str]:
        """Size this node's memory-tier slots for ``a``'s ranks; the ranks' variable.
        Without ``provision``, the slots made for the running ranks (an in-job recovery
        keeps them: they hold the state it rolls back to)."""
        nc = self.node_config
        if nc.memory_root is None or a.nproc <= 0:
            return {}
        if not provision:
            return ec.memory_env(str(self.memory.path)) if self.memory is not None else {}
        if self.memory is None:
            self.memory = NodeMemory(nc.memory_root, self.run_dir, self.node_id)
            pages = read_tier_pages(nc.memory_root)
            if not pages.huge:
                self.log.warning(
                    "memory tier on 4 KiB pages: ranks page-lock it about 2.5x slower and "
                    "a killed rank's process is released about 6x slower than on a tmpfs "
                    "mounted with huge=within_size (set checkpoint.memory_root to one)",
                    root=str(nc.memory_root), why=pages.why)
        if not self.lease.memory_continues(self.ranks.generation if self.ranks else None,
                                           a.generation):
            self.memory.forget()  # copies of an earlier, or deposed, generation
        try:
            slot = self.memory.provision(
                [a.rank_offset + i for i in range(a.nproc)], a.world_size, a.nproc,
                nc.memory_max_bytes, nc.memory_partner)
        except OSError as exc:  # the tier is an optimisation: ranks fall back to durable
            self.log.warning("memory tier unavailable", path=str(self.memory.path),
                             error=str(exc))
            return {}
        self.log.info("memory tier", path=str(self.memory.path), slot_bytes=slot,
                      budget_bytes=self.memory.budget)
        return ec.memory_env(str(self.memory.path))

    async def _start_ranks(self, a: Assignment) -> None:
        self.hub.reset()
        nc = self.node_config
        env = {**self._rank_env(), **self._memory_env(a)}
        self.ranks = RankSet(a, env, self.run_dir / "logs", self._on_rank_exit,
                             RankSetup(run_dir=self.run_dir, job=nc.job,
                                       max_restarts=nc.max_restarts, workdir=nc.workdir))
        infos = await self.ranks.start(self.warm, self._spare_kind(a))
        self.log.info("ranks started", generation=a.generation, warm=self.ranks.warm_started,
                      ranks=[(i.rank, i.pid) for i in infos])
        self._queue(RanksStarted(generation=a.generation or 0, ranks=infos, ts=time.time()))
        self._next_port(a.master_port)
        self._keep_spares(a)

    async def _recover_in_place(self, a: Assignment) -> None:
        """An in-job recovery: this node's live ranks join generation ``a.generation`` in
        their processes (a ``recover`` order each, on the local socket), the failed ones
        are replaced, in their standby where one is ready."""
        assert self.ranks is not None
        env = {**self._rank_env(), **self._memory_env(a, provision=False)}

        def recover(r: Rank, rank_env: dict[str, str]) -> None:
            self.hub.send_order(r.rank, {"t": "recover", "generation": a.generation,
                                         "env": rank_env})

        infos, fresh = await self.ranks.advance(a, env, recover, self.hub.forget, self.warm,
                                                self._spare_kind(a))
        self.log.info("ranks recovered in place", generation=a.generation,
                      rejoined=[i.rank for i in infos if i.local_rank not in fresh],
                      replaced=[i.rank for i in infos if i.local_rank in fresh],
                      standby=self.ranks.warm_started)
        self._queue(RanksStarted(generation=a.generation or 0, ranks=infos, ts=time.time()))
        self._next_port(a.master_port)
        self._keep_spares(a)

    @staticmethod
    def _spare_kind(a: Assignment) -> SpareKind | None:
        """The spares this assignment's ranks can start in (None: none, a user's script)."""
        if not a.preload or not a.entrypoint:
            return None
        return SpareKind(a.entrypoint[0], tuple(a.preload), a.standby_prepare)

    def _keep_spares(self, a: Assignment) -> None:
        """Refill the spare pool in the background for ``a``'s local ranks."""
        if self._spare_kind(a) is None:
            return
        if self._warm_task is not None:
            self._warm_task.cancel()
        self._warm_task = asyncio.create_task(self._prepare_spares(a, time.time()))

    async def _prepare_spares(self, a: Assignment, since: float) -> None:
        """Once this generation's ranks have stepped (after ``since``: a rank that rejoined
        in place beats its old step at once), import the next one's modules in spares (and
        prepare them as standbys when the job asks for that)."""
        from orchestrator.agent.ranks import die_with_parent

        kind = self._spare_kind(a)
        assert kind is not None
        while not any(b.generation == a.generation and (b.last_step_ts or 0) >= since
                      for b in self.hub.beats.values()):
            if self.ranks is None or self.ranks.generation != a.generation \
                    or not self.ranks.alive:
                return
            await asyncio.sleep(0.5)
        # A standby becomes a rank without a new exec: its malloc is set up as a rank's.
        base = huge_page_malloc({**ec.without_secrets(os.environ),
                                 **self._memory_env(a, provision=False),
                                 **{k: v for k, v in a.env.items() if k == "GLIBC_TUNABLES"}})

        def env_of(local_rank: int) -> dict[str, str]:
            # What a standby's preparation reads: its device, the slots of the rank it
            # would replace (this node's rank at that local index), the job's config (the
            # step it compiles ahead) and the run directory (the job's compile cache).
            return {**base, ec.CONFIG: str(self.config_path), ec.RUN_DIR: str(self.run_dir),
                    "LOCAL_RANK": str(local_rank),
                    "RANK": str(a.rank_offset + local_rank),
                    "LOCAL_WORLD_SIZE": str(a.nproc), "WORLD_SIZE": str(a.world_size)}

        try:
            await self.warm.fill(kind, list(range(a.nproc)), env_of, die_with_parent)
        except OSError as exc:  # spares are an optimisation: never a failure
            self.log.warning("could not start warm spares", error=str(exc))

    async def _stop_ranks(self, report: bool, generation: int | None = None) -> None:
        if self.ranks is not None and self.ranks.alive:
            self.log.info("stopping ranks", generation=self.ranks.generation)
            await self.ranks.stop(grace=self._grace())
        self._free_port = self.node_config.free_port()
        if report and generation is not None:
            self._queue(RanksStopped(generation=generation, ts=time.time(),
                                     free_port=self._free_port))

    def _grace(self) -> float:
        return self.node_config.stop_grace_s

    async def _on_rank_exit(self, r: Rank, tail: list[str]) -> None:
        self.log.info("rank exited", rank=r.rank, exit_code=r.exit_code, signal=r.signal,
                      expected=self.ranks.stopping if self.ranks else None)
        self._queue(RankExit(generation=r.generation or 0,
                             rank=r.rank, pid=r.pid, exit_code=r.exit_code,
                             signal=r.signal, ts=time.time(), log_tail=tail,
                             error=r.error[:4096] if r.error else None))

    def _on_channel_closed(self, rank: int) -> None:
        if self.ranks is not None:
            self.ranks.channel_closed(rank)

    def _on_worker_event(self, msg: dict[str, Any]) -> None:
        gen = self.ranks.generation if self.ranks is not None else 0
        try:
            ev = WorkerEvent(generation=msg.get("generation") or gen or 0, rank=msg["rank"],
                             name=str(msg.get("name", "")), data=msg.get("data") or {},
                             ts=float(msg.get("ts") or time.time()))
        except (KeyError, ValueError, TypeError) as exc:
            # Not sendable as it is: said once here, with the reason, never silently lost.
            self.log.warning("worker event dropped: not valid for the protocol",
                             name=str(msg.get("name", ""))[:64], rank=msg.get("rank"),
                             error=str(exc)[:500])
            return
        self._queue(ev)

    # -- events ------------------------------------------------------------------------------
    def _queue(self, event: Any) -> None:
        self._events.append(event.model_dump(mode="json"))
        del self._events[:-_MAX_QUEUED_EVENTS]
        self._events_ready.set()

    async def _event_loop(self) -> None:
        while True:
            await self._events_ready.wait()
            await self._registered.wait()
            if not await self._send_events():
                await asyncio.sleep(0.3)

    async def _send_events(self, timeout: float | None = None) -> bool:
        batch = self._events[:500]
        if not batch:
            self._events_ready.clear()
            return True
        try:
            await self.client.request("POST", "/v1/events",
                                      json={"node_id": self.node_id, "events": batch},
                                      timeout=timeout or self.node_config.beat_timeout_s)
            self._contact()
        except Unreachable:
            return False
        except SupervisorError as exc:
            self._forget_registration(exc)
            # A bad event (422), one this node may not send (403) or too large a batch (413)
            # is dropped: it must not block the ones behind it forever.
            if exc.status in (403, 413, 422):
                self.log.error("supervisor rejected events", error=str(exc))
                del self._events[:len(batch)]
            return False
        del self._events[:len(batch)]
        if not self._events:
            self._events_ready.clear()
        return True

    async def _flush_events(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._events and time.monotonic() < deadline:
            if not await self._send_events(max(0.1, deadline - time.monotonic())):
                await asyncio.sleep(0.2)

    async def _orphan_watch(self) -> None:
        """Exit if the supervisor has been gone for long and nothing runs here."""
        if self.orphan_timeout_s <= 0:
            return
        while True:
            await asyncio.sleep(1.0)
            idle = self.ranks is None or not self.ranks.alive
            if idle and time.monotonic() - self._last_contact > self.orphan_timeout_s:
                self.log.warning("supervisor gone and no ranks running; exiting",
                                 silent_s=round(time.monotonic() - self._last_contact))
                self._exit.set()
                return
