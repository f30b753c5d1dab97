"""Supervisor CPU per heartbeat over HTTP: the real API server, one event loop against another.

``bench/supervisor/heartbeat.py`` times the parse and the fold alone (~40 us); at 2,048 nodes
most of a heartbeat's cost is the HTTP server around them. Here the real ``ApiServer`` of a real
``Supervisor`` (N nodes x 8 ranks registered, generation 1 launched) serves on loopback in a
child process, under each ``--loop`` in turn (``uvloop`` needs ``pip install uvloop``),
alternating ``--repeats`` times so a noisy neighbour hits both alike. A client with one keep-alive connection per node sends heartbeats
in rounds (each node's own credential, steps advancing) and reads the server's CPU time from
/proc around them: the report is CPU per heartbeat (user + system), and the client-side
latency, which on a shared 2-core VM is mostly the client's own.

Sequential requests, one at a time: this measures the cost of one request, not a server
under load: uvloop uses 4-9 % less CPU here, yet under the 2,048 x 8 load generator
(``bench/loadgen``) a supervisor on uvloop had a 7x worse heartbeat p99, which is why the
supervisor runs on asyncio's loop.

    python bench/supervisor/heartbeat_http.py --loop asyncio --loop uvloop \
        --out heartbeat-http-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PPN = 8
_TICK = os.sysconf("SC_CLK_TCK")


def serve(loop: str, nodes: int, report_fd: int) -> None:
    """The child: a supervisor with every node registered and generation 1 launched."""
    from orchestrator.config import load_config
    from orchestrator.contracts.protocol import RegisterRequest
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.supervisor.core import Supervisor
    from orchestrator.supervisor.gateway.server import ApiServer

    cfg = load_config(None, [f"cluster.nodes={nodes}", f"cluster.procs_per_node={PPN}",
                             "launcher.kind=kubernetes", "job.name=bench"])
    sup = Supervisor(cfg, RunDir(Path(tempfile.mkdtemp(prefix="hb-http-")) / "run"))
    for n in range(nodes):
        sup.intake.on_register(RegisterRequest(
            node_id=f"node-{n}", host=f"h{n}", addr="127.0.0.1", procs=PPN, agent_pid=1,
            free_port=20000 + n))
    sup.intake.begin_generation(1, nodes * PPN)
    # What the journal's launch record replays into (node ranks of generation 1), so the
    # admission check sees every heartbeat's ranks as the node's own.
    sup.view.launches.append({"generation": 1, "nodes": {f"node-{n}": n for n in range(nodes)}})

    async def main() -> None:
        port = await ApiServer(sup.api_wiring()).start("127.0.0.1", 0)
        os.write(report_fd, f"{port} {sup.token}\n".encode())
        await asyncio.Event().wait()

    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def _request(secret: str, node: int, step: int) -> bytes:
    from loadgen_wire import bearer, heartbeat, rank_info

    now = time.time()
    ranks = [rank_info(node * PPN + i, i, None, step=step, phase="training",
                       last_step_ts=now, beat_ts=now, interval_max=0.5) for i in range(PPN)]
    body = json.dumps(heartbeat(f"node-{node}", 1, 20000 + node, ranks, [])).encode()
    return (f"POST /v1/heartbeat HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer "
            f"{bearer(secret, f'node-{node}')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _exchange(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    if b" 200 " not in lines[0]:
        raise RuntimeError(f"heartbeat refused: {head[:300]!r} {rest[:300]!r}")
    length = next(int(x.split(b":", 1)[1]) for x in lines if x.lower().startswith(
        b"content-length"))
    while len(rest) < length:
        rest += sock.recv(65536)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def measure(loop: str, nodes: int, rounds: int) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: quiet (its log would be one line per registration)
        os.close(r)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        try:
            serve(loop, nodes, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r) as f:
            port_s, secret = f.readline().split()
        socks = [socket.create_connection(("127.0.0.1", int(port_s))) for _ in range(nodes)]
        for n in range(nodes):  # warm-up: every connection and code path once
            _exchange(socks[n], _request(secret, n, 1))
        lat: list[float] = []
        cpu0 = _cpu_s(pid)
        for step in range(2, rounds + 2):
            for n in range(nodes):
                data = _request(secret, n, step)
                t0 = time.perf_counter()
                _exchange(socks[n], data)
                lat.append(time.perf_counter() - t0)
        cpu = _cpu_s(pid) - cpu0
        for s in socks:
            s.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    lat.sort()
    return {"loop": loop, "heartbeats": len(lat),
            "server_cpu_us_per_beat": round(cpu / len(lat) * 1e6, 1),
            "client_p50_us": round(lat[len(lat) // 2] * 1e6),
            "client_p99_us": round(lat[int(len(lat) * 0.99)] * 1e6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", action="append", choices=["asyncio", "uvloop"], default=[])
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="results/<name>.json (default: print only)")
    args = ap.parse_args()
    loops = args.loop or ["asyncio", "uvloop"]
    runs = []
    for _ in range(args.repeats):
        for loop in loops:
            runs.append(measure(loop, args.nodes, args.rounds))
            print(json.dumps(runs[-1]), flush=True)
    median = {loop: statistics.median(x["server_cpu_us_per_beat"] for x in runs
                                      if x["loop"] == loop) for loop in loops}
    report: dict[str, Any] = {
        "what": f"supervisor CPU per HTTP heartbeat, real ApiServer, {args.nodes} nodes x "
                f"{PPN} ranks, {args.rounds} rounds, loops alternated {args.repeats} times",
        "load_avg_1m": os.getloadavg()[0], "median_cpu_us_per_beat": median, "runs": runs}
    if len(loops) == 2:
        report["second_over_first"] = round(median[loops[1]] / median[loops[0]], 3)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.out:
        from common import header, write

        print(write(args.out, {**header(args.device), **report}))


if __name__ == "__main__":
    main()
