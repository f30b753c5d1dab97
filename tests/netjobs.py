"""Jobs on the multi-host bed (``netbed``): configs, supervisors and agents in their own hosts,
what the journal says about a fault, and the results table's rows.

Each fault test measures what the docs' results table reports (``docs/reliability.md``):
when the fault was injected, how long until the supervisor noticed it, how long until
training stepped again, what was lost, and whether the end state is bit-identical to an
uninterrupted run. ``record_result`` appends the row to the JSON file named by
``NETFAULT_RESULTS`` (``bench/recovery/netfault_table.py`` turns it into the table) and prints it.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from jobs import env, journal, wait_for, write_config
from netbed import Bed

RESULTS_ENV = "NETFAULT_RESULTS"
API_PORT = 9410
# Fast enough for tests, as tests/jobs.py's FAST: the lease a little above node_lost_s, so a
# cut node's ranks stop themselves soon after the supervisor has replaced them.
BED_TIMEOUTS = {"heartbeat_interval_s": 0.25, "node_lost_s": 5, "agent_lease_s": 8,
                "stop_grace_s": 3, "register_s": 90, "launch_s": 90}
# The trainer of every bed job and of its reference run (same steps, same checkpoints).
BED_TRAINER = {"steps": 60}
# Every rank's gloo traffic on the bed's interface (the hostname resolves elsewhere).
BED_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}
SSH_OPTIONS = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR",
               "ConnectTimeout=5"]


def ssh_config(path: Path, dataset: Path, bed: Bed, sup: str, nodes: list[str],
               identity: Path, **sections: Any) -> Path:
    """A job whose supervisor runs on host ``sup`` and reaches ``nodes`` over SSH."""
    base: dict[str, Any] = {
        "job": {"env": dict(BED_ENV)},
        "trainer": dict(BED_TRAINER),
        "timeouts": dict(BED_TIMEOUTS),
        "launcher": {"kind": "ssh", "advertise_host": bed[sup].addr, "python": sys.executable,
                     "ssh": {"hosts": [f"root@{bed[n].addr}" for n in nodes],
                             "identity_file": str(identity), "options": SSH_OPTIONS}},
        "metrics": {"host": bed[sup].addr, "port": API_PORT},
    }
    return write_config(path, dataset, **_merge(base, sections))


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


def python_env(**extra: str) -> dict[str, str]:
    return {**env(), **extra}


def start_up(bed: Bed, host: str, cfg: Path, run: Path, *args: str,
             extra_env: dict[str, str] | None = None) -> Any:
    """``orchestrator up`` on ``host`` (its output in ``<run>.<host>.log``)."""
    return bed.popen(host, [sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                            str(run), *args], log=run.parent / f"{run.name}.{host}.log",
                     env=python_env(**(extra_env or {})))


def start_agent(bed: Bed, host: str, heads: list[str], run: Path, secret: str,
                extra_env: dict[str, str] | None = None) -> Any:
    """An agent started by the test (``launcher.kind: kubernetes``), given the job secret."""
    return bed.popen(host, [sys.executable, "-m", "orchestrator", "agent", "--head",
                            ",".join(heads), "--node-id", host, "--addr", bed[host].addr,
                            "--procs", "1", "--run-dir", str(run), "--orphan-timeout", "120"],
                     log=run.parent / f"{run.name}.agent-{host}.log",
                     env=python_env(ORCH_TOKEN=secret, **(extra_env or {})))


def finish(proc: Any, timeout: float, log: Path) -> int:
    import subprocess

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        raise AssertionError(f"the supervisor did not finish in {timeout} s:\n{tail}") \
            from None


# -- what the run says -----------------------------------------------------------------------
def steps(run: Path) -> list[dict[str, Any]]:
    path = run / "steps.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def last_step(run: Path) -> int:
    s = steps(run)
    return s[-1]["step"] if s else 0


def wait_step(run: Path, step: int, timeout: float = 180) -> None:
    wait_for(lambda: last_step(run) >= step, timeout, what=f"training to reach step {step}")


def events(run: Path, kind: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in journal(run) if e["kind"] == kind
            and all(e.get(k) == v for k, v in match.items())]


def node_ranks(run: Path, generation: int = 1) -> dict[str, int]:
    launch = events(run, "generation_launched", generation=generation)
    return launch[0]["nodes"] if launch else {}


def measure(run: Path, injected: float, lost_node: str | None = None,
            generation: int = 1) -> dict[str, Any]:
    """From the journal and rank 0's step records: detection, recovery, redone steps (of
    the first failure at or after ``injected``, in ``generation``)."""
    failure = next((e for e in events(run, "failure") if e["ts"] >= injected
                    and e.get("generation") == generation), None)
    lost = next((e for e in events(run, "node_state", node_id=lost_node, state="lost")
                 if e["ts"] >= injected), None) if lost_node else None
    detected = lost or failure
    nxt = next((e for e in events(run, "first_step") if e["generation"] > generation), None)
    # The progress lost: what rank 0 had reported when the generation failed.
    until = failure["ts"] if failure else injected
    before = [s for s in steps(run) if s.get("ts", 0) <= until]
    at_fault = before[-1]["step"] if before else 0
    resumed = nxt["step"] - 1 if nxt else None
    return {
        "detected_s": None if detected is None else round(detected["ts"] - injected, 2),
        "recovered_s": None if nxt is None else round((nxt.get("step_ts") or nxt["ts"])
                                                      - injected, 2),
        "step_at_fault": at_fault, "resumed_from": resumed,
        "steps_redone": None if resumed is None else max(0, at_fault - resumed),
        "cause": failure["cause"] if failure else None,
    }


def redone(run: Path, since: float, until: float) -> tuple[int, int]:
    """(failures, steps redone in all) for the failures journaled in [since, until]: each
    failure's last reported step minus the step its next generation resumed from."""
    total, count = 0, 0
    for f in events(run, "failure"):
        if since <= f["ts"] <= until:
            count += 1
            total += measure(run, since, generation=f["generation"])["steps_redone"] or 0
    return count, total


def record_result(row: dict[str, Any]) -> None:
    """Append one results-table row to ``$NETFAULT_RESULTS`` (a JSON list; kept per fault:
    the newest row replaces the fault's earlier one) and print it."""
    row = {**row, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print("netfault result:", json.dumps(row))
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = json.loads(p.read_text()) if p.exists() and p.read_text().strip() else []
        rows = [r for r in rows if r.get("fault") != row["fault"]] + [row]
        p.write_text(json.dumps(rows, indent=1) + "\n")


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        out.append(pid)
    return out


def rank_pids(run: Path, node_id: str, generation: int) -> list[int]:
    return [r["pid"] for e in events(run, "ranks_started", node_id=node_id,
                                     generation=generation) for r in e["ranks"] if r["pid"]]
