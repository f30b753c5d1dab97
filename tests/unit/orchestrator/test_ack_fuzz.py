"""The agent's answer to a rank's last words (an event line with ``"ack": true``) over a real
unix socket, for any line a rank's process could write: an ``ack`` only for an event line
that asks for one, written after the event was handed on; a key request its key reply;
nothing for any other line; and the socket keeps serving (hypothesis, 300 lines)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
from orchestrator.worker.sdk import ACK_LINE

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
_event_lines = st.fixed_dictionaries(
    {"t": st.sampled_from(["event", "beat", "key", "other"])},
    optional={"ack": st.sampled_from([True, False, "true", 1, None]),
              "rank": st.integers(-1, 2**40) | st.text(max_size=5) | st.none(),
              "generation": _values, "name": _values, "data": _values, "ts": _values})
_lines = _event_lines.map(lambda d: json.dumps(d).encode()) | st.binary(max_size=200)


class Agent:
    """A LocalSocketServer in a thread of its own, the events it handed on."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.server = LocalSocketServer(LocalHub(on_event=self.events.append))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    a = Agent()
    yield a
    a.close()


def _send(path: str, line: bytes, timeout: float) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line.replace(b"\n", b" ") + b"\n")
        try:
            return s.recv(64)
        except TimeoutError:
            return b""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=_lines)
def test_only_an_event_asking_for_it_is_acknowledged(agent: Agent, line: bytes) -> None:
    try:
        msg = json.loads(line)
    except ValueError:
        msg = None
    asks = isinstance(msg, dict) and msg.get("t") == "event" and msg.get("ack") is True
    key = isinstance(msg, dict) and msg.get("t") == "key"
    before = len(agent.events)
    answer = _send(agent.server.path, line, timeout=2.0 if asks or key else 0.05)
    if asks:
        assert answer == ACK_LINE
        handed_on = isinstance(msg.get("rank"), int)  # the hub's test for an event line
        assert len(agent.events) == before + handed_on  # before the answer was written
    elif key:  # the key service's own answer (this agent holds no key: a refusal)
        assert answer.startswith((b'{"t": "key"', b'{"t":"key"'))
    else:
        assert answer == b""
    # The socket still serves a well-formed request after whatever came before.
    good = json.dumps({"t": "event", "ack": True, "rank": 0, "name": "chaos",
                       "data": {}}).encode()
    assert _send(agent.server.path, good, timeout=2.0) == ACK_LINE
