"""The supervisor's end of its heartbeat process (``beatfront``, with ``api.heartbeat_process``).

It starts the process with one end of a socket pair, keeps the process's mirror current (the
registered nodes with their assignment versions, the newest launch; a delta every
``SYNC_S``, and at once when a node registers), and hands every beat the process passes on to
``take`` (the server's heartbeat logic: parse, check, fold in). A beat the process asks about
is answered with what ``take`` returns.

If the process dies, ``port`` becomes None: registrations stop advertising it, agents that
still know it find it closed and beat to the supervisor's own port, and a log line says so.
The supervisor goes on; it is slower at scale, not wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from orchestrator.supervisor.gateway import beatwire

# How often the mirror is brought up to date (and at once on a registration).
SYNC_S = 0.1
# The process must say where it listens within this.
START_TIMEOUT_S = 60.0
# Folding forwarded beats gives the loop back after this long (a batch after a stall is
# large). A count (64 beats) starved the reader when the loop was busy launching: one turn per
# 64 beats fell behind 2,048 beats a second, and the beats asked about waited ~1 s behind it.
_FOLD_SLICE_S = 0.005

# What the heartbeat route answers for a (node, body): HTTP status and JSON body.
Take = Callable[[str, bytes], tuple[int, bytes]]
# What the mirror should say: node -> assignment version; and the newest launch (or None),
# cheap to ask (the same object until the next launch).
NodeSource = Callable[[], dict[str, int]]
LaunchSource = Callable[[], beatwire.Launch | None]


class BeatLink:
    def __init__(self, setup: beatwire.Setup, take: Take, nodes: NodeSource,
                 launch: LaunchSource, log: Any,
                 on_down: Callable[[], None] = lambda: None) -> None:
        self.setup = setup
        self.on_down = on_down
        self.take = take
        self.nodes = nodes
        self.launch = launch
        self.log = log
        self.port: int | None = None
        self.beats = 0  # passed on by the process and folded in
        self.refused = 0  # passed on, then refused here (the mirror was ahead: a bug)
        self.asked = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._poke = asyncio.Event()
        self._sent_nodes: dict[str, int] = {}
        self._sent_launch: beatwire.Launch | None = None
        self._closing = False
        self._last_refusal_log = 0.0

    async def start(self) -> int:
        parent, child = socket.socketpair()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator.supervisor.gateway.beatfront",
                "--fd", str(child.fileno()), pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL)
        finally:
            child.close()
        limit = beatwire.frame_bound(self.setup.max_body_mb)
        reader, self._writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 16)
        self._writer.write(beatwire.model_frame(beatwire.SETUP, self.setup))
        self._sync()
        try:
            kind, payload = await asyncio.wait_for(beatwire.read_frame(reader, 1 << 16),
                                                   START_TIMEOUT_S)
            if kind != beatwire.READY:
                raise beatwire.BadFrame(f"expected the ready frame, got {kind!r}")
            self.port = beatwire.Ready.model_validate_json(payload).port
        except BaseException:
            await self.stop()
            raise
        self._tasks = [asyncio.create_task(self._read(reader, limit), name="beatlink-read"),
                       asyncio.create_task(self._keep_synced(), name="beatlink-sync"),
                       asyncio.create_task(self._watch(), name="beatlink-watch")]
        self.log.info("heartbeat process started", pid=self._proc.pid, port=self.port)
        return self.port

    def poke(self) -> None:
        """Bring the mirror up to date soon (a node registered)."""
        self._poke.set()

    def sync_launch(self) -> None:
        """Tell the process of a new launch now, before an agent can hear of it: called as
        an assignment goes out, so beats of the new generation are not asked about."""
        launch = self.launch()
        if launch is not self._sent_launch and self._writer is not None:
            self._writer.write(beatwire.model_frame(beatwire.MIRROR,
                                                    beatwire.Mirror(launch=launch)))
            self._sent_launch = launch

    async def stop(self) -> None:
        self._closing = True
        self.port = None
        for task in self._tasks:
            task.cancel()
        if self._writer is not None:
            self._writer.close()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- the mirror ----------------------------------------------------------------------
    def _sync(self) -> None:
        nodes, launch = self.nodes(), self.launch()
        sent = self._sent_nodes
        changed = {n: v for n, v in nodes.items() if sent.get(n) != v}
        new_launch = launch if launch is not self._sent_launch else None
        if (changed or new_launch is not None) and self._writer is not None:
            self._writer.write(beatwire.model_frame(
                beatwire.MIRROR, beatwire.Mirror(nodes=changed, launch=new_launch)))
            sent.update(changed)
            if new_launch is not None:
                self._sent_launch = new_launch

    async def _keep_synced(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), SYNC_S)
            self._poke.clear()
            self._sync()

    # -- from the process ------------------------------------------------------------------
    async def _read(self, reader: asyncio.StreamReader, limit: int) -> None:
        try:
            while True:
                kind, payload = await beatwire.read_frame(reader, limit)
                if kind == beatwire.BEATS:
                    await self._fold(beatwire.parse_beats(payload))
                elif kind == beatwire.ASK:
                    request_id, node, body = beatwire.parse_ask(payload)
                    self.asked += 1
                    status, answer = self.take(node, body)
                    if self._writer is not None:
                        self._writer.write(beatwire.reply_frame(request_id, status, answer))
                else:
                    raise beatwire.BadFrame(f"unexpected frame {kind!r}")
        except asyncio.IncompleteReadError:
            self._down("its socket closed")
        except (beatwire.BadFrame, ValueError) as exc:
            self._down(f"it sent a bad frame: {exc}")

    async def _fold(self, beats: list[tuple[str, bytes]]) -> None:
        slice_end = time.perf_counter() + _FOLD_SLICE_S
        for node, body in beats:
            if time.perf_counter() > slice_end:
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + _FOLD_SLICE_S
            status, answer = self.take(node, body)
            if status == 200:
                self.beats += 1
                continue
            self.refused += 1
            now = time.monotonic()
            if now - self._last_refusal_log > 10.0:
                self._last_refusal_log = now
                self.log.warning("a beat the heartbeat process accepted was refused here",
                                 node=node, status=status, answer=answer[:200].decode(
                                     "utf-8", "replace"), refused=self.refused)

    async def _watch(self) -> None:
        assert self._proc is not None
        rc = await self._proc.wait()
        self._down(f"it exited with {rc}")

    def _down(self, why: str) -> None:
        if self._closing or self.port is None:
            return
        self.port = None
        self.log.error("heartbeat process lost; agents beat to the supervisor's own port",
                       why=why, beats=self.beats)
        self.on_down()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
