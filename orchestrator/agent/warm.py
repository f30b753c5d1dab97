"""The agent's pool of pre-imported spare interpreters (``orchestrator.worker.warm``).

While a generation trains, the agent keeps one spare per local rank with the worker's
modules already imported; the next generation's ranks start in them, so a restart skips the
imports. Spares are started niced, once the running ranks have made their first step (they
must not slow a start-up they cannot help), and retired when the preload list or the
interpreter changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field

from orchestrator.logs import get_logger

_NICE = 10  # spares import torch while ranks train: they yield the CPU to the ranks


@dataclass
class WarmPool:
    python: str = ""
    preload: tuple[str, ...] = ()
    spares: list[asyncio.subprocess.Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log = get_logger("orchestrator.agent.warm")

    async def fill(self, python: str, preload: list[str], count: int, env: dict[str, str],
                   preexec) -> None:
        """Have ``count`` live spares for (``python``, ``preload``)."""
        key = (python, tuple(preload))
        if (self.python, self.preload) != key:
            await self.retire()
            self.python, self.preload = key
        self.spares = [p for p in self.spares if p.returncode is None]
        args = [a for m in preload for a in ("--preload", m)]
        while len(self.spares) < count:
            # -P: the working directory (a user's trainer.py) cannot shadow our modules.
            proc = await asyncio.create_subprocess_exec(
                python, "-P", "-u", "-m", "orchestrator.worker.warm", *args, env=env,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                preexec_fn=lambda: (preexec(), os.nice(_NICE)))
            self.spares.append(proc)
        self.log.info("warm spares ready to start", count=len(self.spares), preload=preload)

    def take(self, python: str, preload: list[str], count: int
             ) -> list[asyncio.subprocess.Process] | None:
        """``count`` live spares for this (python, preload), or None (start cold)."""
        if (self.python, self.preload) != (python, tuple(preload)):
            return None
        live = [p for p in self.spares if p.returncode is None]
        if len(live) < count:
            return None
        taken, self.spares = live[:count], live[count:]
        return taken

    @staticmethod
    async def hand_off(proc: asyncio.subprocess.Process, module: str, argv: list[str],
                       env: dict[str, str], log: str, *, cwd: str) -> None:
        """Start the rank in a spare: its environment, argv, working directory and log
        file, on its stdin."""
        assert proc.stdin is not None
        line = json.dumps({"module": module, "argv": argv, "env": env, "log": log,
                           "cwd": cwd}) + "\n"
        proc.stdin.write(line.encode())
        await proc.stdin.drain()
        proc.stdin.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # Back to normal priority: it is a rank now.
            os.setpriority(os.PRIO_PROCESS, proc.pid, 0)

    async def retire(self) -> None:
        for proc in self.spares:
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.close()  # end of input: the spare exits quietly
        for proc in self.spares:
            with contextlib.suppress(ProcessLookupError):
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        self.spares = []
