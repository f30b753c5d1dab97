"""The ranks of one generation on this node: spawn with torchrun's environment, report each
exit the moment ``waitpid`` returns (with the rank's ``@record`` error file as its cause),
stop with SIGTERM then SIGKILL.

A rank that cannot be spawned at all (entrypoint not found, not executable) is reported as
that rank's exit, with the OS error as its cause, the moment the spawn fails.
"""

from __future__ import annotations

import asyncio
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
from orchestrator.agent.warm import WarmPool
from orchestrator.protocol import Assignment, RankInfo

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
    """``python [flags] -m MODULE ARGS...`` entrypoints can start in a spare, as (MODULE,
    ARGS); others cannot. Flags are single-letter interpreter options such as -P or -u."""
    for i, word in enumerate(entrypoint[1:], start=1):
        if word == "-m":
            if i + 1 < len(entrypoint):
                return entrypoint[i + 1], entrypoint[i + 2:]
            return None
        if not (word.startswith("-") and len(word) == 2 and word[1].isalpha()):
            return None
    return None


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


def dying_status(pid: int) -> int | None:
    """The exit status of ``pid`` if it is exiting but not yet reaped, as
    ``Popen.returncode`` has it (negative: the signal), else None (alive, gone, or not ours).

    Read from ``/proc/<pid>/stat``: a process past ``exit_mm`` has no address space (its
    ``vsize``, field 23, is 0) and its ``exit_code`` (field 52, Linux >= 3.5, readable by
    its parent) holds the wait status ``do_exit`` was given.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # field 3 (state) onwards
    try:
        vsize, status = int(fields[20]), int(fields[49])
    except (IndexError, ValueError):
        return None
    if vsize != 0:
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

    def _env(self, local_rank: int) -> dict[str, str]:
        st = self.setup
        return rank_env(self.assignment, local_rank, self._base_env, run_dir=st.run_dir,
                        max_restarts=st.max_restarts, job=st.job)

    async def start(self, warm: WarmPool | None = None) -> list[RankInfo]:
        """Start every local rank: in pre-imported spares from ``warm`` when it holds one
        per rank for this entrypoint, else as fresh processes."""
        a = self.assignment
        self._log_dir.mkdir(parents=True, exist_ok=True)
        module = warm_module(a.entrypoint)
        spares = None
        if warm is not None and module is not None and a.preload:
            spares = warm.take(a.entrypoint[0], a.preload, a.nproc)
        self.warm_started = spares is not None
        cwd = self.setup.workdir
        if cwd is not None:
            cwd.mkdir(parents=True, exist_ok=True)
        for local_rank in range(a.nproc):
            rank = a.rank_offset + local_rank
            log_path = self._log_dir / f"rank-{rank:05d}.log"
            err_path = error_file(self.setup.run_dir, a.generation, rank)
            prepare_error_file(err_path)
            proc, failure = None, None
            with open(log_path, "ab") as log:
                log.write(f"==== generation {a.generation} rank {rank} started "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
                          f"{' (warm spare)' if spares else ''} ====\n".encode())
                offset = log.tell()
                if spares:
                    proc = spares[local_rank]
                    assert module is not None
                    await WarmPool.hand_off(proc, module[0], module[1],
                                            self._env(local_rank), str(log_path),
                                            cwd=str(cwd or os.getcwd()))
                else:
                    try:
                        proc = await asyncio.create_subprocess_exec(
                            *a.entrypoint, env=self._env(local_rank), cwd=cwd,
                            stdin=asyncio.subprocess.DEVNULL, stdout=log,
                            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent)
                    except (OSError, ValueError) as exc:
                        failure = spawn_error(a.entrypoint, exc if isinstance(exc, OSError)
                                              else OSError(str(exc)))
                        log.write(f"{failure[1]}\n".encode())
            r = Rank(rank, local_rank, proc, log_path, offset, time.time(), a.generation,
                     error_path=err_path)
            self.ranks.append(r)
            if failure is not None:
                r.exit_code, r.error = failure
                self._watchers.append(asyncio.create_task(self._report(r)))
            else:
                self._watchers.append(asyncio.create_task(self._watch(r)))
        return [r.info() for r in self.ranks]

    async def _watch(self, r: Rank) -> None:
        assert r.process is not None
        code = await r.process.wait()
        r.reaped = True
        if not r.reported:
            await self._exited(r, code)

    def channel_closed(self, rank: int) -> None:
        """``rank``'s channel to this agent closed: if its process is already past the point
        of no return (its memory released, an exit status set), report the exit now instead
        of when the kernel is done tearing it down: the release of a CUDA context takes
        0.6-0.8 s after the socket closes (measured on an H100). A channel closed by a
        process that still lives, or one exiting with status 0, is left to the watcher."""
        if self.stopping:
            return
        for r in self.ranks:
            if r.rank == rank and r.alive and not r.reported and r.pid is not None:
                code = dying_status(r.pid)
                if code is not None and code != 0:
                    self._watchers.append(asyncio.create_task(self._exited(r, code)))

    async def _exited(self, r: Rank, code: int) -> None:
        """Report ``r``'s exit (``code`` as ``Popen.returncode``: negative for a signal)."""
        r.reported = True
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
