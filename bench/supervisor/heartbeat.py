"""CPU the supervisor spends on one heartbeat: parse the body, then fold it (intake).

Measured in-process, without HTTP, on the code of one or more trees in one run, so before and
after compare as a ratio on the same machine at the same moment:

    python bench/supervisor/heartbeat.py --tree /path/to/old/checkout --tree .   # before, after

Each tree runs in its own subprocess (``PYTHONPATH=TREE``): a supervisor object over a fresh
run dir with N nodes x 8 ranks registered and a generation begun, then R rounds of one
heartbeat per node (8 ranks each, steps advancing, node 0 carrying rank 0's step record),
timed with ``time.process_time`` (CPU, not wall: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _body(node: int, ppn: int, step: int, rank0_record: bool) -> bytes:
    now = time.time()
    ranks = [{"rank": node * ppn + i, "local_rank": i, "pid": 1000 + i, "alive": True,
              "step": step, "phase": "training", "last_step_ts": now, "beat_ts": now,
              "step_interval_max": 0.5} for i in range(ppn)]
    records = [{"step": step, "loss": 2.5, "grad_norm": 0.7, "param_norm": None,
                "tokens": step * 4096, "step_time": 0.5, "lr": 3e-4, "ts": now,
                "batch": step, "data_s": 0.01, "ckpt_block_s": 0.0}] if rank0_record else []
    return json.dumps({"node_id": f"node-{node}", "generation": 1, "ranks": ranks,
                       "records": records}).encode()


def measure(nodes: int, ppn: int, rounds: int) -> dict[str, Any]:
    """Run inside the tree under test."""
    from orchestrator.config import load_config
    from orchestrator.contracts.protocol import Heartbeat, RegisterRequest
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.supervisor.core import Supervisor

    try:  # the server's own parse: straight from bytes, bounded depth (a tree that has it)
        from orchestrator.supervisor.gateway import admission  # noqa: F401

        def parse(body: bytes) -> Any:
            return Heartbeat.model_validate_json(body, context={"max_json_depth": 32})
    except ImportError:  # before: json.loads, then the model
        def parse(body: bytes) -> Any:
            return Heartbeat.model_validate(json.loads(body))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"cluster.nodes={nodes}", f"cluster.procs_per_node={ppn}",
                                 "launcher.kind=kubernetes", "job.name=bench"])
        sup = Supervisor(cfg, RunDir(Path(tmp) / "run"))
        for n in range(nodes):
            sup.intake.on_register(RegisterRequest(
                node_id=f"node-{n}", host=f"h{n}", addr="127.0.0.1", procs=ppn,
                agent_pid=1, free_port=20000 + n))
        sup.intake.begin_generation(1, nodes * ppn)
        parse_s = fold_s = 0.0
        count = 0
        for r in range(rounds):
            for n in range(nodes):
                body = _body(n, ppn, r + 1, n == 0)
                t0 = time.process_time()
                hb = parse(body)
                t1 = time.process_time()
                sup.intake.on_heartbeat(hb)
                t2 = time.process_time()
                parse_s, fold_s, count = parse_s + (t1 - t0), fold_s + (t2 - t1), count + 1
        sup.journal.close()
    return {"heartbeats": count, "parse_us": round(parse_s / count * 1e6, 1),
            "fold_us": round(fold_s / count * 1e6, 1),
            "total_us": round((parse_s + fold_s) / count * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[],
                    help="a checkout to measure (repeatable; default: this one)")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ppn", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="heartbeat-cpu.json")
    args = ap.parse_args()
    if args.inner:
        print(json.dumps(measure(args.nodes, args.ppn, args.rounds)))
        return
    from common import header, write

    trees = args.tree or [str(Path(__file__).resolve().parents[2])]
    results = []
    for tree in trees:
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        out = subprocess.run([sys.executable, __file__, "--inner", "--nodes", str(args.nodes),
                              "--ppn", str(args.ppn), "--rounds", str(args.rounds)],
                             capture_output=True, text=True, env=env, cwd=tree, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=tree).stdout.strip()
        results.append({"tree_commit": commit, **json.loads(out.stdout.strip().splitlines()[-1])})
        print(results[-1], flush=True)
    report = {**header(), "what": "supervisor CPU per heartbeat (parse + intake fold), "
              f"{args.nodes} nodes x {args.ppn} ranks, {args.rounds} rounds",
              "load_avg_1m": os.getloadavg()[0], "results": results}
    if len(results) >= 2:
        report["after_over_before"] = round(results[-1]["total_us"] / results[0]["total_us"], 3)
    print(write(args.out, report))


if __name__ == "__main__":
    main()
