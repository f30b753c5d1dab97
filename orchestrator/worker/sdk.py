"""The worker SDK: progress heartbeats and phase marks for any training script.

The training thread only updates an in-memory record (``step_done``, ``phase``); a daemon
thread sends the latest record to the node agent over a local socket every interval. A hung
training thread therefore shows as "no progress" while the beat thread keeps beating, which
is how the supervisor tells a hang from a dead node.

Outside the orchestrator (no agent socket in the environment), every call is a cheap no-op apart from
bookkeeping, so the same script runs under plain torchrun.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import math
import operator
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contracts import chaos as chaos_
from orchestrator.contracts import env as ec
from orchestrator.contracts.chaos import ChaosPlan
from orchestrator.contracts.pace import StepPace
from orchestrator.contracts.phases import PHASES
from orchestrator.contracts.rundir import STACKS_DIR, stack_file_name
from orchestrator.worker.injob import BadRecoverOrder, InJob, RecoverOrder
from orchestrator.worker.profiling import BadOrder, ProfileOrder, ProfileSession

# Steps the beat's step-time and data-wait summary averages over (the straggler detector's
# input: recent enough to follow a change, long enough to smooth one slow step).
_SUMMARY_STEPS = 20
# Records buffered while the agent is unreachable; the oldest are dropped past this.
_MAX_RECORDS = 20_000
# How long ``event_acknowledged`` waits for the agent to say it holds the event.
_ACK_TIMEOUT_S = 2.0
# How long the order thread waits on the socket at a time: an in-job recover order is acted
# on (its aborts run) within this much of arriving, not a heartbeat interval later.
_ORDER_POLL_S = 0.05
STACK_DUMP_SIGNAL = signal.SIGUSR1
# The supervisor's request for a checkpoint at the next step boundary (an operator's stop):
# the handler only sets a flag; the training loop reads ``checkpoint_requested``.
CHECKPOINT_REQUEST_SIGNAL = signal.SIGUSR2
# The agent's answer to an event line that asks for one (``event_acknowledged``).
ACK_LINE = b'{"t": "ack"}\n'


@dataclass(frozen=True)
class WorkerContext:
    """What the orchestrator tells a rank about this generation (from the environment)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    generation: int = 0
    job: str = "job"
    managed: bool = False
    config_path: str | None = None
    run_dir: str | None = None
    checkpoint_root: str | None = None
    resume_max_step: int | None = None
    skip_windows: list[tuple[int, int]] = field(default_factory=list)
    lr_scale: float = 1.0
    chaos: ChaosPlan = field(default_factory=ChaosPlan)
    memory_dir: str | None = None  # the node's memory tier (set by the agent when on)
    in_job_wait_s: float | None = None  # in-job recovery on: how long to wait for the order
    run_id: str | None = None  # the fencing token's run and lineage (``ORCH_LINEAGE``)
    lineage: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WorkerContext:
        """Parse this rank's environment; a malformed ``ORCH_*`` value raises
        :class:`~orchestrator.contracts.env.EnvError` naming the variable."""
        gen = ec.GenerationEnv.from_env(env)
        agent = ec.AgentEnv.from_env(env)
        return cls(
            rank=ec.get_int(env, "RANK", 0, minimum=0) or 0,
            local_rank=ec.get_int(env, "LOCAL_RANK", 0, minimum=0) or 0,
            world_size=ec.get_int(env, "WORLD_SIZE", 1, minimum=1) or 1,
            generation=gen.generation, job=gen.job, managed=agent.managed,
            config_path=agent.config_path, run_dir=agent.run_dir,
            checkpoint_root=gen.checkpoint_root, resume_max_step=gen.resume_max_step,
            skip_windows=list(gen.skip_windows), lr_scale=gen.lr_scale, chaos=gen.chaos,
            memory_dir=agent.memory_dir, in_job_wait_s=gen.in_job_wait_s,
            run_id=gen.run_id, lineage=list(gen.lineage),
        )

    def job_config(self) -> dict[str, Any]:
        """The job's resolved config (``ORCH_CONFIG``, JSON the agent wrote); {} without
        one."""
        if not self.config_path:
            return {}
        with open(self.config_path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}


class Worker:
    """One rank's connection to its agent. Thread-safe; cheap to call every step."""

    def __init__(self, env: Mapping[str, str] = os.environ, clock: Any = time.time,
                 send_records: bool | None = None) -> None:
        self.ctx = WorkerContext.from_env(env)
        agent = ec.AgentEnv.from_env(env)
        self._socket_path = agent.agent_socket
        self._interval = agent.heartbeat_interval_s
        self._clock = clock
        # Only rank 0's step records travel: loss and norms are global values, identical on
        # every rank, and one stream is what the stability detectors and the books read.
        self._send_records = self.ctx.rank == 0 if send_records is None else send_records
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._step: int | None = None
        self._phase = "init"
        self._last_step_ts: float | None = None
        self._pace = StepPace()  # calibrates the hang timeout (``orchestrator.contracts.pace``)
        # Work beside training that slows its steps until it is done (``disturbed_while``).
        self._disturbances: list[Callable[[], bool]] = []
        self._disturbed_step = False  # the last step was disturbed: the next interval too
        self._settling = False  # in ``loading`` because of a disturbance, not set_phase
        # The straggler detector's inputs: each step's own time and data wait (see _beat).
        self._step_times: collections.deque[float] = collections.deque(maxlen=_SUMMARY_STEPS)
        self._data_waits: collections.deque[float] = collections.deque(maxlen=_SUMMARY_STEPS)
        self._phase_since: float | None = None
        self._other_s = 0.0  # seconds in non-training phases since the last step
        self._records: list[dict[str, Any]] = []
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stack_file: Any = None
        self._finished = False  # close() was called: the rank is tearing down
        # Who reports this rank's steps: "sdk" (the script calls step_done) or "hook" (the
        # preload hook counts optimizer steps; the script has not called the SDK).
        self.progress = "sdk"
        self.checkpoint_requested = False  # set by CHECKPOINT_REQUEST_SIGNAL
        self._on_step: list[Callable[[int], None]] = []
        # An armed profile order (set by the beat thread, run by the training thread): the
        # one attribute the training thread tests per step when nobody asked for a profile.
        self._profile: ProfileSession | None = None
        self._profiles_seen: set[int] = set()
        self._inbox = b""  # a partial line from the agent
        self._orders: threading.Thread | None = None
        # In-job recovery: the agent's recover order and the aborts that act on it.
        self.injob = InJob()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Worker:
        if self.ctx.managed and self._thread is None:
            self._install_stack_dump()
            self._install_checkpoint_request()
            chaos_.arm_worker(self, self.ctx.chaos, self.ctx.rank)
            # The first beat now, not an interval later: the agent knows the rank at once,
            # and the channel is opened before the script opens its GPU, so its descriptor
            # closes before the GPU's when the process dies (the agent learns of a death
            # from the channel closing, ~0.7 s before the kernel has released the GPU).
            self._beat()
            self._thread = threading.Thread(target=self._beat_loop, name="orch-heartbeat",
                                            daemon=True)
            self._thread.start()
            self._orders = threading.Thread(target=self._order_loop, name="orch-orders",
                                            daemon=True)
            self._orders.start()
        return self

    def close(self) -> None:
        """Send a last beat (with the last records, marked ``finished``) and stop the beat
        thread. Tearing down (process groups, interpreter exit) can take seconds on a busy
        host after the last step; ``finished`` tells the supervisor that this silence is
        not a hang."""
        with self._lock:
            self._finished = True
            if self._phase != "finishing":  # a script's own loop ends here: no steps follow
                self._phase, self._phase_since = "finishing", self._clock()
        session = self._profile
        if session is not None:
            session.abandon()
            self._profile = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            if self._orders is not None:
                self._orders.join(timeout=1)
                self._orders = None
            self._beat()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _install_stack_dump(self) -> None:
        # On SIGUSR1, faulthandler writes every thread's Python stack (from C, so it works
        # even when the training thread is stuck inside a collective holding the GIL free).
        if not self.ctx.run_dir or not hasattr(faulthandler, "register"):
            return
        stacks = Path(self.ctx.run_dir) / STACKS_DIR
        stacks.mkdir(parents=True, exist_ok=True)
        path = stacks / stack_file_name(self.ctx.generation, self.ctx.rank)
        previous, self._stack_file = self._stack_file, open(path, "a")  # noqa: SIM115
        faulthandler.register(STACK_DUMP_SIGNAL, file=self._stack_file, all_threads=True,
                              chain=False)
        if previous is not None:
            previous.close()

    def _install_checkpoint_request(self) -> None:
        # Python takes signal handlers on the main thread only; a script with a SIGUSR2
        # handler of its own keeps it (the supervisor asks only the built-in trainer).
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(CHECKPOINT_REQUEST_SIGNAL) is not signal.SIG_DFL:
            return

        def asked(signum: int, frame: Any) -> None:
            self.checkpoint_requested = True

        signal.signal(CHECKPOINT_REQUEST_SIGNAL, asked)

    # -- the training thread's calls --------------------------------------------------------
    def step_done(self, step: int, **metrics: Any) -> None:
        """Mark ``step`` finished; ``metrics`` (loss, grad_norm, lr, tokens, ...) go to the
        step record. Only updates memory: the beat thread sends it. From the first call on,
        the script's own steps are the rank's steps (the preload hook's count stops)."""
        self.progress = "sdk"
        self._record_step(_step_number(step), metrics)

    def _record_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = self._clock()
        with self._lock:
            interval = None
            disturbed = self._disturbed()
            if self._phase not in ("training", "init") and not self._settling \
                    and self._phase_since is not None:
                # A phase the step ends (a script's evaluation, its data loader's new epoch,
                # marked by the preload hook) is not step time either.
                self._other_s += now - self._phase_since
            if self._last_step_ts is not None:
                # Time in other phases (a blocking checkpoint save) has timeouts of its own
                # and would inflate the calibrated training timeout: it is not step time.
                interval = max(0.0, now - self._last_step_ts - self._other_s)
                self._pace.add(interval, measured=not disturbed and not self._disturbed_step)
            self._disturbed_step = disturbed
            self._step, self._last_step_ts = step, now
            self._other_s = 0.0
            # The step's own time where the script reports it (our trainer: batch to update,
            # not the wait for its peers at the loop's end), else the interval.
            own = _number(metrics.get("step_time"))
            if own is not None or interval is not None:
                self._step_times.append(own if own is not None else interval)
            data_s = _number(metrics.get("data_s"))
            if data_s is not None:
                self._data_waits.append(data_s)
            phase = "loading" if disturbed else "training"
            if self._phase != phase:
                self._phase, self._settling, self._phase_since = phase, disturbed, now
            if self._send_records:
                self._records.append({"step": step, "ts": now, **_plain(metrics)})
                if len(self._records) > _MAX_RECORDS:
                    del self._records[: len(self._records) - _MAX_RECORDS]
        for hook in self._on_step:
            hook(step)
        session = self._profile
        if session is not None:
            spent = session.on_step(step)
            with self._lock:  # the profiler's start and export are not step time
                self._other_s += spent
            if session.done:
                self._profile = None

    def optimizer_stepped(self, count: int) -> None:
        """The preload hook's report: ``count`` optimizer steps this generation. Ignored once
        the script reports its own steps through the SDK."""
        if self.progress == "hook":
            self._record_step(count, {})

    def on_step(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(step)`` in the training thread right after each step is recorded
        (how ``orchestrator.contracts.chaos`` lands a kill on an exact step)."""
        self._on_step.append(hook)

    def disturbed_while(self, busy: Callable[[], bool]) -> None:
        """Work beside training slows its steps until ``busy()`` is False (page-locking
        gigabytes in the background holds the CUDA driver for seconds). Until then the rank
        reports the ``loading`` phase between its steps, so that phase's timeout judges
        them, not the calibrated training one (a few step intervals), and their intervals
        do not calibrate it. The beat thread returns the rank to ``training`` when the work
        is done."""
        with self._lock:
            self._disturbances.append(busy)

    def _disturbed(self) -> bool:
        """Whether any disturbance is still busy (the done ones are forgotten). Called
        with ``_lock`` held."""
        self._disturbances = [busy for busy in self._disturbances if busy()]
        return bool(self._disturbances)

    def beat_now(self) -> None:
        """Send the latest record to the agent now, not at the next interval."""
        self._beat()

    def set_phase(self, name: str) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
        now = self._clock()
        with self._lock:
            if self._phase != "training" and self._phase_since is not None \
                    and self._last_step_ts is not None:
                self._other_s += now - self._phase_since
            self._phase, self._phase_since, self._settling = name, now, False
        self._beat()  # a phase change is news: the timeout that applies just changed

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with worker.phase("checkpointing"): ...`` then back to the previous phase."""
        with self._lock:
            previous = self._phase
        self.set_phase(name)
        try:
            yield
        finally:
            self.set_phase(previous)

    def event(self, name: str, **data: Any) -> None:
        """Send an event now (checkpoint committed, ...); dropped when unmanaged."""
        self._send(self._event_line(name, data))

    def event_acknowledged(self, name: str, **data: Any) -> bool:
        """Send a rank's last words: an event the agent has queued for the supervisor
        before this returns True, so that whatever the agent learns after it (this
        process's exit) reaches the supervisor after it. The agent reads a rank's beat
        connection when its loop gets to it, and a dying process is reported as soon as
        it is exiting, so a plain ``event`` written just before a rank signals itself can
        reach the supervisor after the exit. Sent on a connection of its own, answered
        with an ``ack`` line; False when unmanaged or unanswered within
        ``_ACK_TIMEOUT_S`` (an agent that predates acks)."""
        if not self._socket_path:
            return False
        line = (json.dumps({**self._event_line(name, data), "ack": True}, default=str)
                + "\n").encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(_ACK_TIMEOUT_S)
                s.connect(self._socket_path)
                s.sendall(line)
                answer = b""
                while not answer.endswith(b"\n") and len(answer) < len(ACK_LINE):
                    chunk = s.recv(len(ACK_LINE) - len(answer))
                    if not chunk:
                        break
                    answer += chunk
        except OSError:
            return False
        return answer == ACK_LINE

    def _event_line(self, name: str, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"t": "event", "rank": self.ctx.rank, "generation": self.ctx.generation,
                "name": name, "data": _plain(data), "ts": self._clock()}

    # -- the beat thread ---------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def _order_loop(self) -> None:
        """Read the agent's orders as they come. Orders are read in this thread only, never
        in the training thread (arming a profile imports torch.profiler's modules; a
        recover order must reach a training thread that is blocked)."""
        while not self._stop.is_set():
            with self._send_lock:
                sock = self._sock
            if sock is None:
                self._stop.wait(_ORDER_POLL_S)
                continue
            try:
                ready = select.select([sock], [], [], _ORDER_POLL_S)[0]
            except (OSError, ValueError):  # closed meanwhile: the next send reconnects
                self._stop.wait(_ORDER_POLL_S)
                continue
            if ready:
                self._read_orders()

    def _beat(self) -> None:
        with self._lock:
            if self._settling and not self._disturbed():
                self._phase, self._settling = "training", False
            msg = {"t": "beat", "rank": self.ctx.rank, "pid": os.getpid(),
                   "generation": self.ctx.generation, "step": self._step,
                   "phase": self._phase, "last_step_ts": self._last_step_ts,
                   "interval_max": self._pace.value(),
                   "step_time": _recent_mean(self._step_times),
                   "data_wait": _recent_mean(self._data_waits),
                   "ts": self._clock(), "records": self._records,
                   "progress": self.progress, "finished": self._finished,
                   "recoverable": self.injob.enabled}
            records, self._records = self._records, []
        if not self._send(msg) and records:
            with self._lock:  # keep them for the next beat
                self._records[:0] = records

    def _read_orders(self) -> None:
        """Orders the agent wrote back on our socket (profile orders), without waiting: a
        poll of the socket after each of the beat thread's beats."""
        with self._send_lock:
            sock = self._sock
            if sock is None:
                return
            try:
                while select.select([sock], [], [], 0)[0]:
                    chunk = sock.recv(65536)
                    if not chunk:  # the agent closed it: reconnect on the next send
                        sock.close()
                        self._sock = None
                        break
                    self._inbox += chunk
                    if len(self._inbox) > 1 << 20:  # never a real order: drop the garbage
                        self._inbox = b""
            except (OSError, ValueError):
                return
            lines = self._inbox.split(b"\n")
            self._inbox = lines.pop()
        for line in lines:
            self._take_order(line)

    def _take_order(self, line: bytes) -> None:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            self.event("profile_failed", error=f"bad order from the agent: {exc}"[:4000])
            return
        if isinstance(obj, dict) and obj.get("t") == "recover":
            self._take_recover(obj)
            return
        try:
            order = ProfileOrder.parse(obj)
        except BadOrder as exc:
            self.event("profile_failed", error=f"bad order from the agent: {exc}"[:4000])
            return
        if order.id in self._profiles_seen:
            return
        self._profiles_seen.add(order.id)
        if self._profile is not None or not self.ctx.run_dir:
            self.event("profile_failed", id=order.id, start_step=order.start_step,
                       error="a profile is already running on this rank" if self._profile
                       else "no run directory to write the trace to")
            return
        self._profile = ProfileSession(order, self.ctx.rank, self.ctx.run_dir, self.event)

    def _take_recover(self, obj: dict[str, Any]) -> None:
        try:
            order = RecoverOrder.parse(obj)
        except BadRecoverOrder as exc:
            self.event("recovery_failed", error=f"bad order from the agent: {exc}"[:4000])
            return
        if not self.injob.enabled:
            # Nothing here can act on it: the rank fails its collective and exits, and the
            # supervisor falls back to a full restart.
            self.event("recovery_failed", error="recover order for a rank that has not "
                       "enabled in-job recovery")
            return
        self.injob.deliver(order, self.ctx.generation)

    def join_generation(self, order: RecoverOrder) -> None:
        """This rank now belongs to ``order.generation``: its context is parsed again from
        the order's environment (which becomes the process's own), its beats carry the new
        generation, its stack dumps go to the new generation's file, and the step intervals
        of the old one no longer calibrate the hang timeout."""
        os.environ.update(order.env)
        ctx = WorkerContext.from_env(os.environ)
        with self._lock:
            self.ctx = ctx
            self._pace = StepPace()  # the new generation warms up and measures afresh
            self._disturbed_step = True  # the first step after the rejoin is not a measure
            self._records = []
        if self._stack_file is not None:
            self._install_stack_dump()
        self._beat()

    def _send(self, msg: dict[str, Any]) -> bool:
        if not self._socket_path:
            return False
        data = (json.dumps(msg, default=str) + "\n").encode()
        with self._send_lock:
            for _ in range(2):  # one reconnect: the agent may have restarted its socket
                try:
                    if self._sock is None:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.settimeout(5.0)
                        s.connect(self._socket_path)
                        self._sock = s
                    self._sock.sendall(data)
                    return True
                except OSError:
                    if self._sock is not None:
                        with contextlib.suppress(OSError):
                            self._sock.close()
                    self._sock = None
        return False


def _step_number(step: Any) -> int:
    """``step_done``'s step as the protocol carries it: an integer (a numpy one too) in
    0..2**53. A float or a negative step raised here, in the script that passed it; sent on,
    it made the node's heartbeats invalid and the node was declared lost."""
    if isinstance(step, bool):
        raise TypeError("step_done: step must be an int, not bool")
    try:
        n = operator.index(step)
    except TypeError:
        raise TypeError(f"step_done: step must be an int, not {type(step).__name__}") \
            from None
    if not 0 <= n <= 1 << 53:
        raise ValueError(f"step_done: step {n} is outside 0..2**53")
    return n


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, float | int) and not isinstance(value, bool) \
        else None


def _recent_mean(values: collections.deque[float]) -> float | None:
    """Mean of the last ``_SUMMARY_STEPS`` values (finite, >= 0), or None."""
    n = min(len(values), _SUMMARY_STEPS)
    if n == 0:
        return None
    total = math.fsum(values[i] for i in range(len(values) - n, len(values)))
    mean = total / n
    return round(mean, 6) if math.isfinite(mean) and mean >= 0 else None


def _plain(d: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors and numpy scalars to Python numbers (json-safe, NaN kept as a float)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "item") and callable(v.item):
            try:
                v = v.item()
            except (ValueError, RuntimeError):
                v = str(v)
        out[k] = v
    return out


def running_under_orchestrator() -> bool:
    return ec.AgentEnv.from_env(os.environ).managed

