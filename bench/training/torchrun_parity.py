"""Side by side with torchrun, same script, same machine, one run: how long a crashed rank
takes to train again, and how long a hung (SIGSTOPped) rank takes to be found.

    python bench/training/torchrun_parity.py   # writes bench/results/torchrun-parity-cpu.json

The script is ``tests/integration/scripts/torchrun_ddp.py`` (plain DDP, no SDK, ``@record``),
2 ranks: under `orchestrator up` as 2 simulated nodes x 1 rank with the default timeouts
(training floor 30 s), under `torchrun --standalone --nproc-per-node 2 --max-restarts 3`.

- recovery: SIGKILL rank 1 at step >= 10; seconds until a rank trains again (ours: the new
  generation's first step record; torchrun: the first step line after the restart).
- hang: SIGSTOP rank 1 at step >= 10; seconds until the failure is declared (ours: the
  journal's failure event; torchrun: its agent restarting or exiting), capped at
  ``--hang-cap`` seconds (torchrun's only guard is gloo's 30-minute collective timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "torchrun_ddp.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _journal(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(pred, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def _rank_pid(run: Path, generation: int, rank: int) -> int | None:
    for e in _journal(run):
        if e["kind"] == "ranks_started" and e["generation"] == generation:
            for r in e["ranks"]:
                if r["rank"] == rank:
                    return r["pid"]
    return None


def _log_step(run: Path, rank: int, generation: int) -> int:
    path = run / "logs" / f"rank-{rank:05d}.log"
    if not path.exists():
        return 0
    text = path.read_text().split(f"==== generation {generation} ")[-1]
    steps = [int(line.split("step ")[1].split()[0]) for line in text.splitlines()
             if ": step " in line]
    return steps[-1] if steps else 0


def ours(work: Path, hang_cap: float) -> dict[str, float | None]:
    cfg = work / "job.yaml"
    cfg.write_text(json.dumps({
        "job": {"name": "parity", "entrypoint": [sys.executable, str(SCRIPT)],
                "env": {"STEPS": "100000", "STEP_S": "0.2",
                        "SNAPSHOT": "{node}"}},
        "cluster": {"nodes": 2, "procs_per_node": 1},
        "restart": {"max_restarts": 3},
        "metrics": {"port": 0, "host": "127.0.0.1"},
        "health": {"preflight": "quick"},
    }).replace('"{node}"', json.dumps(str(work / "snapshot.json"))))
    run = work / "run"
    up = subprocess.Popen([sys.executable, "-P", "-m", "orchestrator", "up", str(cfg),
                           "--run-dir", str(run)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
                          cwd=work)
    out: dict[str, float | None] = {}
    try:
        _wait(lambda: _log_step(run, 1, 1) >= 10, 300, "generation 1 at step 10")
        killed = time.time()
        os.kill(_rank_pid(run, 1, 1), signal.SIGKILL)
        first = _wait(lambda: next((e for e in _journal(run) if e["kind"] == "first_step"
                                    and e["generation"] == 2), None), 300, "gen 2 trains")
        out["recovery_s"] = round(first["step_ts"] - killed, 2)
        # Ten steps into generation 2 (past its 3 warm-up steps, which the start-up floor
        # judges): the script resumes from its snapshot, so count from where it resumed.
        resumed_at = _wait(lambda: _log_step(run, 1, 2), 300, "generation 2 steps")
        _wait(lambda: _log_step(run, 1, 2) >= resumed_at + 10, 300, "generation 2, 10 steps")
        stopped = time.time()
        os.kill(_rank_pid(run, 2, 1), signal.SIGSTOP)
        try:
            failure = _wait(lambda: next((e for e in _journal(run) if e["kind"] == "failure"
                                          and e["generation"] == 2), None), hang_cap, "hang")
            out["hang_detect_s"] = round(failure["ts"] - stopped, 2)
            out["hang_named_rank"] = failure.get("rank")
            # Found when the job turned STOPPING; the failure event follows the stack dumps
            # (up to timeouts.stack_dump_wait_s).
            found = next(e for e in _journal(run) if e["kind"] == "transition"
                         and e["to"] == "STOPPING" and e["ts"] > stopped)
            out["hang_found_s"] = round(found["ts"] - stopped, 2)
            out["hang_bound_s"] = round(3 * 0.2 + 2.0, 2)
        except TimeoutError:
            out["hang_detect_s"] = None
    finally:
        subprocess.run([sys.executable, "-P", "-m", "orchestrator", "down", str(run)],
                       env=_env(), capture_output=True, timeout=120)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        for e in _journal(run):
            for r in e.get("ranks", []) if e["kind"] == "ranks_started" else []:
                if r.get("pid"):
                    try:
                        os.killpg(r["pid"], signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
    return out


class _Lines:
    """torchrun's output, each line with the wall time it arrived."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._t.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def after(self, ts: float, text: str) -> tuple[float, str] | None:
        return next(((t, s) for t, s in self.lines if t > ts and text in s), None)


def _children_rank(parent: int, rank: int) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def torchrun(work: Path, hang_cap: float) -> dict[str, float | None]:
    snapshot = work / "snapshot-torchrun.json"
    env = {**_env(), "STEPS": "100000", "STEP_S": "0.2", "SNAPSHOT": str(snapshot)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "--max-restarts", "3", str(SCRIPT)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=work)
    lines = _Lines(proc)
    out: dict[str, float | None] = {}
    workers: list[int] = []  # torchrun starts each worker in a session of its own
    try:
        _wait(lambda: lines.after(0, "rank 1: step 10 "), 300, "torchrun at step 10")
        killed = time.time()
        os.kill(_children_rank(proc.pid, 1), signal.SIGKILL)
        resumed = _wait(lambda: lines.after(killed, "resuming at step"), 300, "restart")
        first = _wait(lambda: lines.after(resumed[0], ": step "), 300, "trains again")
        out["recovery_s"] = round(first[0] - killed, 2)
        _wait(lambda: lines.after(first[0] + 2.5, ": step "), 300, "steady again")
        stuck = _children_rank(proc.pid, 1)
        workers = [p for p in (_children_rank(proc.pid, 0), stuck) if p]
        stopped = time.time()
        os.kill(stuck, signal.SIGSTOP)
        try:
            found = _wait(lambda: lines.after(stopped, "resuming at step")
                          or proc.poll() is not None, hang_cap, "torchrun hang")
            out["hang_detect_s"] = round(time.time() - stopped, 2) if found else None
        except TimeoutError:
            out["hang_detect_s"] = None
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hang-cap", type=float, default=120.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "ours").mkdir()
        (work / "tr").mkdir()
        mine = ours(work / "ours", args.hang_cap)
        theirs = torchrun(work / "tr", args.hang_cap)
    report = {**header(), "script": str(SCRIPT.relative_to(ROOT)), "step_s": 0.2,
              "hang_cap_s": args.hang_cap, "orchestrator": mine, "torchrun": theirs,
              "note": "None: not detected within hang_cap_s. Orchestrator timeouts are the "
                      "defaults (3 x the step pace; floor 30 s, 1 s once 10 intervals are "
                      "measured). hang_found_s: SIGSTOP to STOPPING; hang_detect_s: to the "
                      "failure event, after the stack dumps."}
    print(json.dumps(report, indent=2))
    write("torchrun-parity-cpu.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
