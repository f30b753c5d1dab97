"""The agent's pool of pre-imported spare interpreters (``orchestrator.worker.warm``), one
per local rank.

While a generation trains, the agent keeps one spare per local rank with the worker's
modules already imported; a restarted rank starts in one, so a restart skips the imports.
With ``standby``, each spare also prepares itself for its local rank after the imports (the
job's ``prepare`` function: on a GPU node its device context and the compile cache, the
rank's memory-tier slots page-locked): a **warm standby** that takes a dead rank's place in
an in-job recovery while the other ranks wait. Spares start niced, once the running ranks
have made their first step (they must not slow a start-up they cannot help), and are
retired when the preload list, the preparation or the interpreter changes. A spare that
was taken is replaced in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.logs import get_logger

_NICE = 10  # spares import torch while ranks train: they yield the CPU to the ranks

Process = asyncio.subprocess.Process


@dataclass(frozen=True)
class SpareKind:
    """What a spare is ready for: the interpreter, the modules it imported, and the
    standby preparation it ran (``module:function``, None: a plain spare)."""

    python: str = ""
    preload: tuple[str, ...] = ()
    prepare: str | None = None


@dataclass
class WarmPool:
    kind: SpareKind = field(default_factory=SpareKind)
    spares: dict[int, Process] = field(default_factory=dict)  # by local rank

    def __post_init__(self) -> None:
        self.log = get_logger("orchestrator.agent.warm")

    async def fill(self, kind: SpareKind, local_ranks: list[int],
                   env_of: Callable[[int], dict[str, str]], preexec: Callable[[], None]) -> int:
        """Have a live spare of ``kind`` for every local rank in ``local_ranks``; returns
        how many were started now. ``env_of(local_rank)``: the spare's environment."""
        if self.kind != kind:
            await self.retire()
            self.kind = kind
        self.spares = {lr: p for lr, p in self.spares.items() if p.returncode is None}
        started = 0
        for local_rank in local_ranks:
            if local_rank in self.spares:
                continue
            args = [a for m in kind.preload for a in ("--preload", m)]
            if kind.prepare:
                args += ["--prepare", kind.prepare, "--local-rank", str(local_rank)]
            # -P: the working directory (a user's trainer.py) cannot shadow our modules.
            self.spares[local_rank] = await asyncio.create_subprocess_exec(
                kind.python, "-P", "-u", "-m", "orchestrator.worker.warm", *args,
                env=env_of(local_rank), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True, preexec_fn=lambda: (preexec(), os.nice(_NICE)))
            started += 1
        if started:
            self.log.info("warm spares starting", count=started, local_ranks=local_ranks,
                          preload=list(kind.preload), standby=kind.prepare is not None)
        return started

    def take(self, kind: SpareKind, local_ranks: list[int]) -> dict[int, Process] | None:
        """A live spare of ``kind`` for each of ``local_ranks`` (they leave the pool), or
        None when one is missing (the ranks start cold)."""
        if self.kind != kind or not local_ranks:
            return None
        live = {lr: p for lr, p in self.spares.items() if p.returncode is None}
        if any(lr not in live for lr in local_ranks):
            return None
        for lr in local_ranks:
            del self.spares[lr]
        return {lr: live[lr] for lr in local_ranks}

    def take_some(self, kind: SpareKind, local_ranks: list[int]) -> dict[int, Process]:
        """Whichever of ``local_ranks`` have a live spare of ``kind`` (they leave the pool):
        an in-job replacement starts in its standby where there is one, cold elsewhere."""
        if self.kind != kind:
            return {}
        taken = {lr: p for lr, p in self.spares.items()
                 if lr in local_ranks and p.returncode is None}
        for lr in taken:
            del self.spares[lr]
        return taken

    @staticmethod
    async def hand_off(proc: Process, module: str, argv: list[str], env: dict[str, str],
                       log: str, *, cwd: str) -> None:
        """Start the rank in a spare: its module (or ``path:SCRIPT``, ``ranks.warm_module``),
        environment, argv, working directory and log file, on its stdin."""
        assert proc.stdin is not None
        target = {"path": module.removeprefix("path:")} if module.startswith("path:") \
            else {"module": module}
        line = json.dumps({**target, "argv": argv, "env": env, "log": log,
                           "cwd": cwd}) + "\n"
        proc.stdin.write(line.encode())
        await proc.stdin.drain()
        proc.stdin.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # Back to normal priority: it is a rank now.
            os.setpriority(os.PRIO_PROCESS, proc.pid, 0)

    async def retire(self) -> None:
        for proc in self.spares.values():
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.close()  # end of input: the spare exits quietly
        for proc in self.spares.values():
            with contextlib.suppress(ProcessLookupError):
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        self.spares = {}
