"""The load generator's simulated agents, spread over processes (shards).

One process simulating 2,048 agents read its answers late: in the stops and launches of a
2,048 x 8 run its own loop woke 0.9-1.9 s late (``LoopLag``), and a beat answered in 1 ms
by the supervisor counted as late as that. ``--shards K`` runs the agents in K processes
(node i in shard i % K), each with its own loop, connections and stats; this process keeps
the supervisor, the scenario and the operator's requests.

A shard is ``python loadgen_fleet.py --shard J --of K ...``, started with
``subprocess`` in the generator's process group (a test that kills the group at its
timeout kills the shards too), its stdout a pipe of replies, its stderr a log file in the
run's directory, so no shard (nor the process that writes its stack files) holds the
stdout of whoever started the generator. It takes one JSON command per line on stdin:

    {"op": "nodes"}                          -> {"nodes": [[node_id, alive, rank_offset]...]}
    {"op": "fault", "node_id", "kind", "rank"} -> {"ok": true}   kind: crash|hang|silent|heal
    {"op": "finish"}                         -> {"stats": {...}, "own_late": [[wall, s]...],
                                                 "opened": connections}, then it exits

and exits at once when its stdin closes (the generator is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen_agent import STACKS, Net, SimNode, Stats, quiet_gc
from loadgen_http import Conn

from orchestrator.clock import SYSTEM_CLOCK
from orchestrator.supervisor.deadlines import LoopLag

FAULT_KINDS = ("crash", "hang", "silent", "heal")
_TOKEN_ENV = "ORCH_LOADGEN_TOKEN"
# The longest reply line: the final stats carry every beat's latency and send time
# (2 x 8 bytes of JSON and more per beat; 2,048 nodes beat ~170,000 times in a run).
_REPLY_LIMIT = 256 << 20


@dataclass(frozen=True)
class NodeView:
    """What the scenario needs of a simulated node to pick a victim."""

    node_id: str
    alive: bool
    rank_offset: int


def shard_of(node_id: str, shards: int) -> int:
    return int(node_id.removeprefix("node-")) % shards


def merge_stats(parts: list[dict[str, Any]]) -> Stats:
    """The shards' ``Stats`` (as ``dataclasses.asdict``) added up into one."""
    out = Stats()
    for part in parts:
        for f in dataclasses.fields(Stats):
            value = part[f.name]
            mine = getattr(out, f.name)
            if isinstance(mine, list):
                mine.extend(value)
            elif isinstance(mine, dict):
                mine.update(value)
            else:
                setattr(out, f.name, mine + value)
    out.errors = out.errors[:50]
    return out


class Fleet:
    """The generator's end of its shards."""

    def __init__(self, procs: list[asyncio.subprocess.Process]) -> None:
        self.procs = procs
        self._locks = [asyncio.Lock() for _ in procs]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    async def start(cls, shards: int, *, url: str, token: str, nodes: int, procs: int,
                    step_s: float, stacks: Path, beat_timeout_s: float, logs: Path,
                    gc_default: bool) -> Fleet:
        logs.mkdir(parents=True, exist_ok=True)
        started = []
        env = {**os.environ, _TOKEN_ENV: token}
        for j in range(shards):
            with open(logs / f"shard{j}.log", "wb") as log:  # noqa: ASYNC230 (once, at start)
                started.append(await asyncio.create_subprocess_exec(
                    sys.executable, str(Path(__file__).resolve()), "--shard", str(j),
                    "--of", str(shards), "--url", url, "--nodes", str(nodes),
                    "--procs", str(procs), "--step-s", str(step_s), "--stacks", str(stacks),
                    "--beat-timeout-s", str(beat_timeout_s),
                    *(["--gc-default"] if gc_default else []),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                    limit=_REPLY_LIMIT))
        fleet = cls(started)
        try:
            for j in range(shards):
                await fleet._read(j, 60.0)  # {"ready": true}: imported, agents started
        except BaseException:
            await fleet.close()
            raise
        return fleet

    async def _read(self, j: int, timeout: float) -> dict[str, Any]:
        proc = self.procs[j]
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"load generator shard {j} exited ({await proc.wait()}); "
                               "see its shard log")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise TypeError(f"shard {j} answered {line[:200]!r}")
        return reply

    async def ask(self, j: int, cmd: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        async with self._locks[j]:
            proc = self.procs[j]
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd).encode() + b"\n")
            await proc.stdin.drain()
            return await self._read(j, timeout)

    async def nodes(self) -> list[NodeView]:
        replies = await asyncio.gather(*(self.ask(j, {"op": "nodes"})
                                         for j in range(len(self.procs))))
        return [NodeView(str(n), bool(alive), int(off))
                for r in replies for n, alive, off in r["nodes"]]

    async def fault(self, node_id: str, kind: str, rank: int) -> None:
        await self.ask(shard_of(node_id, len(self.procs)),
                       {"op": "fault", "node_id": node_id, "kind": kind, "rank": rank})

    async def finish(self, timeout: float = 60.0) -> tuple[Stats, list[tuple[float, float, int]],
                                                           int]:
        """Stop every simulated agent; their stats merged, each shard's own loop lateness
        as (wall, seconds, shard), and the connections they opened."""
        replies = await asyncio.gather(*(self.ask(j, {"op": "finish"}, timeout)
                                         for j in range(len(self.procs))))
        for proc in self.procs:
            await asyncio.wait_for(proc.wait(), timeout)
        late = [(float(t), float(s), j) for j, r in enumerate(replies)
                for t, s in r["own_late"]]
        return (merge_stats([r["stats"] for r in replies]), late,
                sum(int(r["opened"]) for r in replies))

    async def close(self) -> None:
        """Kill what still runs and reap it (on the loop its pipes belong to)."""
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
        for proc in self.procs:
            await proc.wait()


# -- the shard's side ---------------------------------------------------------------------------

def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _apply(nodes: dict[str, SimNode], cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.get("op")
    if op == "nodes":
        return {"nodes": [[n.node_id, n.alive, n.rank_offset] for n in nodes.values()]}
    if op == "fault":
        node_id, kind, rank = cmd.get("node_id"), cmd.get("kind"), cmd.get("rank")
        node = nodes.get(node_id) if isinstance(node_id, str) else None
        if node is None or kind not in FAULT_KINDS or type(rank) is not int:
            return {"error": f"bad fault command: {cmd!r}"}
        if kind == "crash":
            node.crash(rank)
        elif kind == "hang":
            node.hang(rank)
        elif kind == "silent":
            node.go_silent()
        else:
            node.heal()
        return {"ok": True}
    return {"error": f"unknown command: {cmd!r}"}


def _parse(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:  # not JSON, or not UTF-8: answered as not a command
        return None


async def _stdin() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def shard(a: argparse.Namespace) -> int:
    stats = Stats()
    own_late: list[tuple[float, float]] = []
    lag = LoopLag(SYSTEM_CLOCK, on_late=lambda s: own_late.append((time.time(), s)))
    lag_task = asyncio.create_task(lag.run())
    reader = await _stdin()
    finished = False
    async with Net(a.url, os.environ[_TOKEN_ENV], stats) as net:
        nodes = {n.node_id: n for n in (
            SimNode(net, i, a.procs, a.step_s, Path(a.stacks), beat_timeout_s=a.beat_timeout_s)
            for i in range(a.shard, a.nodes, a.of))}
        agents = [asyncio.create_task(n.run()) for n in nodes.values()]
        _reply({"ready": True})
        while line := await reader.readline():
            cmd = _parse(line)
            if isinstance(cmd, dict) and cmd.get("op") == "finish":
                finished = True
                break
            _reply(_apply(nodes, cmd) if isinstance(cmd, dict)
                   else {"error": f"not a command: {line[:200]!r}"})
        for n in nodes.values():
            n.stopped.set()
        if finished:
            await asyncio.gather(*agents, return_exceptions=True)
    lag_task.cancel()
    if not finished:
        return 1  # the generator went away: nothing to report to
    STACKS.close()  # the stack files written before the report says how many
    _reply({"stats": dataclasses.asdict(stats), "own_late": own_late, "opened": Conn.opened})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard", type=int, required=True)
    ap.add_argument("--of", type=int, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--nodes", type=int, required=True, help="nodes of the whole fleet")
    ap.add_argument("--procs", type=int, required=True)
    ap.add_argument("--step-s", type=float, required=True)
    ap.add_argument("--stacks", required=True)
    ap.add_argument("--beat-timeout-s", type=float, required=True)
    ap.add_argument("--gc-default", action="store_true")
    a = ap.parse_args()
    if not 0 <= a.shard < a.of:
        ap.error(f"--shard {a.shard} is not one of {a.of}")
    quiet_gc(a.gc_default)
    return asyncio.run(shard(a))


if __name__ == "__main__":
    sys.exit(main())
