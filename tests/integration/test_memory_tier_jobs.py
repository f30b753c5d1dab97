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
from collections.abc import Callable
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
def reference(clean_fast_run: Path) -> dict:
    """The final state of the FAST job run uninterrupted (shared by the session)."""
    return final_state_dict(clean_fast_run / "checkpoints" / "t" / FINAL)


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
    # Step 15's copy commits in the background: by the kill at 17 it has, or (under load)
    # step 10's, committed before step 15's save began, is the newest. Either is >= the
    # durable 10 (the durable save at 10 takes its tensors from that step's memory copy).
    assert restores[1]["step"] in (10, 15) and restores[1]["durable_step"] == 10
    resumed = [e for e in journal(run) if e["kind"] == "resumed"]
    assert [(e["step"], e["tier"]) for e in resumed] == [(restores[1]["step"], "memory")]
    usage = [e for e in journal(run) if e["kind"] == "memory_tier"]
    assert usage and all(0 < e["bytes"] <= e["node_budget_bytes"] <= 64 * 2**20
                         for e in usage)
    st = status(run)
    assert st["memory_tier"]["bytes"] == usage[-1]["bytes"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert assert_bit_identical(reference, final, PREFIXES) > 30
    # The agents freed their memory when the job ended.
    assert not any((tmp_path / "shm").iterdir())


def _steps(mem: Path, kind: str, rank: int) -> list[int]:
    """Steps of the committed copies in a node's slots (an unreadable manifest: -1, a
    save caught mid-rename)."""
    out = []
    for slot in ("a", "b"):
        path = mem / f"{kind}-r{rank}-{slot}.json"
        if path.exists():
            try:
                out.append(json.loads(path.read_text())["step"])
            except (OSError, ValueError, KeyError):
                out.append(-1)
    return sorted(out)


def _quiet_step(run: Path, shm: Path, partner: bool) -> int | None:
    """With every rank frozen: the step a restart will find in memory for every rank, or
    None while a save is in flight. Quiet means both ranks' two slots committed (a save
    uncommits a slot first) at the same newest step M, the partner copy of rank 1 at M
    too, and no durable step directory past M (a durable save that could still commit
    after the kill would make the memory copy older than the durable tier)."""
    mem0, mem1 = node_dir(shm, run, "local-0"), node_dir(shm, run, "local-1")
    own0, own1 = _steps(mem0, "own", 0), _steps(mem1, "own", 1)
    if len(own0) != 2 or len(own1) != 2 or -1 in own0 + own1 or own0[-1] != own1[-1]:
        return None
    newest = own1[-1]
    if partner:
        held = _steps(mem0, "partner", 1)
        if len(held) != 2 or held[-1] != newest:
            return None
    durable = [int(p.name[5:]) for p in (run / "checkpoints" / "t").glob("step-*")]
    if not durable or max(durable) > newest:
        return None
    return newest


def _freeze_quiet(run: Path, shm: Path, partner: bool) -> tuple[int, int, int]:
    """Freeze both ranks at a quiet moment (see ``_quiet_step``): (pid 0, pid 1, step).
    Frozen, thawed and frozen again until one comes: saves every 5 steps leave many."""
    pids = {e["node_id"]: e["ranks"][0]["pid"] for e in journal(run)
            if e["kind"] == "ranks_started"}

    def frozen_at_quiet() -> int | None:
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        step = _quiet_step(run, shm, partner)
        if step is None:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
        return step

    step = wait_for(frozen_at_quiet, 180, interval=0.05, what="a quiet moment")
    return pids["local-0"], pids["local-1"], step


def _damage(mem: Path, step: int, how: str) -> None:
    if how == "delete":
        for path in mem.iterdir():
            path.unlink()
        return
    manifest_path = next(p for p in mem.glob("own-r1-*.json")
                         if json.loads(p.read_text())["step"] == step)
    seg = json.loads(manifest_path.read_text())["segments"][0]
    with open(manifest_path.with_suffix(".bin"), "r+b") as f:
        f.seek(seg["offset"] + seg["nbytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def _run_and_break(cfg: Path, run: Path, act: Callable[[Path], Any]) -> Any:
    """Run the job of ``cfg``; once a first durable checkpoint is committed, call
    ``act(run)`` (freeze, damage, kill); wait for the job to end, which must be COMPLETED.
    Returns what ``act`` returned."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)
    try:
        wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in journal(run)), 180,
                 what="a first durable checkpoint")
        result = act(run)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_strays(run)
    assert proc.returncode == 0, out[-4000:]
    return result


def _interrupt(tmp: Path, dataset: Path, damage: str, partner: bool) -> tuple[Path, int]:
    """Run a job; after a first durable checkpoint, freeze it at a quiet moment, damage
    rank 1's memory (``flip``: one byte of its newest copy; ``delete``: the node's whole
    memory), SIGKILL rank 1 and let rank 0 go on. Returns the run and the step damaged."""
    cfg = memory_config(tmp, dataset, checkpoint={"memory_partner": partner})

    def act(run: Path) -> int:
        pid0, pid1, step = _freeze_quiet(run, tmp / "shm", partner)
        _damage(node_dir(tmp / "shm", run, "local-1"), step, damage)
        os.kill(pid1, signal.SIGKILL)
        os.kill(pid0, signal.SIGCONT)
        return step

    run = tmp / "run"
    return run, _run_and_break(cfg, run, act)


def test_corrupt_memory_copy_falls_back_to_durable(tmp_path: Path, dataset_dir: Path,
                                                   reference: dict) -> None:
    run, step = _interrupt(tmp_path, dataset_dir, "flip", partner=False)
    second = tiers(run)[1]
    assert second["tier"] == "durable", second
    # Its digest, computed ahead beside the start-up, is compared when it would load.
    assert f"rank 1: the step {step} memory copy does not load (uncommitted): " \
        "ValueError: digest mismatch" in second["reason"], second
    resumed = next(e for e in journal(run) if e["kind"] == "resumed")
    assert resumed["step"] == second["step"] == second["durable_step"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_corrupt_own_copy_restores_from_the_partner_copy(tmp_path: Path, dataset_dir: Path,
                                                         reference: dict) -> None:
    run, step = _interrupt(tmp_path, dataset_dir, "flip", partner=True)
    second = tiers(run)[1]
    assert second["tier"] == "memory_partner" and second["partner_ranks"] == [1], second
    assert second["step"] == step
    assert "rank 1's own copy: digest mismatch" in second["reason"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_memory_gone_falls_back_to_durable(tmp_path: Path, dataset_dir: Path,
                                           reference: dict) -> None:
    run, _ = _interrupt(tmp_path, dataset_dir, "delete", partner=False)
    second = tiers(run)[1]
    assert second["tier"] == "durable", second
    assert "no step held by every rank" in second["reason"]
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_partner_copy_restores_a_rank_whose_memory_is_gone(tmp_path: Path, dataset_dir: Path,
                                                           reference: dict) -> None:
    run, step = _interrupt(tmp_path, dataset_dir, "delete", partner=True)
    second = tiers(run)[1]
    assert second["tier"] == "memory_partner" and second["partner_ranks"] == [1], second
    assert second["step"] == step >= (second["durable_step"] or 0)
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)


def test_node_lost_restores_from_the_partner_copy(tmp_path: Path, dataset_dir: Path,
                                                  reference: dict) -> None:
    """The agent of node 1 dies with its rank: the node's memory dies with it (the new
    agent starts empty), and rank 1 restores from the copy node 0 holds."""
    cfg = memory_config(tmp_path, dataset_dir)

    def act(run: Path) -> int:
        agent = next(e for e in journal(run) if e["kind"] == "agent_spawned"
                     and e["node_id"] == "local-1")
        pid0, pid1, step = _freeze_quiet(run, tmp_path / "shm", partner=True)
        os.kill(agent["pid"], signal.SIGKILL)
        os.kill(pid1, signal.SIGKILL)
        os.kill(pid0, signal.SIGCONT)
        return step

    run = tmp_path / "run"
    step = _run_and_break(cfg, run, act)
    failure = next(e for e in journal(run) if e["kind"] == "failure")
    assert failure["cause"] == "node_lost" and failure["node_id"] == "local-1"
    second = tiers(run)[1]
    assert second["tier"] == "memory_partner" and second["partner_ranks"] == [1], second
    assert second["step"] == step
    final = final_state_dict(run / "checkpoints" / "t" / FINAL)
    assert_bit_identical(reference, final, PREFIXES)
