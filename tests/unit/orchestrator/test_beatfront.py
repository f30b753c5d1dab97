"""The heartbeat process and its link, without a supervisor: the real child process on a real
socket pair and a real HTTP port, the supervisor's side played by a recording ``take``.

What the process may decide alone it decides (beats of mirrored nodes inside their slice are
answered and passed on); everything else is asked, and the answer passed back verbatim. The
wire between the two is fuzzed: bytes that are not a frame raise ``BadFrame``, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts.auth import node_credential
from orchestrator.supervisor.gateway import beatwire
from orchestrator.supervisor.gateway.beatlink import BeatLink

SECRET = "s" * 32


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def _add(self, level: str, event: str, **kw: Any) -> None:
        self.lines.append((level, event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self._add("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._add("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._add("error", event, **kw)


class Supervisor:
    """Plays the supervisor's side: its registry (the mirror's source) and its answers."""

    def __init__(self) -> None:
        self.nodes = {"n0": 3, "n1": 0}
        self.launch: beatwire.Launch | None = None
        self.taken: list[tuple[str, dict[str, Any]]] = []

    def mirror_nodes(self) -> dict[str, int]:
        return dict(self.nodes)

    def mirror_launch(self) -> beatwire.Launch | None:
        return self.launch

    def take(self, node: str, raw: bytes) -> tuple[int, bytes]:
        body = json.loads(raw)
        self.taken.append((node, body))
        if node not in self.nodes:
            return 404, b'{"error": "unknown node; register first"}'
        if body.get("node_id") != node:
            return 403, b'{"error": "forged"}'
        return 200, json.dumps({"assignment_version": self.nodes[node]}).encode()


def _setup(**kw: Any) -> beatwire.Setup:
    base: dict[str, Any] = {
        "host": "127.0.0.1", "port": 0, "token": SECRET, "max_body_mb": 1.0,
        "max_json_depth": 32, "header_timeout_s": 15.0, "world_size": 8,
        "max_step_interval_s": 3600.0, "max_nodes": 16, "ppn": 2}
    return beatwire.Setup(**{**base, **kw})


async def _post(session: aiohttp.ClientSession, port: int, token: str | None,
                body: Any) -> tuple[int, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(f"http://127.0.0.1:{port}/v1/heartbeat", data=data,
                            headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def _until(predicate: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_beats_it_may_take_are_answered_and_passed_on_the_rest_asked() -> None:
    sup, log = Supervisor(), Log()

    async def scenario() -> None:
        link = BeatLink(_setup(), sup.take, sup.mirror_nodes, sup.mirror_launch, log)
        port = await link.start()
        n0, n1 = node_credential(SECRET, "n0"), node_credential(SECRET, "n1")
        try:
            async with aiohttp.ClientSession() as s:
                # Decided alone, nothing reaches the supervisor.
                assert (await _post(s, port, None, {"node_id": "n0"}))[0] == 401
                assert (await _post(s, port, SECRET, {"node_id": "n0"}))[0] == 403
                assert (await _post(s, port, n0, b"{nope"))[0] == 400
                assert (await _post(s, port, n0, {"node_id": "n0", "ranks": 5}))[0] == 422
                assert (await _post(s, port, n0, b"x" * (2 * 2**20)))[0] == 413
                assert sup.taken == []
                # Mirrored node, no ranks: answered from the mirror, passed on in a batch.
                for _ in range(20):
                    assert await _post(s, port, n0, {"node_id": "n0"}) == (
                        200, {"assignment_version": 3})
                await _until(lambda: link.beats == 20)
                assert link.asked == 0
                # Unknown node, forged node id: asked, the supervisor's answer passed back.
                ghost = node_credential(SECRET, "ghost")
                assert (await _post(s, port, ghost, {"node_id": "ghost"}))[0] == 404
                assert (await _post(s, port, n1, {"node_id": "n0"}))[0] == 403
                assert link.asked == 2
                # Ranks before any launch: the mirror cannot place them, so it asks.
                beat = {"node_id": "n1", "generation": 1,
                        "ranks": [{"rank": 2, "local_rank": 0}, {"rank": 3, "local_rank": 1}]}
                assert (await _post(s, port, n1, beat))[0] == 200
                assert link.asked == 3
                # Once the launch is mirrored, its own ranks pass, another node's are asked.
                # (sent as the assignment goes out, ahead of the node's first beat of it)
                sup.launch = beatwire.Launch(generation=1, node_ranks={"n0": 0, "n1": 1})
                link.sync_launch()
                await asyncio.sleep(0.2)  # the frame is on its way to the process
                assert (await _post(s, port, n1, beat))[0] == 200
                await _until(lambda: link.beats == 21)
                assert link.asked == 3
                wrong = {**beat, "node_id": "n0"}
                assert (await _post(s, port, n0, wrong))[0] == 200  # the fake takes it
                assert link.asked == 4
                # A node registered after the start is mirrored on a poke.
                sup.nodes["n2"] = 1
                link.poke()
                await asyncio.sleep(0.3)
                n2 = node_credential(SECRET, "n2")
                assert await _post(s, port, n2, {"node_id": "n2"}) == (
                    200, {"assignment_version": 1})
                assert link.asked == 4
        finally:
            await link.stop()
        assert link.refused == 0
        assert not [line for line in log.lines if line[0] == "error"]

    asyncio.run(scenario())


def test_a_lost_process_is_said_once_and_its_port_withdrawn() -> None:
    sup, log = Supervisor(), Log()
    downs: list[int] = []

    async def scenario() -> None:
        link = BeatLink(_setup(), sup.take, sup.mirror_nodes, sup.mirror_launch, log,
                        on_down=lambda: downs.append(1))
        port = await link.start()
        assert link._proc is not None
        os.kill(link._proc.pid, signal.SIGKILL)
        await _until(lambda: link.port is None)
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectionError):
                await _post(s, port, node_credential(SECRET, "n0"), {"node_id": "n0"})
        await link.stop()

    asyncio.run(scenario())
    assert downs == [1]
    errors = [line for line in log.lines if line[0] == "error"]
    assert len(errors) == 1 and errors[0][1].startswith("heartbeat process lost")


def test_the_process_ends_when_the_supervisor_closes_its_end() -> None:
    sup, log = Supervisor(), Log()

    async def scenario() -> int | None:
        link = BeatLink(_setup(), sup.take, sup.mirror_nodes, sup.mirror_launch, log)
        await link.start()
        proc = link._proc
        assert proc is not None and link._writer is not None
        link._closing = True
        link._writer.close()
        await asyncio.wait_for(proc.wait(), 20)
        await link.stop()
        return proc.returncode

    assert asyncio.run(scenario()) == 0


# -- the wire ------------------------------------------------------------------------------
node_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(node_ids, st.binary(max_size=300)), max_size=20))
def test_beat_batches_round_trip(beats: list[tuple[str, bytes]]) -> None:
    frame = beatwire.beats_frame(beats)
    (size,) = struct.unpack(">I", frame[:4])
    assert size == len(frame) - 4 and frame[4:5] == beatwire.BEATS
    assert beatwire.parse_beats(frame[5:]) == beats


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), node_ids, st.binary(max_size=300),
       st.integers(100, 599))
def test_asks_and_replies_round_trip(request_id: int, node: str, body: bytes,
                                     status: int) -> None:
    assert beatwire.parse_ask(beatwire.ask_frame(request_id, node, body)[5:]) == (
        request_id, node, body)
    assert beatwire.parse_reply(beatwire.reply_frame(request_id, status, body)[5:]) == (
        request_id, status, body)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_bytes_that_are_no_frame_raise_bad_frame_only(data: bytes) -> None:
    """Any payload either raises BadFrame or parses into what encodes back to it."""
    encoders = {
        beatwire.parse_beats: lambda beats: beatwire.beats_frame(beats),
        beatwire.parse_ask: lambda parsed: beatwire.ask_frame(*parsed),
        beatwire.parse_reply: lambda parsed: beatwire.reply_frame(*parsed),
    }
    for parse, encode in encoders.items():
        try:
            parsed = parse(data)
        except beatwire.BadFrame:
            continue
        assert encode(parsed)[5:] == data, (parse.__name__, data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_a_stream_that_is_no_frame_is_refused_not_read_on(data: bytes) -> None:
    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        try:
            while True:
                await beatwire.read_frame(reader, 32)
        except (beatwire.BadFrame, asyncio.IncompleteReadError):
            return

    asyncio.run(read())
