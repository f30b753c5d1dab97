"""The ranks of one generation on this node: spawn with torchrun's environment, report each
exit the moment ``waitpid`` returns (with the rank's ``@record`` error file as its cause),
stop with SIGTERM then SIGKILL.

A rank that cannot be spawned at all (entrypoint not found, not executable) is reported as
that rank's exit, with the OS error as its cause, the moment the spawn fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal as signal_mod
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.agent import stacks
from orchestrator.agent.rank_env import (
    error_file,
    prepare_error_file,
    rank_env,
    read_error_file,
)
from orchestrator.agent.warm import SpareKind, WarmPool
from orchestrator.contracts.env import replacement_env
from orchestrator.contracts.protocol import Assignment, RankInfo

# Exit codes of a rank that never started, as a shell reports them.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 30


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # If the agent dies (node loss, kill -9), its ranks die with it instead of hanging in a
    # collective that can never complete. Linux only; elsewhere this is skipped.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal_mod.SIGKILL)
    except OSError:
        pass


def warm_module(entrypoint: list[str]) -> tuple[str, list[str]] | None:
    """What a spare can run of an entrypoint, as (TARGET, ARGS): ``python [flags] -m MODULE
    ARGS...`` as (MODULE, ARGS), ``python [flags] SCRIPT.py ARGS...`` as (``path:``SCRIPT,
    ARGS); None for anything else (another program, ``-c``). Flags are single-letter
    interpreter options such as -P or -u."""
    if not entrypoint or not os.path.basename(entrypoint[0]).startswith("python"):
        return None
    for i, word in enumerate(entrypoint[1:], start=1):
        if word == "-m":
            if i + 1 < len(entrypoint):
                return entrypoint[i + 1], entrypoint[i + 2:]
            return None
        if word.endswith(".py") and not word.startswith("-"):
            return PATH_TARGET + word, entrypoint[i + 1:]
        if not (word.startswith("-") and len(word) == 2 and word[1].isalpha()):
            return None
    return None


PATH_TARGET = "path:"  # warm_module's mark of a script path (a spare runs it by path)


def die_with_parent() -> None:
    _die_with_parent()


def signal_name(returncode: int) -> str | None:
    """asyncio's negative return codes are signals: -9 -> 'SIGKILL'."""
    if returncode >= 0:
        return None
    try:
        return signal_mod.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


# task->flags bit set by do_exit's first steps (exit_signals), before the address space and
# the files (a GPU's device files among them) are released.
_PF_EXITING = 0x4


# How often the agent looks whether a rank is dying (8 reads of a /proc file per node).
_DYING_POLL_S = 0.1


def dying_status(pid: int) -> int | None:
    """The exit status of ``pid`` if it is exiting but not yet reaped, as
    ``Popen.returncode`` has it (negative: the signal), else None (alive, gone, or not ours).

    Read from ``/proc/<pid>/stat``: ``do_exit`` sets ``PF_EXITING`` in the task's flags
    (field 9) and the wait status in ``exit_code`` (field 52, Linux >= 3.5, readable by the
    parent) before it releases the address space and the files. A GPU process then takes
    seconds more to go (on 2 x H200, a rank mapping 40 GB of pinned host memory was reaped
    2.9 s after its SIGKILL, and judged hung first).
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # field 3 (state) onwards
    try:
        flags, status = int(fields[6]), int(fields[49])
    except (IndexError, ValueError):
        return None
    if not flags & _PF_EXITING:
        return None
    if status & 0x7F:
        return -(status & 0x7F)
    return (status >> 8) & 0xFF


def tail_lines(path: Path, start_offset: int, n: int = _LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines written to ``path`` since ``start_offset`` (this generation)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(start_offset, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return [line.decode(errors="replace") for line in data.splitlines()[-n:]]


def spawn_error(entrypoint: list[str], exc: OSError) -> tuple[int, str]:
    """(exit code, cause) of a spawn that failed, in the config's terms."""
    exe = entrypoint[0] if entrypoint else ""
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND, f"job.entrypoint {exe!r} not found ({exc.strerror})"
    if isinstance(exc, PermissionError):
        return EXIT_NOT_EXECUTABLE, f"job.entrypoint {exe!r} is not executable ({exc.strerror})"
    return EXIT_NOT_EXECUTABLE, f"job.entrypoint {exe!r} could not start: {exc}"


@dataclass(frozen=True)
class RankSetup:
    """What the agent knows beyond the assignment: where ranks write and run."""

    run_dir: Path
    job: str = "job"
    max_restarts: int = 0
    workdir: Path | None = None  # None: the agent's own working directory


@dataclass
class Rank:
    rank: int
    local_rank: int
    process: asyncio.subprocess.Process | None  # None: the spawn failed
    log_path: Path
    log_offset: int
    started: float
    generation: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    error_path: Path | None = None
    error: str | None = None  # the rank's own cause (error file, or the spawn's OS error)
    tail: list[str] = field(default_factory=list)
    reaped: bool = False  # its process was waited for (or never started)
    reported: bool = False  # its exit went to the agent (perhaps before it was reaped)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        """Its process is not reaped yet: a rank whose exit was reported early, while the
        kernel still tears its process down (and frees its GPU), is alive until then."""
        return self.process is not None and not self.reaped

    def info(self) -> RankInfo:
        return RankInfo(rank=self.rank, local_rank=self.local_rank, pid=self.pid,
                        alive=self.alive, exit_code=self.exit_code, signal=self.signal)


ExitCallback = Callable[["Rank", list[str]], Awaitable[None]]


class RankSet:
    """One generation's ranks on this node."""

    def __init__(self, assignment: Assignment, base_env: dict[str, str], log_dir: Path,
                 on_exit: ExitCallback, setup: RankSetup) -> None:
        self.assignment = assignment
        self.setup = setup
        self.generation = assignment.generation
        self._base_env = base_env
        self._log_dir = log_dir
        self._on_exit = on_exit
        self.ranks: list[Rank] = []
        self._watchers: list[asyncio.Task] = []
        self.stopping = False
        self.warm_started = False
        self._dying_watch: asyncio.Task | None = None

    def _env(self, local_rank: int) -> dict[str, str]:
        st = self.setup
        return rank_env(self.assignment, local_rank, self._base_env, run_dir=st.run_dir,
                        max_restarts=st.max_restarts, job=st.job)

    async def start(self, warm: WarmPool | None = None,
                    kind: SpareKind | None = None) -> list[RankInfo]:
        """Start every local rank: in pre-imported spares from ``warm`` when it holds one
        per rank for this entrypoint, else as fresh processes."""
        a = self.assignment
        local_ranks = list(range(a.nproc))
        spares = None
        if warm is not None and kind is not None and warm_module(a.entrypoint) is not None:
            spares = warm.take(kind, local_ranks)
        self.warm_started = spares is not None
        for local_rank in local_ranks:
            self.ranks.append(await self._spawn(local_rank, (spares or {}).get(local_rank)))
        self._watch_dying()
        return [r.info() for r in self.ranks]

    async def _spawn(self, local_rank: int, spare: asyncio.subprocess.Process | None,
                     note: str = "", extra_env: dict[str, str] | None = None) -> Rank:
        """Start local rank ``local_rank`` of this generation, in ``spare`` when given,
        with its log and error file, and watch it."""
        a = self.assignment
        self._log_dir.mkdir(parents=True, exist_ok=True)
        cwd = self.setup.workdir
        if cwd is not None:
            cwd.mkdir(parents=True, exist_ok=True)
        module = warm_module(a.entrypoint)
        rank = a.rank_offset + local_rank
        log_path = self._log_dir / f"rank-{rank:05d}.log"
        err_path = error_file(self.setup.run_dir, a.generation, rank)
        prepare_error_file(err_path)
        proc, failure = None, None
        with open(log_path, "ab") as log:
            log.write(f"==== generation {a.generation} rank {rank} started "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
                      f"{' (warm spare)' if spare is not None else ''}{note} ====\n".encode())
            offset = log.tell()
            env = {**self._env(local_rank), **(extra_env or {})}
            if spare is not None and module is not None:
                proc = spare
                await WarmPool.hand_off(proc, module[0], module[1], env, str(log_path),
                                        cwd=str(cwd or os.getcwd()))
            else:
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *a.entrypoint, env=env, cwd=cwd,
                        stdin=asyncio.subprocess.DEVNULL, stdout=log,
                        stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                        preexec_fn=_die_with_parent)
                except (OSError, ValueError) as exc:
                    failure = spawn_error(a.entrypoint, exc if isinstance(exc, OSError)
                                          else OSError(str(exc)))
                    log.write(f"{failure[1]}\n".encode())
        r = Rank(rank, local_rank, proc, log_path, offset, time.time(), a.generation,
                 error_path=err_path)
        if failure is not None:
            r.exit_code, r.error = failure
            self._watchers.append(asyncio.create_task(self._report(r)))
        else:
            self._watchers.append(asyncio.create_task(self._watch(r)))
        return r

    def _watch_dying(self) -> None:
        if self._dying_watch is None or self._dying_watch.done():
            self._dying_watch = asyncio.create_task(self.watch_dying())

    async def advance(self, a: Assignment, base_env: dict[str, str],
                      recover: Callable[[Rank, dict[str, str]], None],
                      forget: Callable[[int], None], warm: WarmPool | None = None,
                      kind: SpareKind | None = None) -> tuple[list[RankInfo], list[int]]:
        """Move this node's ranks to generation ``a.generation`` in place (an in-job
        recovery): the ranks ``a.replace`` names are killed if still alive; each live rank
        gets ``recover(rank, env)`` (the agent writes it the order) and stays the same
        process; every other one starts anew, in its standby where ``warm`` holds one,
        after ``forget(rank)`` (the agent drops what the dead process said and was sent).
        Returns the new generation's ranks and the local ranks started anew.

        A replaced rank's exit is still reported, as its old generation's (the supervisor
        has moved on: a straggler)."""
        old = {r.local_rank: r for r in self.ranks}
        self.assignment, self.generation, self._base_env = a, a.generation, base_env
        for r in old.values():
            if r.rank in a.replace and r.alive and r.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.pid, signal_mod.SIGKILL)
        live = {lr: r for lr, r in old.items()
                if r.alive and not r.reported and r.rank not in a.replace}
        fresh = [lr for lr in range(a.nproc) if lr not in live]
        spares = warm.take_some(kind, fresh) if warm is not None and kind is not None and \
            warm_module(a.entrypoint) is not None else {}
        ranks: list[Rank] = []
        for local_rank in range(a.nproc):
            r = live.get(local_rank)
            if r is None:
                forget(a.rank_offset + local_rank)
                ranks.append(await self._spawn(local_rank, spares.get(local_rank),
                                               note=" (replacing a failed rank in place)",
                                               extra_env=replacement_env()))
                continue
            r.generation = a.generation
            r.error_path = error_file(self.setup.run_dir, a.generation, r.rank)
            prepare_error_file(r.error_path)
            with open(r.log_path, "ab") as log:
                log.write(f"==== generation {a.generation} rank {r.rank} rejoins in place "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')} (pid {r.pid}) ====\n"
                          .encode())
                r.log_offset = log.tell()
            recover(r, self._env(local_rank))
            ranks.append(r)
        self.ranks = ranks
        self.warm_started = bool(spares)
        self._watch_dying()
        return [r.info() for r in self.ranks], fresh

    async def _watch(self, r: Rank) -> None:
        assert r.process is not None
        code = await r.process.wait()
        r.reaped = True
        if self._claim(r):
            await self._exited(r, code)

    @staticmethod
    def _claim(r: Rank) -> bool:
        """The one decision that ``r``'s exit is reported now, by the caller: True once per
        rank. It is taken synchronously, before any await, so the reaper, the dying-poll
        and a closed channel can race to it and still report one exit once."""
        if r.reported:
            return False
        r.reported = True
        return True

    def channel_closed(self, rank: int) -> None:
        """``rank``'s channel to this agent closed: look at once whether it is dying."""
        for r in self.ranks:
            if r.rank == rank:
                self._check_dying(r)

    def _check_dying(self, r: Rank) -> None:
        """Report ``r``'s exit now if its process is past the point of no return (exiting,
        with a non-zero status), not when the kernel is done tearing it down: the release
        of a CUDA context takes 0.6-0.8 s on an H100, seconds with pinned host memory. A
        process exiting with status 0 is left to the watcher (its last beat said so)."""
        if self.stopping or not r.alive or r.reported or r.pid is None:
            return
        code = dying_status(r.pid)
        if code is not None and code != 0 and self._claim(r):
            self._watchers.append(asyncio.create_task(self._exited(r, code)))

    async def watch_dying(self, interval_s: float = _DYING_POLL_S) -> None:
        """Until every rank is reported: every ``interval_s``, whether one is dying (a
        read of ``/proc/<pid>/stat`` per rank: a dying process says nothing, and its
        channel closes only once its memory is released)."""
        while not self.stopping and any(r.alive and not r.reported for r in self.ranks):
            for r in self.ranks:
                self._check_dying(r)
            await asyncio.sleep(interval_s)

    async def _exited(self, r: Rank, code: int) -> None:
        """Report ``r``'s exit (``code`` as ``Popen.returncode``: negative for a signal),
        once the caller has claimed it (:meth:`_claim`)."""
        if code < 0:
            r.signal = signal_name(code)
        r.exit_code = code if code >= 0 else None
        tail = tail_lines(r.log_path, r.log_offset)
        recorded = read_error_file(r.error_path) if r.error_path is not None else None
        if recorded is not None:
            # The script's own exception (torch's @record) is the cause: its traceback leads.
            message, traceback = recorded
            r.error = message
            tail = [*traceback, *([message] if message not in traceback else [])]
        r.tail = tail
        await self._on_exit(r, tail)

    async def _report(self, r: Rank) -> None:
        """A rank that never started: report it like an exit, at once."""
        r.reaped = r.reported = True
        r.tail = [r.error or ""]
        await self._on_exit(r, r.tail)

    async def dump_stacks(self, rank: int, out: Path) -> str:
        """Stacks of ``rank`` into ``out``: SIGUSR1 (faulthandler) where the rank handles it
        and can run, else py-spy from outside. Returns how ("signal", "py-spy", "none")."""
        for r in self.ranks:
            if r.rank == rank and r.alive and r.pid is not None:
                if stacks.needs_outside_dump(r.pid):
                    ok = await stacks.dump_outside(r.pid, out, label=f"rank {rank}")
                    return "py-spy" if ok else "none"
                os.kill(r.pid, signal_mod.SIGUSR1)
                return "signal"
        return "none"

    def send_signal(self, rank: int, sig: str) -> bool:
        for r in self.ranks:
            if r.rank == rank and r.alive and r.pid is not None:
                try:
                    os.kill(r.pid, getattr(signal_mod, sig))
                    return True
                except (ProcessLookupError, AttributeError):
                    return False
        return False

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.ranks)

    async def stop(self, grace: float) -> None:
        """SIGTERM every rank's process group; SIGKILL what is left after ``grace``."""
        self.stopping = True
        self._signal_all(signal_mod.SIGTERM)
        # A SIGSTOPped (hung) rank cannot act on SIGTERM until continued.
        self._signal_all(signal_mod.SIGCONT)
        try:
            await asyncio.wait_for(self._wait_all(), grace)
        except TimeoutError:
            self._signal_all(signal_mod.SIGKILL)
            await self._wait_all()

    async def _wait_all(self) -> None:
        if self._watchers:
            await asyncio.gather(*self._watchers, return_exceptions=True)

    def _signal_all(self, sig: signal_mod.Signals) -> None:
        for r in self.ranks:
            if r.alive and r.pid is not None:
                try:
                    os.killpg(r.pid, sig)
                except ProcessLookupError:
                    pass
