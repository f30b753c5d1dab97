"""One shard of the load generator (``bench/loadgen/loadgen_fleet.py``) as the generator drives it:
a real process, commands on its stdin, one reply line for each, its stats at ``finish``.

No supervisor answers here (its URL is a closed port): the simulated agents retry their
registration, which the stats count, while the shard answers its commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
NODES, SHARDS = 6, 2  # this shard (0 of 2) simulates node-00000, -00002, -00004


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Shard:
    def __init__(self, tmp: Path) -> None:
        env = {**os.environ, "ORCH_LOADGEN_TOKEN": "t" * 32, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.log = open(tmp / "shard.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "loadgen" / "loadgen_fleet.py"), "--shard", "0",
             "--of", str(SHARDS), "--url", f"http://127.0.0.1:{closed_port()}",
             "--nodes", str(NODES), "--procs", "2", "--step-s", "0.5",
             "--stacks", str(tmp / "stacks"), "--beat-timeout-s", "5"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=env, start_new_session=True)
        assert self.read() == {"ready": True}

    def read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, (Path(self.log.name).read_text())[-3000:]
        return json.loads(line)

    def send(self, line: bytes) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        return self.read()

    def ask(self, cmd: dict[str, Any]) -> Any:
        return self.send(json.dumps(cmd).encode())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    s = Shard(tmp_path_factory.mktemp("shard"))
    try:
        yield s
    finally:
        s.kill()


def test_a_shard_lists_its_nodes_and_takes_faults(shard: Shard) -> None:
    nodes = shard.ask({"op": "nodes"})["nodes"]
    assert [n[0] for n in nodes] == ["node-00000", "node-00002", "node-00004"]
    assert all(alive is False for _, alive, _ in nodes)  # nothing launched: none alive
    assert shard.ask({"op": "fault", "node_id": "node-00002", "kind": "silent",
                      "rank": 3}) == {"ok": True}
    assert shard.ask({"op": "fault", "node_id": "node-00002", "kind": "heal",
                      "rank": 3}) == {"ok": True}
    # Another shard's node, a fault it does not know, a rank that is no int: refused.
    for bad in ({"node_id": "node-00001", "kind": "crash", "rank": 1},
                {"node_id": "node-00000", "kind": "explode", "rank": 1},
                {"node_id": "node-00000", "kind": "hang", "rank": True},
                {"node_id": ["node-00000"], "kind": "hang", "rank": 1}):
        assert "error" in shard.ask({"op": "fault", **bad}), bad


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=200).map(lambda b: b.replace(b"\n", b" ")),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                 lambda kids: st.lists(kids, max_size=3)
                 | st.dictionaries(st.sampled_from(["op", "node_id", "kind", "rank", "x"]),
                                   kids, max_size=4), max_leaves=8)
    .filter(lambda v: not (isinstance(v, dict) and v.get("op") == "finish"))
    .map(lambda v: json.dumps(v).encode())))
def test_every_line_but_finish_gets_one_reply_and_the_shard_lives(shard: Shard,
                                                                  line: bytes) -> None:
    reply = shard.send(line)
    assert isinstance(reply, dict) and set(reply) <= {"ok", "error", "nodes"}, reply
    assert shard.proc.poll() is None


def test_finish_reports_the_stats_and_exits(shard: Shard) -> None:
    reply = shard.ask({"op": "finish"})
    assert shard.proc.wait(timeout=30) == 0
    stats = reply["stats"]
    # The agents tried to register with no supervisor to answer, and counted it.
    assert stats["register_retries"] >= 3 and stats["registrations"] == 0
    assert stats["beat_latency"] == [] and reply["opened"] >= 0
    assert isinstance(reply["own_late"], list)


def test_a_shard_exits_when_its_generator_goes(tmp_path: Path) -> None:
    s = Shard(tmp_path)
    try:
        assert s.proc.stdin is not None
        s.proc.stdin.close()  # the generator died: its end of the pipe closed
        assert s.proc.wait(timeout=30) == 1
    finally:
        s.kill()
