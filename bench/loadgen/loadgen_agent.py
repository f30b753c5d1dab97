"""One simulated node agent of the load generator, speaking the real control protocol.

It does what ``orchestrator.agent.Agent`` does on the wire, without processes: registers
(again after a 404), beats every ``heartbeat_interval_s`` with its ranks' advancing steps
(the node of rank 0 also sends step records), long-polls its assignment and reconciles it
(``run``: report ``ranks_started``; ``stop``/``idle``/``exit``: one ``rank_exit`` per live
rank then ``ranks_stopped``), writes a stack file for every SIGUSR1 order (as faulthandler
would) and sends its events in batches. Faults are set on it by the scenario: a rank whose
training thread hangs (beats go on, the step stops), a rank that crashes, a node that goes
silent (and comes back when ``heal`` is called).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

import loadgen_wire as wire
from loadgen_http import Conn, Pool

# A rank starts in ``init`` and reaches ``training`` this long after its start (imports,
# rendezvous); its steps then advance every ``step_s``.
_INIT_S = 1.0
# The agent's own timeouts (as orchestrator.agent.agent): a heartbeat or an event batch
# waits up to 3x the node-loss limit (NodeConfig.beat_timeout_s), a long-poll 20 s.
_POLL_S = 20


@dataclass
class Stats:
    """What every simulated agent adds to, read by the generator at the end."""

    beat_latency: list[float] = field(default_factory=list)
    beat_sent: list[float] = field(default_factory=list)  # wall time each answered beat left
    drop_sent: list[float] = field(default_factory=list)  # ... and each dropped one
    beats_failed: int = 0
    beats_late: int = 0  # a beat loop that woke more than one interval late
    registrations: int = 0
    register_retries: int = 0
    registered_at: dict[str, float] = field(default_factory=dict)
    reregistered_after_404: int = 0
    events_failed: int = 0
    stack_files: int = 0
    errors: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(text)


class Net:
    """The supervisor's URL and the job's token; hands each simulated agent its own
    keep-alive connections (``loadgen_http.Conn``) and keeps one for the operator."""

    def __init__(self, url: str, token: str, stats: Stats) -> None:
        self.url, self.token, self.stats = url.rstrip("/"), token, stats
        self._operator: Conn | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._operator is not None:
            self._operator.close()

    def pool(self, node_id: str, port: int | None = None) -> Pool:
        """The connections of the agent of ``node_id`` (its own credential), to the
        supervisor's URL or to another port of its host (its heartbeat process)."""
        url = self.url
        if port is not None:
            parts = urlsplit(url)
            url = urlunsplit(parts._replace(netloc=f"{parts.hostname}:{port}"))
        return Pool(url, wire.bearer(self.token, node_id))

    def conn(self, node_id: str) -> Conn:
        """A connection speaking as ``node_id`` (its own credential; "" is the operator)."""
        return Conn(self.url, wire.bearer(self.token, node_id))

    async def call(self, node_id: str, method: str, path: str, timeout: float,
                   **kwargs: Any) -> tuple[int, Any]:
        """An operator's request (``node_id`` must be "")."""
        assert not node_id, "agents use their own connections"
        if self._operator is None:
            self._operator = self.conn("")
        return await self._operator.request(method, path, timeout,
                                            json_body=kwargs.get("json"),
                                            raw=kwargs.get("raw", False))


class SimNode:
    def __init__(self, net: Net, index: int, procs: int, step_s: float, stacks: Path,
                 beat_timeout_s: float = 5.0) -> None:
        self.beat_timeout_s = beat_timeout_s
        self.net, self.stats = net, net.stats
        self.node_id = f"node-{index:05d}"
        self.procs, self.step_s, self.stacks = procs, step_s, stacks
        self.pid = os.getpid()  # a real pid (ours): nothing may signal a made-up one
        self.version = 0
        self.beat_s = 1.0
        self.registered = asyncio.Event()
        self.generation: int | None = None
        self.rank_offset = 0
        self.alive = False
        self.started_at = 0.0
        self.frozen: dict[int, int] = {}  # rank -> step it hangs at
        self.crash_rank: int | None = None
        self.silent = False
        self._healed = asyncio.Event()
        self._sent_step = -1
        self._events: list[dict[str, Any]] = []
        self._events_ready = asyncio.Event()
        self._done_signals: set[int] = set()
        self.stopped = asyncio.Event()
        self._pool = net.pool(self.node_id)
        self._beat_pool: Pool | None = None  # to the heartbeat process, when there is one
        self._beat_port: int | None = None

    # -- faults (called by the scenario) ------------------------------------------------------
    def hang(self, rank: int) -> None:
        self.frozen[rank] = self._step(time.time()) or 0

    def crash(self, rank: int) -> None:
        if self.alive:
            self._queue(wire.rank_exit(self.generation or 0, rank, None, 1,
                                       None, ["simulated crash: exit code 1"]))
            self.crash_rank = rank

    def go_silent(self) -> None:
        """The node drops off the network; its ranks die with it."""
        self.silent, self.alive = True, False
        self._healed.clear()

    def heal(self) -> None:
        self.silent = False
        self._healed.set()

    # -- main ---------------------------------------------------------------------------------
    async def run(self) -> None:
        tasks = [asyncio.create_task(c) for c in (self._register_loop(), self._beat_loop(),
                                                   self._poll_loop(), self._event_loop())]
        try:
            await self.stopped.wait()
            await self._flush_events()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._pool.close()
            if self._beat_pool is not None:
                self._beat_pool.close()

    async def _quiet(self) -> None:
        while self.silent:
            await self._healed.wait()

    async def _register_loop(self) -> None:
        while not self.stopped.is_set():
            if self.registered.is_set():
                await asyncio.sleep(0.5)
                continue
            await self._quiet()
            body = wire.register(self.node_id, self.procs, self.pid, self._port(),
                                 self.generation if self.alive else None, self.version,
                                 self._infos(time.time()) if self.alive else [])
            try:
                status, data = await self._pool.request(
                    "POST", "/v1/register", 30.0, json_body=body)
            except (OSError, TimeoutError) as exc:
                self.stats.register_retries += 1
                self.stats.error(f"register {self.node_id}: {type(exc).__name__}")
                await asyncio.sleep(0.5)
                continue
            if status != 200:
                self.stats.register_retries += 1
                self.stats.error(f"register {self.node_id}: HTTP {status} {str(data)[:200]}")
                await asyncio.sleep(1.0)
                continue
            resp = wire.parse_register_response(data)
            self.beat_s = resp.heartbeat_interval_s
            if resp.heartbeat_port != self._beat_port:
                if self._beat_pool is not None:
                    self._beat_pool.close()
                self._beat_port = resp.heartbeat_port
                self._beat_pool = None if resp.heartbeat_port is None else \
                    self.net.pool(self.node_id, resp.heartbeat_port)
            self.stats.registrations += 1
            self.stats.registered_at.setdefault(self.node_id, time.time())
            self.registered.set()

    def _port(self) -> int | None:
        return None if self.alive else 20_000 + int(self.node_id[5:]) % 40_000

    def _step(self, now: float) -> int | None:
        trained = now - self.started_at - _INIT_S
        return None if trained < 0 else int(trained / self.step_s)

    def _infos(self, now: float) -> list[dict[str, Any]]:
        step = self._step(now)
        infos = []
        for local in range(self.procs):
            rank = self.rank_offset + local
            s = self.frozen.get(rank, step)
            last = None if s is None else self.started_at + _INIT_S + s * self.step_s
            infos.append(wire.rank_info(
                rank, local, None, alive=self.alive and rank != self.crash_rank,
                step=s, phase="init" if s is None else "training", last_step_ts=last,
                beat_ts=now, interval_max=None if s is None else self.step_s))
        return infos

    def _records(self, now: float) -> list[dict[str, Any]]:
        if self.rank_offset != 0 or not self.alive:
            return []
        step = self.frozen.get(0, self._step(now))
        if step is None or step <= self._sent_step:
            return []
        first = max(self._sent_step + 1, step - 50)
        self._sent_step = step
        base = self.started_at + _INIT_S
        return [wire.step_record(s, base + s * self.step_s, self.step_s, (s + 1) * 4096)
                for s in range(first, step + 1)]

    async def _beat_loop(self) -> None:
        await self.registered.wait()
        # Spread the beats over the interval, as real agents started at different times are.
        await asyncio.sleep((int(self.node_id[5:]) * 0.618) % 1.0 * self.beat_s)
        due = time.monotonic()
        while not self.stopped.is_set():
            due += self.beat_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if time.monotonic() - due > self.beat_s:
                self.stats.beats_late += 1
                due = time.monotonic()
            if self.silent:
                await self._quiet()
                due = time.monotonic()
                continue
            if not self.registered.is_set():
                continue
            now = time.time()
            body = wire.heartbeat(self.node_id, self.generation if self.alive else None,
                                  self._port(), self._infos(now) if self.alive else [],
                                  self._records(now))
            t0 = time.monotonic()
            try:
                status, data = await self._beat(body)
            except (OSError, TimeoutError) as exc:
                self.stats.beats_failed += 1
                self.stats.drop_sent.append(now)
                self.stats.error(f"heartbeat {self.node_id}: {type(exc).__name__} {exc}")
                continue
            self.stats.beat_latency.append(time.monotonic() - t0)
            self.stats.beat_sent.append(now)
            if status == 404:
                self.stats.reregistered_after_404 += 1
                self.registered.clear()
            elif status != 200:
                self.stats.beats_failed += 1
                self.stats.error(f"heartbeat {self.node_id}: HTTP {status} {str(data)[:200]}")

    async def _beat(self, body: dict[str, Any]) -> tuple[int, Any]:
        """As the agent: to the heartbeat process if there is one, else (or if it cannot
        be reached) to the supervisor's own port."""
        if self._beat_pool is not None:
            try:
                return await self._beat_pool.request("POST", "/v1/heartbeat",
                                                     self.beat_timeout_s, json_body=body)
            except OSError as exc:  # refused, or lost: this beat goes to the supervisor
                self.stats.error(f"heartbeat process {self.node_id}: {exc}")
                self._beat_pool.close()
                self._beat_pool = None
        return await self._pool.request("POST", "/v1/heartbeat", self.beat_timeout_s,
                                        json_body=body)

    async def _poll_loop(self) -> None:
        while not self.stopped.is_set():
            await self.registered.wait()
            await self._quiet()
            try:
                status, data = await self._pool.request(
                    "GET", "/v1/assignment", _POLL_S + 10.0,
                    params={"node_id": self.node_id, "after": self.version,
                            "timeout": _POLL_S})
            except (OSError, TimeoutError):
                await asyncio.sleep(0.5)
                continue
            if self.silent:
                continue  # the answer was lost with the network
            if status == 404:
                self.registered.clear()
                continue
            if status != 200:
                self.stats.error(f"poll {self.node_id}: HTTP {status} {str(data)[:200]}")
                await asyncio.sleep(0.5)
                continue
            assignment = wire.parse_assignment(data)
            if assignment is not None and assignment.version > self.version:
                self._reconcile(assignment)

    def _reconcile(self, a: Any) -> None:
        self.version = a.version
        dumps: dict[Path, str] = {}
        for order in a.signals:
            if order.id in self._done_signals:
                continue
            self._done_signals.add(order.id)
            if order.signal == "SIGUSR1" and self.alive and self.generation is not None:
                path = self.stacks / f"gen{self.generation:04d}-rank{order.rank:05d}.txt"
                dumps[path] = (f"Thread 0x0 (most recent call first):\n  simulated rank "
                               f"{order.rank} of {self.node_id}\n")
        if dumps:  # in another process, as the ranks' faulthandler writes them: 16k files
            # written on this loop, or in a thread of this process, delayed the beats in
            # flight (the generator's loop was late while the supervisor's was not).
            self.stats.stack_files += len(dumps)
            STACKS.add(dumps)
        if a.action == "run" and (a.generation != self.generation or not self.alive):
            self._stop(report=False)
            self._start(a)
        elif a.action == "stop":
            self._stop(report=True, generation=a.generation)
        elif a.action == "idle" and self.alive:
            self._stop(report=True, generation=self.generation)
        elif a.action == "exit":
            self._stop(report=True, generation=self.generation)
            self.stopped.set()

    def _start(self, a: Any) -> None:
        self.generation, self.rank_offset = a.generation, a.rank_offset
        self.started_at, self.alive = time.time(), True
        self.frozen, self.crash_rank, self._sent_step = {}, None, -1
        infos = [wire.rank_info(self.rank_offset + i, i, None, phase="init")
                 for i in range(a.nproc or self.procs)]
        self._queue(wire.ranks_started(a.generation or 0, infos))

    def _stop(self, report: bool, generation: int | None = None) -> None:
        if self.alive:
            for local in range(self.procs):
                rank = self.rank_offset + local
                if rank != self.crash_rank:
                    self._queue(wire.rank_exit(self.generation or 0, rank, None,
                                               None, "SIGTERM", []))
            self.alive = False
        if report and generation is not None:
            self._queue(wire.ranks_stopped(generation, self._port()))

    # -- events -------------------------------------------------------------------------------
    def _queue(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        self._events_ready.set()

    async def _event_loop(self) -> None:
        while not self.stopped.is_set():
            await self._events_ready.wait()
            await self.registered.wait()
            await self._quiet()
            if not await self._send_events():
                await asyncio.sleep(0.3)

    async def _send_events(self) -> bool:
        batch = self._events[:500]
        if not batch:
            self._events_ready.clear()
            return True
        try:
            status, data = await self._pool.request(
                "POST", "/v1/events", self.beat_timeout_s,
                json_body=wire.events(self.node_id, batch))
        except (OSError, TimeoutError) as exc:
            self.stats.events_failed += 1
            self.stats.error(f"events {self.node_id}: {type(exc).__name__} {exc}")
            return False
        if status == 404:
            self.registered.clear()
            return False
        if status != 200:
            self.stats.events_failed += 1
            self.stats.error(f"events {self.node_id}: HTTP {status} {str(data)[:200]}")
            if status == 422:
                del self._events[:len(batch)]
            return False
        del self._events[:len(batch)]
        if not self._events:
            self._events_ready.clear()
        return True

    async def _flush_events(self) -> None:
        deadline = time.monotonic() + 3.0
        while self._events and time.monotonic() < deadline and not self.silent:
            if not await self._send_events():
                await asyncio.sleep(0.2)


class _StackBatches:
    """Stack files of many nodes handed to the writer process together, every 50 ms: one
    submission per node (2,048 in a hang's stop) kept the executor's feeder thread pickling
    and holding the GIL, and the generator's loop was 1.5-2.2 s late in that stop."""

    def __init__(self) -> None:
        self._writer: ProcessPoolExecutor | None = None
        self._pending: dict[Path, str] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, files: dict[Path, str]) -> None:
        if not self._pending:
            self._timer = asyncio.get_running_loop().call_later(0.05, self._flush)
        self._pending.update(files)

    def _flush(self) -> None:
        self._timer = None
        files, self._pending = self._pending, {}
        if not files:
            return
        if self._writer is None:
            self._writer = ProcessPoolExecutor(max_workers=1)
        self._writer.submit(_write_stacks, files)

    def close(self) -> None:
        """Write what is pending, wait for every file and end the writer process."""
        if self._timer is not None:
            self._timer.cancel()
        self._flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None


STACKS = _StackBatches()


def _write_stacks(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def quiet_gc(keep_default: bool) -> None:
    """This generator's own garbage collection, as the supervisor's (``gcpolicy``): what
    it holds now frozen out of collections and full collections rare. With CPython's
    defaults its 2,048 simulated agents' state cost 15 full collections of 0.16 s on
    average in a 1,024 x 8 run; a beat in flight during one was answered that much later
    as measured here, the supervisor's p99 made worse by the generator's pauses."""
    if keep_default:
        return
    gc.collect()
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(t0, t1, max(t2, 1000))
