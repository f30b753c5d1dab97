"""Time to recover under ``orchestrator up``, a fault-free run's clean end, and save stalls.

Two jobs of the same config. The *fault-free* job must end COMPLETED with no failure in its
journal (a slow final commit must not be judged a hang). The
*faults* job takes two injections: rank 0 SIGKILLs itself after step ``--kill-step``, then
(in the next generation) SIGSTOPs itself after step ``--stop-step``. Each recovery is broken
down from the journal and the new generation's ``startup`` event (the rank's own wall-clock
milestones):

    detection   kill -> STOPPING             (agent waitpid -> supervisor; hang timeout)
    teardown    STOPPING -> RECOVERING       (stop every rank, confirm)
    backoff     RECOVERING -> HEALTH_CHECK   (none before the first restart in a window)
    placement   HEALTH_CHECK -> LAUNCHING    (the after-failure health check, placement)
    launch      generation_launched -> new process started
    interpreter process start -> main() (Python start-up + worker SDK import)
    imports     main() -> torch and trainer imported
    dist_init   process group up (rendezvous)
    build_load  model, optimizer, data built; checkpoint restored (load_s of it)
    first_step  restored -> first step done (compile, allocator warm-up)

Hang detection latency is SIGSTOP -> STOPPING (cause hang), judged against 3 x the median
step + 2 s. Save stalls are every ``checkpoint_committed`` event's blocking time, a
generation's first save apart from the later ones. ``targets`` says which of the recovery
targets held.

    python bench/recovery/recovery.py [CONFIG] [--set key=value ...] --out recovery-cpu.json
    python bench/recovery/recovery.py --profile h200x2 --out recovery-h200x2.json   # 2 GPUs, NCCL

A profile is a config and overrides (``--set`` adds to them, later ones win); the JSON
records every override, so a flag such as the memory tier's is one more override.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header, write  # noqa: E402
from bench.recovery.runfiles import (
    TARGET_SAVE_BLOCK_S,
    calibrations,
    median_step,
    save_stalls,
    settle,
    step_blocking,
)
from bench.recovery.samplers import DeathWatch, StandbySampler

# The recovery target: SIGKILL -> next step.
TARGET_KILL_S = 3.0

SDK_SCRIPT = Path(__file__).resolve().parent / "sdk_script.py"

# Profiles: a config, its overrides, the injection steps. ``cpu`` is the embedded default
# (2 simulated nodes x 1 rank, gloo); ``h200x2`` is 1 node x 2 GPUs over NCCL with the 1.14B
# model compiled at micro-batch 8 (~0.2 s steps), sized so both jobs end within 8 minutes
# (compile included): saves every 150 steps (13.6 GB a save: ~30 s of steps for it to be
# written and committed before the next, so no save's blocking time includes waiting for
# the one before; the final save at 560 comes 110 steps after the one at 450), the kill after
# the first save has committed, the hang mid-interval; the fault-free run's only save is its
# final one (a generation's first).
# What the GPU profiles of both recovery paths share: the 1.14B model compiled at
# micro-batch 8, durable saves every 150 steps, the memory tier every 20, fast hang
# detection once calibrated, warm standbys.
GPU_1B_SETS = [
    "trainer.data.micro_batch_size=8", "trainer.parallelism.compile=true",
    "checkpoint.interval_steps=150", "checkpoint.keep_last=2",
    "checkpoint.memory_interval_steps=20", "checkpoint.memory_max_bytes=68719476736",
    "timeouts.training_floor_s=10", "timeouts.training_floor_calibrated_s=1",
    "timeouts.training_multiplier=3", "job.warm_start=true", "health.preflight=quick",
    "restart.backoff_initial_s=0.5"]

PROFILES: dict[str, dict[str, Any]] = {
    "cpu": {"config": None, "kill_step": 60, "stop_step": 120, "free_steps": 60, "sets": [
        "trainer.steps=200", "timeouts.training_floor_s=2",
        "timeouts.training_floor_calibrated_s=1", "timeouts.training_multiplier=3",
        "job.warm_start=false"]},
    # For an A/B against an older checkout whose config lacks the calibrated-floor keys.
    "cpu-old": {"config": None, "kill_step": 60, "stop_step": 120, "free_steps": 60, "sets": [
        "trainer.steps=200", "timeouts.training_floor_s=2", "restart.backoff_initial_s=0.5",
        "job.warm_start=false"]},
    # Both recovery paths on 1 node x 2 GPUs over NCCL, the 1.14B model compiled at
    # micro-batch 8 with the memory tier every 20 steps (6.8 GB a rank; durable saves every
    # 150, ~30 s to write 13.6 GB here, so one is in flight at some kills): three SIGKILLs (rank
    # 1, rank 0 (the store's host), rank 1 again) and one SIGSTOP per run, the in-job run and
    # the full-restart run in the same call (``--paths``).
    "gpu2": {"config": "configs/gpu-1b-h100.yaml", "kill_step": 0, "stop_step": 0,
             "free_steps": 0, "injections": [(130, 1, "SIGKILL"), (200, 0, "SIGKILL"),
                                            (270, 1, "SIGKILL"), (340, 0, "SIGSTOP")],
             "sets": ["cluster.procs_per_node=2", "trainer.steps=400", *GPU_1B_SETS]},
    # Both paths for a one-rank job on 1 GPU: the 1.14B model compiled at micro-batch 8, the
    # memory tier every 20 steps (13.7 GB: the whole state on one rank), a durable save at
    # 150; three SIGKILLs and one SIGSTOP of its only rank per run. In place, the standby
    # takes over and restores the agent's memory copy: the replacement's critical path
    # without NCCL.
    "gpu1": {"config": "configs/gpu-1b-h100.yaml", "kill_step": 0, "stop_step": 0,
             "free_steps": 0, "injections": [(100, 0, "SIGKILL"), (160, 0, "SIGKILL"),
                                            (220, 0, "SIGKILL"), (265, 0, "SIGSTOP")],
             "sets": ["trainer.steps=300", *GPU_1B_SETS]},
    # Both paths on this CPU (the embedded default's 2 simulated nodes, gloo).
    "cpu-paths": {"config": None, "kill_step": 0, "stop_step": 0, "free_steps": 0,
                  "injections": [(60, 1, "SIGKILL"), (100, 0, "SIGKILL"), (140, 1, "SIGKILL"),
                                 (180, 0, "SIGSTOP")],
                  "sets": ["trainer.steps=220", "checkpoint.memory_interval_steps=10",
                           "timeouts.training_floor_s=2",
                           "timeouts.training_floor_calibrated_s=1",
                           "timeouts.training_multiplier=3", "restart.backoff_initial_s=0.5"]},
    # A user's own DDP script with ow.recoverable (bench/recovery/sdk_script.py), both paths:
    # 1 node x 2 GPUs over NCCL, 8 layers of 4096 (134M parameters, 1.6 GB of state a rank),
    # the memory tier every 10 steps; three SIGKILLs and one SIGSTOP per run.
    "sdk-gpu2": {"config": "configs/gpu-1b-h100.yaml", "kill_step": 0, "stop_step": 0,
                 "free_steps": 0, "injections": [(150, 1, "SIGKILL"), (300, 0, "SIGKILL"),
                                                (450, 1, "SIGKILL"), (600, 0, "SIGSTOP")],
                 "sets": [
                     "cluster.procs_per_node=2", "trainer.steps=700",
                     f"job.entrypoint=[python, {SDK_SCRIPT}]",
                     "job.env={STEPS: '700', HIDDEN: '4096', LAYERS: '8', BATCH: '256'}",
                     "checkpoint.memory_interval_steps=10",
                     "checkpoint.memory_max_bytes=34359738368",
                     "timeouts.training_floor_s=10", "timeouts.training_floor_calibrated_s=1",
                     "timeouts.training_multiplier=3", "health.preflight=quick",
                     "restart.backoff_initial_s=0.5"]},
    # The same on this CPU (2 simulated nodes x 1 rank, gloo), a small model.
    "sdk-cpu": {"config": None, "kill_step": 0, "stop_step": 0, "free_steps": 0,
                "injections": [(60, 1, "SIGKILL"), (120, 0, "SIGSTOP")],
                "sets": [
                    "trainer.steps=160", f"job.entrypoint=[python, {SDK_SCRIPT}]",
                    "job.env={STEPS: '160', HIDDEN: '256', LAYERS: '2', BATCH: '32'}",
                    "checkpoint.memory_interval_steps=10",
                    "timeouts.training_floor_s=2", "timeouts.training_floor_calibrated_s=1",
                    "timeouts.training_multiplier=3", "restart.backoff_initial_s=0.5"]},
    # A smoke run of the in-job path on 2 GPUs: a small model, no compile, one kill.
    "gpu2-smoke": {"config": "configs/gpu-1b-h100.yaml", "kill_step": 0, "stop_step": 0,
                   "free_steps": 0, "injections": [(30, 1, "SIGKILL"), (50, 0, "SIGKILL")],
                   "sets": [
                       "cluster.procs_per_node=2", "trainer.steps=70",
                       "trainer.model.preset=tiny", "trainer.data.seq_len=256",
                       "trainer.data.micro_batch_size=8", "trainer.parallelism.compile=false",
                       "checkpoint.interval_steps=20", "checkpoint.memory_interval_steps=5",
                       "job.warm_start=true", "health.preflight=quick"]},
    "h200x2": {"config": "configs/gpu-1b-h100.yaml", "kill_step": 250, "stop_step": 400,
               "free_steps": 100, "sets": [
                   "cluster.procs_per_node=2", "trainer.steps=560",
                   "trainer.data.micro_batch_size=8", "trainer.parallelism.compile=true",
                   "checkpoint.interval_steps=150", "checkpoint.keep_last=2",
                   "timeouts.training_floor_s=10", "timeouts.training_floor_calibrated_s=1",
                   "timeouts.training_multiplier=3", "job.warm_start=true",
                   "health.preflight=quick"]},
}


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
            if line.strip()]


def _first(events: list[dict], after: float, **match: Any) -> dict[str, Any]:
    for e in events:
        if e["ts"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    raise LookupError(f"no event {match} after {after}")


def breakdown(events: list[dict[str, Any]], chaos: dict[str, Any]) -> dict[str, Any]:
    kill = chaos["ts"]
    stopping = _first(events, kill, kind="transition", to="STOPPING")
    out: dict[str, Any] = {"signal": chaos["signal"], "at_step": chaos["step"],
                           "detected_as": stopping["cause"],
                           "detection_s": stopping["ts"] - kill}
    recovering = _first(events, stopping["ts"], kind="transition", to="RECOVERING")
    health = _first(events, recovering["ts"], kind="transition", to="HEALTH_CHECK")
    launching = _first(events, health["ts"], kind="transition", to="LAUNCHING")
    launched = _first(events, launching["ts"], kind="generation_launched")
    out.update({"teardown_s": recovering["ts"] - stopping["ts"],
                "backoff_s": health["ts"] - recovering["ts"],
                "placement_s": launching["ts"] - health["ts"]})
    try:
        startup = _first(events, launched["ts"], kind="startup")
    except LookupError:  # a script of the user's: no start-up marks, its first step only
        first = _first(events, launched["ts"], kind="first_step",
                       generation=launched["generation"])
        out["total_s"] = (first.get("step_ts") or first["ts"]) - kill
        return _rounded(out)
    resumed = next((e for e in events if e["kind"] == "resumed"
                    and e.get("generation") == launched["generation"]), {})
    out.update({
        "launch_s": startup["process_start"] - launched["ts"],
        "interpreter_s": startup["main"] - startup["process_start"],
        "imports_s": startup["imports_done"] - startup["main"],
        "dist_init_s": startup["dist_ready"] - startup["imports_done"],
        "build_load_s": startup["built"] - startup["dist_ready"],
        "of_which_load_s": resumed.get("load_s"),
        "first_step_s": startup["first_step_done"] - startup["built"],
        "total_s": startup["first_step_done"] - kill,
        "resumed_from_step": resumed.get("step"),
    })
    # Where build + restore went (the trainer's marks, in order), and when the agent saw
    # the rank exit (its channel closing: the kernel's teardown of the process comes later).
    marks = ["imports_done", "device_ready", "store_ready", "default_group_ready", "dist_ready", "built_loader", "built_checkpointer", "chose_checkpoint",
             "built_model", "built_optimizer", "loaded_state", "built"]
    seen = [m for m in marks if isinstance(startup.get(m), int | float)]
    out["build_parts_s"] = {b: round(startup[b] - startup[a], 3) for a, b in itertools.pairwise(seen)}
    # The first step's compile, by the compiler's own timed phases (nested: each includes
    # the ones it calls), where the rank compiled.
    out["first_step_compile_s"] = {k.removeprefix("compile_phase_"): v for k, v in startup.items()
                                   if k.startswith("compile_phase_") and isinstance(v, int | float)}
    exits = [x for e in events if e["ts"] >= kill and e["kind"] in ("rank_exited", "ranks_exited")
             for x in (e.get("exits") or [e]) if isinstance(x.get("exit_ts"), int | float)]
    if exits:
        out["agent_saw_exit_s"] = min(x["exit_ts"] for x in exits) - kill
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def in_job_breakdown(events: list[dict[str, Any]], chaos: dict[str, Any]) -> dict[str, Any]:
    """One in-job recovery, from the kill (or stop) to the next step done:

        detection   kill -> STOPPING (agent's exit report, or the hang timeout)
        decision    STOPPING -> the next generation launched in place
        takeover    launched -> the replacement's process handed its rank (its standby)
        survivors   their wait for the order, abort, new groups, restore (``recovered``)
        replacement its imports, process group, build + restore, first step (``startup``)
        total       kill -> the next step done (rank 0's first step of the new generation)
    """
    kill = chaos["ts"]
    stopping = _first(events, kill, kind="transition", to="STOPPING")
    failure = _first(events, kill, kind="failure")
    launched = _first(events, stopping["ts"], kind="generation_launched")
    gen = launched["generation"]
    first = next((e for e in events if e["kind"] == "first_step" and e["generation"] == gen),
                 None)
    out: dict[str, Any] = {
        "signal": chaos["signal"], "rank": chaos.get("rank"), "at_step": chaos["step"],
        "detected_as": stopping["cause"], "path": failure.get("recovery_path"),
        "path_reason": failure.get("recovery_reason"), "detection_s": stopping["ts"] - kill,
        "decision_s": launched["ts"] - stopping["ts"],
        "total_s": first["step_ts"] - kill if first and first.get("step_ts") else None}
    survivors = [e for e in events if e["kind"] == "recovered" and e.get("generation") == gen]
    if survivors:
        slowest = max(survivors, key=lambda e: e["total_s"])
        out["survivors"] = {k: slowest[k] for k in ("rank", "wait_s", "abort_s", "group_s",
                                                   "restore_s", "total_s", "tier", "step")}
        out["survivors"]["rejoined_s"] = slowest["ts"] - kill
        out["survivors"].update({k: slowest[k] for k in ("order_lag_s", "group_aborts") if k in slowest})
        # Each finer part's end on the kill's time line (seconds after the kill).
        out["survivors"]["timeline"] = _timeline(
            {k.removeprefix("at_"): v for k, v in slowest.items() if k.startswith("at_")}, kill)
    tier = next((e for e in events if e["kind"] == "restore_tier" and e.get("generation") == gen),
                None)
    if tier is not None:
        out["restore_tier"] = {k: tier[k] for k in ("tier", "load_s", "verify_s") if k in tier}
    starts = [e for e in events if e["kind"] == "startup" and e.get("generation") == gen]
    # The failed rank's replacement, not another rank's startup (a survivor started afresh).
    failed = _failed_rank(failure)
    st = next((e for e in starts if failed is None or e.get("rank") == failed), None)
    if st is None and starts:  # which ranks started, when none is the failed one
        out["replacement_unmatched"] = {"failed": failed, "started": [e.get("rank") for e in starts]}
    if st is not None:
        out["replacement"] = {
            "rank": st.get("rank"), "standby": st.get("warm"),
            "takeover_s": st["process_start"] - launched["ts"],
            "imports_s": st["imports_done"] - st["main"],
            "dist_init_s": st["dist_ready"] - st["imports_done"],
            "build_load_s": st["built"] - st["dist_ready"],
            "first_step_s": st["first_step_done"] - st["built"],
            "first_step_compile_s": {k.removeprefix("compile_phase_"): v for k, v in st.items()
                                     if k.startswith("compile_phase_")
                                     and isinstance(v, int | float)},
            # What its standby did ahead (prepare_s, compile_ahead_s / _graphs / _peak_mib).
            "standby_ahead": {k.removeprefix("standby_"): v for k, v in st.items()
                              if k.startswith("standby_") and isinstance(v, int | float)},
            "timeline": _timeline({k: v for k, v in st.items()
                                   if k not in _NOT_MARKS and not k.startswith(_NOT_MARK_PREFIXES)},
                                  kill)}
    if first is not None and first.get("step_ts"):
        out["first_step_at_s"] = first["step_ts"] - kill
    return _rounded(out)


def _failed_rank(failure: dict[str, Any]) -> int | None:
    """The rank a failure names: its own ``rank``, or a hang's first suspect's."""
    if isinstance(failure.get("rank"), int):
        return failure["rank"]
    for suspect in failure.get("suspects") or []:
        if isinstance(suspect, dict) and isinstance(suspect.get("rank"), int):
            return suspect["rank"]
    return None


# A startup event's fields that are not wall-clock marks.
_NOT_MARKS = frozenset({"ts", "seq", "rank", "generation", "node_id", "warm"})
_NOT_MARK_PREFIXES = ("compile_phase_", "standby_")


def _timeline(marks: dict[str, Any], kill: float) -> dict[str, float]:
    """Wall-clock marks as seconds after the kill, in the order they happened (marks before
    the kill, e.g. a standby's own start, are left out)."""
    at = {k: v - kill for k, v in marks.items()
          if isinstance(v, int | float) and not isinstance(v, bool) and v >= kill - 1e-3
          and v < kill + 3600}
    return {k: round(v, 3) for k, v in sorted(at.items(), key=lambda kv: kv[1])}


def _rounded(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    return round(d, 3) if isinstance(d, float) else d


def _kill_run(proc: subprocess.Popen, run: Path) -> None:
    """The job's process group, then every agent and rank its journal names (agents run in
    sessions of their own)."""
    pids = [proc.pid]
    if (run / "events.jsonl").exists():
        for e in _events(run):
            if e["kind"] == "agent_spawned":
                pids.append(e["pid"])
            elif e["kind"] == "ranks_started":
                pids += [r["pid"] for r in e["ranks"] if r.get("pid")]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_job(config: str | None, sets: list[str], timeout: float) -> tuple[Path, float]:
    run = Path(tempfile.mkdtemp(prefix="bench-recover-")) / "run"
    cmd = [sys.executable, "-m", "orchestrator", "up", "--run-dir", str(run)]
    cmd += [config] if config else []
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        _kill_run(proc, run)
        out, _ = proc.communicate()
        print(out[-4000:])
        raise SystemExit(f"orchestrator up cut after {timeout:.0f} s: {' '.join(cmd)}")
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        print(out[-4000:])
        raise SystemExit(f"orchestrator up failed ({proc.returncode}): {' '.join(cmd)}")
    return run, wall


def fault_free(config: str | None, sets: list[str], steps: int, timeout: float) -> dict:
    run, wall = run_job(config, [*sets, f"trainer.steps={steps}"], timeout)
    events = _events(run)
    failures = [{k: e.get(k) for k in ("cause", "rank", "message")}
                for e in events if e["kind"] == "failure"]
    final = [e["to"] for e in events if e["kind"] == "transition"][-1]
    return {"steps": steps, "wall_s": round(wall, 1), "final_state": final,
            "failures": failures, "median_step_s": median_step(run),
            "saves": save_stalls(events), "run_dir": str(run)}


def with_faults(config: str | None, sets: list[str], kill: int, stop: int,
                timeout: float) -> dict:
    chaos = ("chaos.kill=[{step: %d, rank: 0, signal: SIGKILL}, "
             "{step: %d, rank: 0, signal: SIGSTOP}]" % (kill, stop))
    run, wall = run_job(config, [*sets, chaos], timeout)
    events = _events(run)
    return {"wall_s": round(wall, 1), "median_step_s": median_step(run),
            "recoveries": [breakdown(events, c) for c in events if c["kind"] == "chaos"],
            "calibrations": calibrations(events),
            "saves": save_stalls(events), "run_dir": str(run)}


def with_injections(config: str | None, sets: list[str], injections: list, path: str,
                    timeout: float) -> dict:
    """A run with ``injections`` (step, rank, signal), recovering by ``path`` (in_job or
    restart), each recovery broken down."""
    kills = ", ".join("{step: %d, rank: %d, signal: %s}" % i for i in injections)
    run, wall = run_job(config, [*sets, f"restart.in_job={'true' if path == 'in_job' else 'false'}",
                                 f"chaos.kill=[{kills}]"], timeout)
    events = _events(run)
    chaos = [c for c in events if c["kind"] == "chaos"]
    recoveries = []
    for c in chaos:
        try:
            recoveries.append(in_job_breakdown(events, c) if path == "in_job"
                              else breakdown(events, c))
        except LookupError as exc:
            recoveries.append({"signal": c.get("signal"), "at_step": c.get("step"),
                               "error": str(exc)})
    median = median_step(run)
    for r, c in zip(recoveries, chaos, strict=True):
        r["settle"] = settle(run, c.get("generation"), median)
    failures = [{k: e.get(k) for k in ("generation", "cause", "rank", "recovery_path",
                                       "recovery_reason")}
                for e in events if e["kind"] == "failure"]
    return {"path": path, "wall_s": round(wall, 1), "median_step_s": median_step(run),
            "recoveries": recoveries, "failures": failures,
            "calibrations": calibrations(events), "saves": save_stalls(events),
            "step_blocking": step_blocking(run), "run_dir": str(run)}


def path_targets(step: float | None, runs: list[dict]) -> dict[str, Any]:
    """The in-job targets: SIGKILL -> next step done <= 2 s median (1 s aim), SIGSTOP ->
    next step done <= the hang bound (3 x step + 2 s) + 2 s, every step's blocking <= 0.2 s."""
    out: dict[str, Any] = {}
    for r in runs:
        kills = [x["total_s"] for x in r["recoveries"]
                 if x.get("signal") == "SIGKILL" and x.get("total_s") is not None]
        stops = [x for x in r["recoveries"] if x.get("signal") == "SIGSTOP"]
        bound = round(3 * (step or 0.0) + 2.0, 3)
        out[r["path"]] = {
            "sigkill_to_next_step_s": kills,
            "sigkill_median_s": round(statistics.median(kills), 3) if kills else None,
            "sigstop_detected_s": [x.get("detection_s") for x in stops],
            "sigstop_to_next_step_s": [x.get("total_s") for x in stops],
            "hang_bound_s": bound,
            "step_blocking_max_s": r["step_blocking"]["max_s"],
            # Slow steps after each recovery: seconds beyond the median step.
            "settle_excess_s": [x.get("settle", {}).get("excess_s") for x in r["recoveries"]]}
    ij = out.get("in_job")
    if ij is not None:
        ij["sigkill_median_met_2s"] = ij["sigkill_median_s"] is not None and \
            ij["sigkill_median_s"] <= 2.0
        ij["sigstop_met"] = all(t is not None and t <= ij["hang_bound_s"] + 2.0
                                for t in ij["sigstop_to_next_step_s"])
        ij["blocking_met"] = ij["step_blocking_max_s"] is not None and \
            ij["step_blocking_max_s"] <= TARGET_SAVE_BLOCK_S
    return out


def targets(free: dict, faults: dict) -> dict[str, Any]:
    step = faults["median_step_s"] or 0.0
    kill = next((r for r in faults["recoveries"] if r["signal"] == "SIGKILL"), {})
    stop = next((r for r in faults["recoveries"] if r["signal"] == "SIGSTOP"), {})
    blocks = [b for f in (free, faults) for b in
              f["saves"]["first_of_generation_s"] + f["saves"]["later_s"]]
    hang_bound = round(3 * step + 2.0, 3)
    return {
        "sigkill_to_next_step_s": kill.get("total_s"), "sigkill_target_s": TARGET_KILL_S,
        "sigkill_met": kill.get("total_s") is not None and kill["total_s"] <= TARGET_KILL_S,
        "sigstop_found_s": stop.get("detection_s"), "sigstop_target_s": hang_bound,
        "sigstop_met": stop.get("detection_s") is not None
        and stop["detection_s"] <= hang_bound and stop.get("detected_as") == "hang",
        "save_blocking_max_s": max(blocks, default=None),
        "save_blocking_target_s": TARGET_SAVE_BLOCK_S,
        "save_blocking_met": bool(blocks) and max(blocks) <= TARGET_SAVE_BLOCK_S,
        "fault_free_clean": free["final_state"] == "COMPLETED" and not free["failures"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="job YAML (default: the profile's)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="a config override (dotted key=value), after the profile's")
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--stop-step", type=int, default=None)
    ap.add_argument("--free-steps", type=int, default=None,
                    help="steps of the fault-free run (0: skip it)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for both jobs together (a job is cut when it is spent)")
    ap.add_argument("--device", default=None, help="device name for the report")
    ap.add_argument("--paths", default=None,
                    help="comma-separated recovery paths to run with the profile's injections "
                         "(in_job,restart); each in its own run of this call")
    ap.add_argument("--standby-ab", type=int, default=0,
                    help="steps of two fault-free runs, standbys on and off (tokens/s)")
    ap.add_argument("--out", default="recovery-cpu.json")
    args = ap.parse_args()
    profile = PROFILES[args.profile]
    config = args.config or profile["config"]
    sets = [*profile["sets"], *args.sets]
    kill = args.kill_step if args.kill_step is not None else profile["kill_step"]
    stop = args.stop_step if args.stop_step is not None else profile["stop_step"]
    free_steps = args.free_steps if args.free_steps is not None else profile["free_steps"]
    t0 = time.monotonic()

    def limit() -> float:
        if args.budget is None:
            return args.timeout
        return min(args.timeout, args.budget - (time.monotonic() - t0))

    if args.paths:
        return compare_paths(args, config, sets, profile, limit)
    free = fault_free(config, sets, free_steps, limit()) if free_steps else None
    faults = with_faults(config, sets, kill, stop, limit())
    report = {**header(args.device), "profile": args.profile,
              "config": config or "configs/local.yaml", "overrides": sets,
              "kill_step": kill, "stop_step": stop,
              "median_step_s": faults["median_step_s"],
              "recoveries": faults["recoveries"], "calibrations": faults["calibrations"],
              "saves": faults["saves"],
              "fault_free": free, "faults_wall_s": faults["wall_s"],
              "targets": targets(free, faults) if free else None,
              "wall_s": round(time.monotonic() - t0, 1)}
    path = write(Path(args.out).name, report)
    print(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


def _add_deaths(run: dict[str, Any], watch: DeathWatch) -> None:
    """Each recovery's death as :class:`DeathWatch` saw it (the first process to begin
    exiting after the injection), on the injection's time line."""
    events = _events(Path(run["run_dir"]))
    roles = {r["pid"]: f"rank {r['rank']}" for e in events if e["kind"] == "ranks_started"
             for r in e["ranks"] if r.get("pid")}
    deaths = watch.report(roles)["deaths"]
    for rec, c in zip(run["recoveries"], [e for e in events if e["kind"] == "chaos"],
                      strict=True):
        d = next((d for d in deaths if c["ts"] - 0.05 <= d["exiting"] <= c["ts"] + 30), None)
        if d is not None:
            rec["death"] = {**{k: v for k, v in d.items() if k not in ("exiting",
                                                                      "teardown_end")},
                            "exiting_s": round(d["exiting"] - c["ts"], 3),
                            "teardown_end_s": round(d["teardown_end"] - c["ts"], 3)
                            if "teardown_end" in d else None}


def compare_paths(args: argparse.Namespace, config: str | None, sets: list[str],
                  profile: dict[str, Any], limit: Any) -> int:
    """The profile's injections once per recovery path, in this one call (the same device
    and software for both), and optionally fault-free runs with standbys on and off."""
    t0 = time.monotonic()
    runs = []
    for path in args.paths.split(","):
        if path == "none":
            continue
        sampler = StandbySampler() if path == "in_job" else None
        watch = DeathWatch() if path == "in_job" else None
        runs.append(with_injections(config, sets, profile["injections"], path, limit()))
        if sampler is not None:  # what the warm standbys held meanwhile
            runs[-1]["standby_cost"] = sampler.report()
        if watch is not None:  # each death's teardown, and the other ranks' threads then
            _add_deaths(runs[-1], watch)
    standby = None
    if args.standby_ab:
        sampler = StandbySampler()
        on = fault_free(config, [*sets, "restart.standby=true"], args.standby_ab, limit())
        cost = sampler.report()
        # Without: no spare interpreter at all (the standby's imports, context and pinned
        # slots all cost something beside the ranks).
        off = fault_free(config, [*sets, "restart.standby=false", "job.warm_start=false"],
                         args.standby_ab, limit())
        ratio = on["median_step_s"] / off["median_step_s"] \
            if on["median_step_s"] and off["median_step_s"] else None
        standby = {"with_standbys": on, "without_standbys": off, "cost": cost,
                   "step_time_ratio": round(ratio, 4) if ratio else None,
                   "within_1pct": ratio is not None and ratio <= 1.01}
    step = next((r["median_step_s"] for r in runs if r["median_step_s"]), None)
    report = {**header(args.device), "profile": args.profile,
              "config": config or "configs/local.yaml", "overrides": sets,
              "injections": profile["injections"], "median_step_s": step,
              "runs": runs, "standby": standby, "targets": path_targets(step, runs),
              "wall_s": round(time.monotonic() - t0, 1)}
    path = write(Path(args.out).name, report)
    print(json.dumps({"targets": report["targets"],
                      "recoveries": {r["path"]: r["recoveries"] for r in runs},
                      "standby": {k: v for k, v in (standby or {}).items()
                                  if k not in ("with_standbys", "without_standbys")}},
                     indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
