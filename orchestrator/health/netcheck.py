"""``python -m orchestrator.health.netcheck``: one rank of the network test.

Agents start these ranks like a training generation (same ``RankSet``, torch.distributed
environment, a rendezvous on a node's free port), with two extra variables:
``ORCH_HEALTH_NET`` (the test's spec, JSON) and ``ORCH_HEALTH_OUT`` (the directory where
each rank writes ``rank-NNNNN.json``). Every rank measures an all-reduce across the world and, around the ring of
nodes (``network.ring_rounds``), an exchange with the same local rank of its partner node;
the measurements are all-gathered so every node's report carries the whole table, and the
supervisor judges it (``network.judge_network``).

``delay_s`` in the spec (from ``health.chaos.slow_network``) makes this rank sleep inside
every timed transfer, standing for a slow NIC: its partner waits for the data just the same.

The bandwidth test needs a process group over every rank, which a partitioned network
cannot form: first each rank probes its ring partners (``reach``); when a pair cannot reach
each other, the report is the reachability table (no bandwidth) and the judge names the
node that cannot reach its peers. A rank that cannot reach the rendezvous store at all
exits with an error (its node's links show as unreachable in the others' reports).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from orchestrator.contracts import chaos
from orchestrator.contracts.env import read_health_env
from orchestrator.health.network import ring_rounds
from orchestrator.health.reach import probe


def _timed(op: Any, iters: int, warmup: int, delay_s: float, sync: Any) -> float:
    """Median seconds of one ``op()`` (chaos's injected delay inside the timed region)."""
    for _ in range(warmup):
        op()
    sync()
    slow = chaos.slowed(op, delay_s)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        slow()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(spec: dict[str, Any], rank: int, world: int, local: int) -> dict[str, Any]:
    """This rank's part of the test, then the gathered table (same on every rank)."""
    import torch
    import torch.distributed as dist

    nodes: list[str] = spec["nodes"]
    ppn = int(spec["ppn"])
    if spec["backend"] == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)

        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        device = torch.device("cpu")

        def sync() -> None:
            return None
    delay = float(spec.get("delay_s") or 0.0)
    iters, warmup = int(spec["iters"]), int(spec["warmup"])
    mine: dict[str, Any] = {"rank": rank, "allreduce_s": None, "pairs": []}
    if world > 1:
        x = torch.ones(int(spec["allreduce_mib"] * 2**20 // 4), device=device)
        dist.barrier()
        mine["allreduce_s"] = _timed(lambda: dist.all_reduce(x), iters, warmup, delay, sync)
    size = int(spec["pairwise_mib"] * 2**20 // 4)
    send = torch.ones(size, device=device)
    recv = torch.empty(size, device=device)
    me = rank // ppn
    for round_ in ring_rounds(len(nodes)):
        dist.barrier()
        for a, b in round_:
            if me not in (a, b):
                continue
            peer = (b if me == a else a) * ppn + local

            def exchange(peer: int = peer) -> None:
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            mine["pairs"].append({"a": a, "b": b, "s": _timed(exchange, iters, warmup, delay,
                                                              sync)})
    table: list[Any] = [None] * world
    dist.all_gather_object(table, mine)
    return summarize(table, nodes, ppn, spec)


def summarize(table: list[dict[str, Any]], nodes: list[str], ppn: int,
              spec: dict[str, Any]) -> dict[str, Any]:
    """Bandwidths from every rank's timings: a link's time is its slowest rank's."""
    world = len(table)
    ar = [r["allreduce_s"] for r in table if r["allreduce_s"]]
    allreduce = None
    if ar:
        nbytes = int(spec["allreduce_mib"] * 2**20 // 4) * 4
        allreduce = nbytes * 2 * (world - 1) / world / max(ar) / 1e9
    times: dict[tuple[int, int], float] = {}
    for r in table:
        for p in r["pairs"]:
            key = (p["a"], p["b"])
            times[key] = max(times.get(key, 0.0), p["s"])
    pair_bytes = int(spec["pairwise_mib"] * 2**20 // 4) * 4 * ppn
    links = [{"a": nodes[a], "b": nodes[b], "gbps": pair_bytes / t / 1e9}
             for (a, b), t in sorted(times.items())]
    return {"world_size": world, "allreduce_gbps": allreduce, "links": links,
            "backend": spec["backend"]}


def _arrival_s(spec: dict[str, Any]) -> float:
    """How long after the first rank the others may reach the rendezvous before the probe
    takes them as cut off: the spread of a Python-with-torch start on busy nodes, within
    the test's own timeout."""
    return max(5.0, min(30.0, float(spec["timeout_s"]) / 4))


def main() -> int:
    spec, out_dir = read_health_env(os.environ)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(out_dir) / f"rank-{rank:05d}.json"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    import torch.distributed as dist

    start = time.perf_counter()
    timeout = timedelta(seconds=spec["timeout_s"])
    arrival = _arrival_s(spec)
    # A rank that cannot reach the rendezvous within the arrival window is cut off: it
    # says so (its exit) instead of waiting out the whole test.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=timedelta(seconds=arrival + 10),
                          wait_for_workers=False)
    store.set_timeout(timeout)
    reach = probe(store, spec, rank, world, local, arrival) if "addrs" in spec else None
    if reach is not None and not all(lk["reachable"] for lk in reach["links"]):
        report = {"world_size": world, "allreduce_gbps": None, "partitioned": True,
                  "links": [{**lk, "gbps": None} for lk in reach["links"]],
                  "missing_ranks": reach["missing"], "backend": spec["backend"]}
    else:
        dist.init_process_group(spec["backend"], store=dist.PrefixStore("pg", store),
                                rank=rank, world_size=world, timeout=timeout)
        try:
            report = measure(spec, rank, world, local)
        finally:
            dist.destroy_process_group()
    report["seconds"] = round(time.perf_counter() - start, 3)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out)
    print(json.dumps(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
