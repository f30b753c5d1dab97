"""The ranks of one generation on this node: spawn with the torch.distributed environment,
report each exit the moment ``waitpid`` returns, stop with SIGTERM then SIGKILL.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal as signal_mod
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.agent.warm import WarmPool
from orchestrator.protocol import Assignment, RankInfo

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


def warm_module(entrypoint: list[str]) -> str | None:
    """``python -m MODULE ...`` entrypoints can start in a spare; others cannot."""
    if len(entrypoint) >= 3 and entrypoint[1] == "-m":
        return entrypoint[2]
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


@dataclass
class Rank:
    rank: int
    local_rank: int
    process: asyncio.subprocess.Process
    log_path: Path
    log_offset: int
    started: float
    generation: int | None = None
    exit_code: int | None = None
    signal: str | None = None

    @property
    def alive(self) -> bool:
        return self.exit_code is None and self.signal is None

    def info(self) -> RankInfo:
        return RankInfo(rank=self.rank, local_rank=self.local_rank, pid=self.process.pid,
                        alive=self.alive, exit_code=self.exit_code, signal=self.signal)


ExitCallback = Callable[["Rank", list[str]], Awaitable[None]]


class RankSet:
    """One generation's ranks on this node."""

    def __init__(self, assignment: Assignment, base_env: dict[str, str], log_dir: Path,
                 on_exit: ExitCallback) -> None:
        self.assignment = assignment
        self.generation = assignment.generation
        self._base_env = base_env
        self._log_dir = log_dir
        self._on_exit = on_exit
        self.ranks: list[Rank] = []
        self._watchers: list[asyncio.Task] = []
        self.stopping = False
        self.warm_started = False

    def _env(self, local_rank: int) -> dict[str, str]:
        a = self.assignment
        rank = a.rank_offset + local_rank
        env = {**self._base_env, **a.env}
        env.update({
            "MASTER_ADDR": str(a.master_addr), "MASTER_PORT": str(a.master_port),
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(a.world_size),
            "LOCAL_WORLD_SIZE": str(a.nproc), "GROUP_RANK": str(a.node_rank),
            "NODE_RANK": str(a.node_rank), "ROLE_RANK": str(rank),
            "TORCHELASTIC_RESTART_COUNT": str((a.generation or 1) - 1),
            "TORCHELASTIC_RUN_ID": env.get("ORCH_JOB", "job"),
            "PYTHONUNBUFFERED": "1",
        })
        return env

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
        for local_rank in range(a.nproc):
            rank = a.rank_offset + local_rank
            log_path = self._log_dir / f"rank-{rank:05d}.log"
            with open(log_path, "ab") as log:
                log.write(f"==== generation {a.generation} rank {rank} started "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
                          f"{' (warm spare)' if spares else ''} ====\n".encode())
                offset = log.tell()
                if spares:
                    proc = spares[local_rank]
                    await WarmPool.hand_off(proc, module, a.entrypoint[3:],
                                            self._env(local_rank), str(log_path))
                else:
                    proc = await asyncio.create_subprocess_exec(
                        *a.entrypoint, env=self._env(local_rank),
                        stdin=asyncio.subprocess.DEVNULL, stdout=log,
                        stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                        preexec_fn=_die_with_parent)
            r = Rank(rank, local_rank, proc, log_path, offset, time.time(), a.generation)
            self.ranks.append(r)
            self._watchers.append(asyncio.create_task(self._watch(r)))
        return [r.info() for r in self.ranks]

    async def _watch(self, r: Rank) -> None:
        code = await r.process.wait()
        if code < 0:
            r.signal = signal_name(code)
        r.exit_code = code if code >= 0 else None
        await self._on_exit(r, tail_lines(r.log_path, r.log_offset))

    def send_signal(self, rank: int, sig: str) -> bool:
        for r in self.ranks:
            if r.rank == rank and r.alive:
                try:
                    os.kill(r.process.pid, getattr(signal_mod, sig))
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
            if r.alive:
                try:
                    os.killpg(r.process.pid, sig)
                except ProcessLookupError:
                    pass
