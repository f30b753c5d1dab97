"""Running real jobs from tests: `orchestrator up` as a subprocess, and reading results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

# Small and fast: a tiny model, short sequences, a checkpoint every 10 steps.
FAST = {
    # No pre-imported spare interpreters (the product's default): each would import torch
    # once more per rank and job, seconds of the 2-core machine in every test. The tests of
    # warm restarts and standbys turn them on.
    "job": {"name": "t", "warm_start": False},
    "cluster": {"nodes": 2, "procs_per_node": 1},
    "trainer": {
        "steps": 40, "device": "cpu", "num_threads": 1, "log_every": 10, "param_norm_every": 5,
        "model": {"preset": "tiny"},
        "data": {"seq_len": 64, "micro_batch_size": 4, "prepare_from": None},
        "schedule": {"warmup_steps": 5},
        "optimizer": {"lr": 3.0e-3},
        "parallelism": {"strategy": "fsdp2", "backend": "gloo"},
    },
    "checkpoint": {"interval_steps": 10, "keep_last": 3},
    # The calibrated floor stays off (as in configs/local.yaml): the shared 2-core CI host
    # stalls a rank for a second now and then, and most jobs here test something else.
    "timeouts": {"heartbeat_interval_s": 0.25, "node_lost_s": 5, "stop_grace_s": 3,
                 "register_s": 60, "launch_s": 60, "training_floor_calibrated_s": None},
    # The full restart: the fault tests of that path keep it; tests/integration/
    # test_in_job.py turns in-job recovery (the product's default) on.
    "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "in_job": False},
    "metrics": {"port": 0, "host": "127.0.0.1"},
    # As configs/local.yaml: the tiny model's natural grad-norm swings are not spikes.
    "stability": {"grad_spike": {"mode": "relative", "rel_margin": 1.0}},
    # Quick checks before launch: the full level's network test (torch ranks) would add
    # seconds to every job; tests/integration/test_health.py runs it.
    "health": {"preflight": "quick"},
}


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


def write_config(path: Path, dataset: Path, **sections: Any) -> Path:
    cfg = deep_merge(FAST, {"trainer": {"data": {"path": str(dataset)}}})
    cfg = deep_merge(cfg, sections)
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    e["PYTHONUNBUFFERED"] = "1"
    return e


def up(config: Path, run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `orchestrator up` to the end; on timeout, kill it and everything it started."""
    cmd = [sys.executable, "-m", "orchestrator", "up", str(config), "--run-dir", str(run_dir),
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), start_new_session=True)
    out = finish(proc, run_dir, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float) -> str:
    """Wait for a started `orchestrator up` and return its output; on timeout, kill it and
    everything it started, and fail with the output's tail. Strays are killed either way."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_run(run_dir, proc)
        out, _ = proc.communicate()
        raise AssertionError(f"orchestrator up timed out after {timeout} s:\n{out[-5000:]}")
    finally:
        kill_strays(run_dir)
    return out


def kill_run(run_dir: Path, proc: subprocess.Popen | None = None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    kill_strays(run_dir)


def kill_strays(run_dir: Path) -> None:
    """Agents run in their own sessions: kill any this run left behind (and their ranks)."""
    for event in journal(run_dir):
        if event["kind"] in ("agent_spawned",):
            pids = [event["pid"]]
        elif event["kind"] == "ranks_started":
            pids = [r["pid"] for r in event["ranks"]]
        else:
            continue
        for pid in filter(None, pids):  # None: a rank whose spawn failed
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def journal(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except (ValueError, RecursionError):  # torn, or damaged on purpose by a test
            pass
    return out


def states(run_dir: Path) -> list[str]:
    seq = ["PENDING"]
    seq += [e["to"] for e in journal(run_dir) if e["kind"] == "transition"]
    return seq


def status(run_dir: Path) -> dict[str, Any]:
    """``orchestrator status RUN_DIR --json``, run in this process (typer's runner): the
    same command without an interpreter's start-up, which tests call after most jobs. The
    command's own process is tested in tests/integration/test_console_*.py."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    result = CliRunner().invoke(app, ["status", str(run_dir), "--json"])
    assert result.exit_code == 0, f"status exited {result.exit_code}: {result.output[-2000:]}"
    return json.loads(result.stdout)


def final_state_dict(step_dir: Path) -> dict[str, Any]:
    """A DCP checkpoint loaded into one flat {key: tensor or value} dict (no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # Converted beside nothing it reads: the run may be shared by tests of other workers.
    with tempfile.TemporaryDirectory(prefix="dcp-") as tmp:
        out = Path(tmp) / (step_dir.name + ".pt")
        dcp_to_torch_save(str(step_dir), str(out))
        state = torch.load(out, weights_only=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix.rstrip(".")] = value

    walk("", state)
    return flat


def assert_bit_identical(a: dict[str, Any], b: dict[str, Any], prefixes: tuple[str, ...]) -> int:
    """Every entry under ``prefixes`` equal, tensors bit for bit; returns how many compared."""
    import torch

    keys = sorted(k for k in a if k.startswith(prefixes))
    assert keys, f"nothing under {prefixes}"
    assert keys == sorted(k for k in b if k.startswith(prefixes))
    for k in keys:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point and x.dim()
                               else x, y.view(torch.uint8) if y.dtype.is_floating_point and
                               y.dim() else y), f"{k} differs"
        else:
            assert x == y, f"{k}: {x!r} != {y!r}"
    return len(keys)


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def deepspeed_state_dict(step_dir: Path) -> dict[str, Any]:
    """Every file of a DeepSpeed checkpoint (``*.pt``), loaded with torch.load and flattened
    to ``{file/key.path: value}`` (lists indexed), so two checkpoints compare entry by entry."""
    import torch

    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}{i}.", v)
        else:
            flat[prefix.rstrip(".")] = value

    for path in sorted(Path(step_dir).glob("*.pt")):
        walk(path.name + "/", torch.load(path, map_location="cpu", weights_only=False))
    return flat


def api_call(url: str, token: str | None, body: bytes | None = None,
             method: str = "POST") -> tuple[int, dict]:
    """One request to the supervisor's API: (status, JSON body), an HTTP error's too."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of the supervisor's ``/metrics`` at ``base`` (its name and labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=15) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")
