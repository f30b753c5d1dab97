"""A dead rank is reported when its channel closes, not when the kernel has torn it down.

On a GPU host the release of a CUDA context takes 0.6-0.8 s after the process's socket
closes; the agent reads the exit status from ``/proc/<pid>/stat`` of the process
that is past the point of no return. These tests use real processes: a SIGKILLed child left
unreaped is exactly what the agent sees while a GPU process is still being torn down.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
from orchestrator.agent.ranks import Rank, RankSet, RankSetup, dying_status
from orchestrator.contracts.protocol import Assignment


def _zombie(code: str) -> subprocess.Popen:
    """A child that ran ``code`` and is dead but not reaped (Popen reaps only when asked)."""
    p = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{p.pid}/stat").read_text()
        if stat[stat.rfind(")") + 2] == "Z":
            return p
        time.sleep(0.01)
    p.kill()
    raise AssertionError("the child did not exit")


def test_the_status_of_a_dying_process_is_read_before_it_is_reaped() -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert dying_status(live.pid) is None  # alive: an address space, no status yet
        live.send_signal(signal.SIGKILL)
        while Path(f"/proc/{live.pid}/stat").read_text().split(") ")[1][0] != "Z":
            time.sleep(0.01)
        assert dying_status(live.pid) == -signal.SIGKILL
    finally:
        live.kill()
        live.wait()
    assert dying_status(live.pid) is None  # reaped: nothing to read
    for code, status in (("import sys; sys.exit(3)", 3), ("pass", 0),
                         ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
                          -signal.SIGSEGV)):
        p = _zombie(code)
        try:
            assert dying_status(p.pid) == status
        finally:
            p.wait()


class _Held:
    """A real process whose reaping this test holds back: the kernel's teardown of a GPU
    process, stretched until ``release``."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.released = asyncio.Event()

    async def wait(self) -> int:
        await self.released.wait()
        return self._popen.wait()


def _assignment() -> Assignment:
    return Assignment(action="run", generation=3, node_rank=0, nproc=1, world_size=1,
                      master_addr="127.0.0.1", master_port=29999,
                      entrypoint=["python", "train.py"])


def _killed_rank(tmp_path: Path, on_exit: Any) -> tuple[RankSet, _Held]:
    """A generation of one rank whose process was SIGKILLed and is not yet reaped, watched
    as ``RankSet.start`` watches its ranks (call inside the event loop)."""
    ranks = RankSet(_assignment(), {}, tmp_path / "logs", on_exit, RankSetup(run_dir=tmp_path))
    held = _Held(_zombie("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    log = tmp_path / "rank.log"
    log.write_text("")
    r = Rank(0, 0, held, log, 0, time.time(), 3)  # type: ignore[arg-type]
    ranks.ranks.append(r)
    ranks._watchers.append(asyncio.create_task(ranks._watch(r)))
    return ranks, held


def test_a_killed_rank_is_reported_at_its_channel_closing_and_stays_alive_until_reaped(
        tmp_path: Path) -> None:
    reported: list[tuple[str | None, bool]] = []

    async def on_exit(r: Rank, tail: list[str]) -> None:
        reported.append((r.signal, r.alive))

    async def scenario() -> tuple[bool, bool]:
        ranks, held = _killed_rank(tmp_path, on_exit)
        ranks.channel_closed(0)
        await asyncio.sleep(0.05)
        early = list(reported)
        still_alive = ranks.alive  # the agent's stop must still wait for the teardown
        held.released.set()
        await ranks.stop(grace=5.0)
        return bool(early), still_alive

    early, still_alive = asyncio.run(scenario())
    assert early and still_alive
    assert reported == [("SIGKILL", True)]  # once: the reaping does not report it again


def test_a_dying_rank_is_found_by_the_poll_without_its_channel_closing(tmp_path: Path) -> None:
    """A GPU process with tens of GB of pinned host memory releases its memory, and only
    then closes its channel, seconds after SIGKILL: the agent looks at /proc meanwhile."""
    reported: list[str | None] = []

    async def on_exit(r: Rank, tail: list[str]) -> None:
        reported.append(r.signal)

    async def scenario() -> bool:
        ranks, held = _killed_rank(tmp_path, on_exit)
        poll = asyncio.create_task(ranks.watch_dying(0.01))
        await asyncio.wait_for(poll, 30)  # ends once every rank is reported
        reported_before_reaping = list(reported) == ["SIGKILL"]
        held.released.set()
        await ranks.stop(grace=5.0)
        return reported_before_reaping

    assert asyncio.run(scenario())
    assert reported == ["SIGKILL"]


def test_a_channel_closed_by_a_living_or_stopping_rank_reports_nothing(tmp_path: Path) -> None:
    reported: list[Rank] = []

    async def on_exit(r: Rank, tail: list[str]) -> None:
        reported.append(r)

    async def scenario() -> list[int]:
        ranks = RankSet(_assignment(), {}, tmp_path / "logs", on_exit,
                        RankSetup(run_dir=tmp_path))
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True)
        held = _Held(live)
        r = Rank(0, 0, held, tmp_path / "rank.log", 0, time.time(), 3)  # type: ignore[arg-type]
        ranks.ranks.append(r)
        ranks._watchers.append(asyncio.create_task(ranks._watch(r)))
        poll = asyncio.create_task(ranks.watch_dying(0.01))
        ranks.channel_closed(0)  # it closed its socket but lives on: not an exit
        await asyncio.sleep(0.1)
        seen = len(reported)
        live.kill()
        held.released.set()
        await asyncio.wait_for(poll, 30)
        await asyncio.sleep(0.05)
        return [seen, len(reported)]

    assert asyncio.run(scenario()) == [0, 1]  # the reaping reports it, once


def test_the_local_socket_tells_the_agent_which_ranks_channel_closed() -> None:
    closed: list[int] = []

    async def scenario() -> None:
        hub = LocalHub(on_event=lambda msg: None, on_closed=closed.append)
        server = LocalSocketServer(hub)
        await server.start()
        try:
            def beat_then_close() -> None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(server.path)
                for rank in (4, 5):
                    s.sendall((json.dumps({"t": "beat", "rank": rank, "pid": os.getpid(),
                                           "generation": 1, "ts": time.time()}) +
                               "\n").encode())
                time.sleep(0.2)
                s.close()

            await asyncio.to_thread(beat_then_close)
            for _ in range(200):
                if len(closed) == 2:
                    break
                await asyncio.sleep(0.02)
        finally:
            await server.close()

    asyncio.run(scenario())
    assert sorted(closed) == [4, 5]


def test_every_exit_is_reported_once_when_its_paths_race_on_a_loaded_loop(
        tmp_path: Path) -> None:
    """The reaper, the /proc poll and a closed channel all find the same dead rank; with the
    loop held up between their turns (a loaded host), each must still report it once. The
    claim is taken before any await: a report that was only scheduled used to let the next
    poll or the reaper report it again (an agent reported one exit twice, 1 in 980 runs)."""
    import random

    rng = random.Random(7)
    reported: list[int] = []

    async def on_exit(r: Rank, tail: list[str]) -> None:
        await asyncio.sleep(0)  # the report itself yields, as the agent's queueing does
        reported.append(r.rank)

    async def busy() -> None:
        while True:  # the loop's other work: it holds the loop for a few ms at a time
            time.sleep(rng.uniform(0.001, 0.006))
            await asyncio.sleep(0)

    async def scenario() -> None:
        ranks = RankSet(_assignment(), {}, tmp_path / "logs", on_exit,
                        RankSetup(run_dir=tmp_path))
        helds = []
        for rank in range(24):
            live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                    start_new_session=True)
            held = _Held(live)
            helds.append((live, held))
            log = tmp_path / f"rank{rank}.log"
            log.write_text("")
            r = Rank(rank, rank, held, log, 0, time.time(), 3)  # type: ignore[arg-type]
            ranks.ranks.append(r)
            ranks._watchers.append(asyncio.create_task(ranks._watch(r)))
        load = asyncio.create_task(busy())
        poll = asyncio.create_task(ranks.watch_dying(0.001))
        for live, _ in helds:
            live.kill()
        for rank, (_, held) in enumerate(helds):
            await asyncio.sleep(rng.uniform(0, 0.01))
            ranks.channel_closed(rank)
            if rng.random() < 0.5:
                held.released.set()  # reaped at once: the reaper races the poll
        await asyncio.sleep(0.05)
        for _, held in helds:
            held.released.set()
        await asyncio.wait_for(poll, 30)
        await asyncio.gather(*ranks._watchers)
        load.cancel()

    for _ in range(5):
        reported.clear()
        asyncio.run(scenario())
        assert sorted(reported) == list(range(24)), reported
