"""The standby's slot copier (``trainer.checkpoint.copier``) on its real Unix socket: what it
answers, what it refuses, and that nothing a rank sends is used before it is parsed with
bounds. The copies themselves go through CUDA IPC: ``tests/gpu/test_slot_copier_gpu.py``."""

from __future__ import annotations

import json
import mmap
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.checkpoint import copier as cp


@pytest.fixture
def sock_dir():
    # Short: a Unix socket's path must fit sun_path (pytest's tmp_path may not).
    with tempfile.TemporaryDirectory(prefix="cp-", dir="/tmp") as d:
        yield Path(d)


def _server(path: Path, pinned: dict, rank: int = 3) -> tuple[cp.CopierServer, list[str]]:
    logs: list[str] = []
    asked: list[int] = []

    def pin(nbytes: int) -> dict:
        asked.append(nbytes)
        return pinned

    server = cp.CopierServer(path, rank, pin, logs.append)
    server.asked = asked  # type: ignore[attr-defined]
    server.start()
    return server, logs


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def _reply(s: socket.socket) -> dict:
    body = cp.recv_frame(s)
    assert body is not None, "the copier closed the connection"
    return json.loads(body)


def test_the_copier_page_locks_for_its_rank_and_refuses_copies_it_cannot_check(sock_dir):
    buf = mmap.mmap(-1, 1 << 20)
    server, _ = _server(cp.socket_path(sock_dir, 3), {"a": (buf, 4096), "b": (buf, 4096)})
    try:
        assert oct(cp.socket_path(sock_dir, 3).stat().st_mode & 0o777) == "0o600"
        s = _connect(cp.socket_path(sock_dir, 3))
        cp.send_frame(s, {"op": "hello", "rank": 3, "slot_bytes": 4000})
        assert _reply(s) == {"op": "ready", "seq": -1, "ok": True, "error": None,
                             "seconds": 0.0}
        assert server.asked == [4000]  # type: ignore[attr-defined]
        # A storage never shared, and a slot range past what is page-locked: refused, the
        # connection stays.
        cp.send_frame(s, {"op": "copy", "seq": 0, "direction": "d2h", "slot": "a",
                          "items": [[0, 0, 16, 0]]})
        r = _reply(s)
        assert (r["seq"], r["ok"]) == (0, False) and "never shared" in r["error"]
        assert cp.refusal(cp.Copy(op="copy", seq=1, direction="h2d", slot="b",
                                  items=[(0, 0, 100, 4000)]),
                          {0: _Fake(100)}, {"b": (buf, 4096)}).startswith("slot b: bytes")
        assert cp.refusal(cp.Copy(op="copy", seq=1, direction="h2d", slot="b",
                                  items=[(0, 8, 100, 0)]), {0: _Fake(100)},
                          {"b": (buf, 4096)}) == "storage 0: bytes 8+100 past its 100"
        assert cp.refusal(cp.Copy(op="copy", seq=1, direction="d2h", slot="a",
                                  items=[(0, 0, 100, 0)]), {0: _Fake(100)},
                          {"b": (buf, 4096)}) == "slot a is not page-locked here"
        assert cp.refusal(cp.Copy(op="copy", seq=1, direction="d2h", slot="b",
                                  items=[(0, 0, 100, 3996)]), {0: _Fake(100)},
                          {"b": (buf, 4096)}) is None
        # A frame over the bound ends the connection; the copier serves the next one.
        s.sendall(struct.pack(">I", cp.MAX_FRAME + 1))
        assert cp.recv_frame(s) is None
        s.close()
        s = _connect(cp.socket_path(sock_dir, 3))
        cp.send_frame(s, {"op": "hello", "rank": 4, "slot_bytes": 1})
        r = _reply(s)
        assert not r["ok"] and "serves rank 3, not 4" in r["error"]
        s.close()
    finally:
        server.stop()
    assert not cp.socket_path(sock_dir, 3).exists()
    server.join(5)
    assert not server.is_alive()


class _Fake:
    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n


def test_a_client_whose_copier_refuses_or_goes_away_is_dead_and_fails_what_it_asked(sock_dir):
    path = cp.socket_path(sock_dir, 0)
    assert cp.CopierClient.connect(path, 0, 1, print) is None  # nobody listens: own copies
    server, _ = _server(path, {}, rank=0)  # cannot page-lock: not ready
    logs: list[str] = []
    try:
        client = cp.CopierClient.connect(path, 0, 4096, logs.append)
        assert client is not None
        deadline = time.monotonic() + 10
        while client.dead is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not client.usable() and client.dead == "could not page-lock the slots"
        assert logs and "copies on its own" in logs[0]
        client.close()
    finally:
        server.stop()
    # A copier that answers a copy never asked: the client stops trusting it.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def rogue() -> None:
        conn, _ = listener.accept()
        cp.recv_frame(conn)
        cp.send_frame(conn, {"op": "ready", "ok": True})
        cp.send_frame(conn, {"op": "done", "seq": 7, "ok": True, "seconds": 0.1})
        time.sleep(1)
        conn.close()

    t = threading.Thread(target=rogue)
    t.start()
    client = cp.CopierClient.connect(path, 0, 4096, logs.append)
    assert client is not None
    t.join()
    assert client.dead is not None and "never asked" in client.dead
    listener.close()


def test_a_copier_socket_path_must_fit_sun_path():
    assert cp.usable_path(Path("/dev/shm/orch-mem-0123456789abcdef-node-0/copier-r7.sock"))
    assert not cp.usable_path(Path("/" + "x" * 120))


_REQ = st.one_of(
    st.binary(max_size=300),
    st.dictionaries(st.sampled_from(["op", "seq", "rank", "slot_bytes", "items", "slot",
                                     "direction", "storages", "extra"]),
                    st.one_of(st.integers(-2**70, 2**70), st.text(max_size=8), st.none(),
                              st.booleans(), st.floats(allow_nan=True),
                              st.lists(st.lists(st.integers(-5, 2**50), max_size=5),
                                       max_size=3)),
                    max_size=6).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=400, deadline=None)
@given(_REQ)
def test_fuzz_a_request_is_a_checked_message_or_a_value_error(raw):
    try:
        msg = cp.parse_request(raw)
    except ValueError:
        return
    assert isinstance(msg, cp.Hello | cp.Share | cp.Copy)
    if isinstance(msg, cp.Copy):
        assert msg.direction in ("d2h", "h2d") and msg.slot in ("a", "b")
        for sid, off, n, slot_off in msg.items:
            assert 0 <= sid and 0 <= off and 1 <= n and 0 <= slot_off


@settings(max_examples=200, deadline=None)
@given(st.integers(-2**64, 2**64), st.integers(-2**64, 2**64), st.text(max_size=40))
def test_fuzz_share_fields_out_of_bounds_are_refused(size, offset, handle):
    raw = json.dumps({"op": "share", "storages": [{
        "sid": 0, "device": 0, "handle": handle, "size": size, "offset": offset}]}).encode()
    try:
        msg = cp.parse_request(raw)
    except ValueError:
        return
    s = msg.storages[0]
    assert 1 <= s.size <= 1 << 46 and 0 <= s.offset <= 1 << 46
    assert all(c.isalnum() or c in "+/=" for c in s.handle)
