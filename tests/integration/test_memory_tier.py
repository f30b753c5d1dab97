"""The memory tier under real `orchestrator up` jobs: 2 simulated nodes x 1 gloo rank.

Memory copies every 5 steps, durable checkpoints every 10: the newest memory copy is never
older than the newest durable checkpoint (the memory copy of a step commits on the training
thread, the durable one later in the background), so a restart takes the memory tier unless
its copy is corrupt or gone. The slot files live under the test's tmp directory (the agent
makes them wherever ``checkpoint.memory_root`` says; /dev/shm in production).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import (
    assert_bit_identical,
    env,
    final_state_dict,
    journal,
    kill_strays,
    status,
    up,
    wait_for,
    write_config,
)

from orchestrator.agent.memory import node_dir

pytestmark = pytest.mark.slow

STEPS = 40
FINAL = f"step-{STEPS:08d}"
PREFIXES = ("app.model.", "app.optim.", "progress.", "data.", "schedule.")


def memory_config(tmp: Path, dataset: Path, **extra: Any) -> Path:
    ck = {"interval_steps": 10, "keep_last": 3, "memory_interval_steps": 5,
          "memory_root": str(tmp / "shm"), "memory_max_bytes": 64 * 2**20}
    ck.update(extra.pop("checkpoint", {}))
    return write_config(tmp / "job.yaml", dataset, checkpoint=ck, **extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> dict:
    """The final state of an uninterrupted run with the memory tier off."""
    tmp = tmp_path_factory.mktemp("clean")
    result = up(write_config(tmp / "job.yaml", dataset_dir), tmp / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    return final_state_dict(tmp / "run" / "checkpoints" / "t" / FINAL)


def tiers(run: Path) -> list[dict[str, Any]]:
    return [e for e in journal(run) if e["kind"] == "restore_tier"]


def test_kill_restores_from_memory_bit_exactly(tmp_path: Path, dataset_dir: Path,
                                               reference: dict) -> None:
    cfg = memory_config(tmp_path, dataset_dir, chaos={"kill": [{"step": 17, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    restores = tiers(run)
    assert [(e["generation"], e["tier"]) for e in restores] == [(1, "none"), (2, "memory")]
    assert restores[1]["step"] == 15 and restores[1]["durable_step"] == 10
    resumed = [e for e in journal(run) if e["kind"] == "resumed"]
    assert [(e["step"], e["tier"]) for e in resumed] == [(15, "memory")]
    usage = [e for e in journal(run) if e["kind"] == "memory_tier"]
    assert usage and all(0 < e["bytes"] <= e["node_budget_bytes"] <= 64 * 2**20
                         for e in usage)
    st = status(run)
    assert st["memory_tier"]["bytes"] == usage[-1]["bytes"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert assert_bit_identical(reference, final, PREFIXES) > 30
    # The agents freed their memory when the job ended.
    assert not any((tmp_path / "shm").iterdir())


def _newest_copy(mem: Path, rank: int) -> tuple[Path, dict[str, Any]]:
    found = []
    for slot in ("a", "b"):
        path = mem / f"own-r{rank}-{slot}.json"
        if path.exists():
            found.append((path, json.loads(path.read_text())))
    assert found, f"no committed memory copy of rank {rank} in {mem}"
    return max(found, key=lambda f: f[1]["step"])


def _interrupt(tmp: Path, dataset: Path, damage: str, partner: bool) -> Path:
    """Run a job; once a durable checkpoint committed, freeze rank 1, damage its newest
    memory copy (``flip``: one byte of its data; ``delete``: the node's whole memory) and
    SIGKILL it. Frozen first, so the copy damaged is the one the restart finds."""
    cfg = memory_config(tmp, dataset, checkpoint={"memory_partner": partner},
                        trainer={"steps": STEPS})
    run = tmp / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)
    try:
        wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in journal(run)), 180,
                 what="a first durable checkpoint")
        pid = next(e for e in journal(run) if e["kind"] == "ranks_started"
                   and e["node_id"] == "local-1")["ranks"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        mem = node_dir(tmp / "shm", run, "local-1")
        manifest_path, manifest = _newest_copy(mem, 1)
        if damage == "flip":
            data = manifest_path.with_suffix(".bin")
            seg = manifest["segments"][0]
            with open(data, "r+b") as f:
                f.seek(seg["offset"] + seg["nbytes"] // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x40]))
        else:
            for path in mem.iterdir():
                path.unlink()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_strays(run)
    assert proc.returncode == 0, out[-4000:]
    return run


def test_corrupt_memory_copy_falls_back_to_durable(tmp_path: Path, dataset_dir: Path,
                                                   reference: dict) -> None:
    run = _interrupt(tmp_path, dataset_dir, "flip", partner=False)
    second = tiers(run)[1]
    assert second["tier"] == "durable", second
    assert "digest mismatch" in second["reason"] and "rank 1" in second["reason"]
    resumed = next(e for e in journal(run) if e["kind"] == "resumed")
    assert resumed["step"] == second["step"] == second["durable_step"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_memory_gone_falls_back_to_durable(tmp_path: Path, dataset_dir: Path,
                                           reference: dict) -> None:
    run = _interrupt(tmp_path, dataset_dir, "delete", partner=False)
    second = tiers(run)[1]
    assert second["tier"] == "durable", second
    assert "no step held by every rank" in second["reason"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_partner_copy_restores_a_rank_whose_memory_is_gone(tmp_path: Path, dataset_dir: Path,
                                                           reference: dict) -> None:
    run = _interrupt(tmp_path, dataset_dir, "delete", partner=True)
    second = tiers(run)[1]
    assert second["tier"] == "memory_partner" and second["partner_ranks"] == [1], second
    assert second["step"] >= (second["durable_step"] or 0)
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_node_lost_restores_from_the_partner_copy(tmp_path: Path, dataset_dir: Path,
                                                  reference: dict) -> None:
    """The agent of node 1 dies with its rank: the node's memory dies with it (the new
    agent starts empty), and rank 1 restores from the copy node 0 holds."""
    cfg = memory_config(tmp_path, dataset_dir)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)
    try:
        wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in journal(run)), 180,
                 what="a first durable checkpoint")
        agent = next(e for e in journal(run) if e["kind"] == "agent_spawned"
                     and e["node_id"] == "local-1")
        rank = next(e for e in journal(run) if e["kind"] == "ranks_started"
                    and e["node_id"] == "local-1")["ranks"][0]["pid"]
        os.kill(rank, signal.SIGSTOP)  # frozen: its memory copies stop changing
        os.kill(agent["pid"], signal.SIGKILL)
        os.kill(rank, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_strays(run)
    assert proc.returncode == 0, out[-4000:]
    failure = next(e for e in journal(run) if e["kind"] == "failure")
    assert failure["cause"] == "node_lost" and failure["node_id"] == "local-1"
    second = tiers(run)[1]
    assert second["tier"] == "memory_partner" and second["partner_ranks"] == [1], second
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)
