"""DeepSpeed jobs end to end: ZeRO-2 killed and resumed bit-identically, ZeRO-3 to the end.

Real supervisor, agents and two gloo ranks on the CPU. DeepSpeed's files are compared as
saved (torch.load), and every checkpoint must carry our manifest and verify, as DCP ones do.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import deepspeed_state_dict, env, journal, status, up, write_config
from procs import clear_stale_build_locks, extensions_root, run_group

from trainer.checkpoint import layout

pytestmark = pytest.mark.slow

STEPS = 30
ZERO2 = {"steps": STEPS, "parallelism": {"strategy": "deepspeed", "zero_stage": 2}}


@pytest.fixture(scope="module")
def deepspeed_ops() -> None:
    """Build DeepSpeed's CPU communication op before any job starts.

    DeepSpeed's first start on a machine compiles ``deepspeed_shm_comm`` (C++, 40-80 s on
    the 2-core CI machine; cached under ~/.cache/torch_extensions afterwards). Built here
    once, so that cost is not inside a job, where every rank would wait for it in its first
    collective and the jobs' start-up and hang timings would absorb it.

    A build killed half-way (a CI run cancelled, a test timed out) leaves its ``lock`` file,
    and every later build would wait on it forever: a lock no process holds is removed first.
    """
    for lock in clear_stale_build_locks(extensions_root(env())):
        print(f"removed a stale extension build lock: {lock}")
    t0 = time.monotonic()
    out = run_group([sys.executable, "-c",
                     "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                    env=env(), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    print(f"DeepSpeed ops ready after {time.monotonic() - t0:.1f} s")


@pytest.fixture(scope="module")
def clean_zero2(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path,
                deepspeed_ops: None) -> Path:
    """One uninterrupted ZeRO-2 run, the reference."""
    tmp = tmp_path_factory.mktemp("ds-clean")
    cfg = write_config(tmp / "job.yaml", dataset_dir, trainer=ZERO2)
    result = up(cfg, tmp / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    return tmp / "run"


def _committed(run: Path) -> list[int]:
    return [e["step"] for e in journal(run)
            if e["kind"] == "checkpoint_committed" and e.get("tier", "local") == "local"]


def test_zero2_killed_resumes_bit_identically(tmp_path: Path, dataset_dir: Path,
                                              clean_zero2: Path) -> None:
    kill = random.Random().randrange(15, 20)  # after the first checkpoint (10) has committed
    print(f"chaos kill at step {kill}")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer=ZERO2,
                       chaos={"kill": [{"step": kill}], "seed": kill})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(run)
    assert st["state"] == "COMPLETED" and st["last_step"] == STEPS
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    assert [e["step"] for e in journal(run) if e["kind"] == "resumed"] == [10]
    assert _committed(clean_zero2) == [10, 20, 30]
    assert _committed(run)[-2:] == [20, 30]

    step = layout.step_dir_name(STEPS)
    for r in (clean_zero2, run):
        check = layout.verify(str(r / "checkpoints" / "t" / step))
        assert check.ok, check.problems
        assert check.manifest["writer"] == "deepspeed"
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in check.manifest["files"]
    a = deepspeed_state_dict(clean_zero2 / "checkpoints" / "t" / step)
    b = deepspeed_state_dict(run / "checkpoints" / "t" / step)
    assert sorted(a) == sorted(b)
    # Every rank's RNG states ride in rank 0's file. Python's and numpy's generators are
    # never seeded (the OS seeds them per process), so only torch's can match across runs.
    rng = sorted(k for k in a if k.startswith("mp_rank_00_model_states.pt/rng."))
    assert len(rng) == 2
    for key in rng:
        x, y = json.loads(a.pop(key)), json.loads(b.pop(key))  # JSON, never a pickle
        assert x["torch"] == y["torch"], key
    tensors = 0
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            # Bytes, not values: NaN != NaN, and -0.0 == 0.0.
            assert x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)), \
                f"{key} differs"
            tensors += 1
        elif x is not None and type(x).__eq__ is object.__eq__:
            # DeepSpeed's loss scaler has no __eq__; its repr is its state.
            assert type(x) is type(y) and repr(x) == repr(y), key
        else:
            assert x == y, f"{key}: {str(x)[:200]} != {str(y)[:200]}"
    # The weights, the fp32 partitions and both Adam moments of both ranks, and ours.
    assert tensors > 30
    assert a["mp_rank_00_model_states.pt/progress.step"] == STEPS
    assert any(k.startswith("zero_pp_rank_1_mp_rank_00_optim_states.pt/optimizer_state_dict.")
               and k.endswith(".exp_avg_sq") for k in a)


def test_zero3_runs_to_completion_and_exports(tmp_path: Path, dataset_dir: Path,
                                             deepspeed_ops: None) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       trainer={"steps": 10, "parallelism": {"strategy": "deepspeed",
                                                             "zero_stage": 3}},
                       checkpoint={"interval_steps": 5})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    assert status(run)["state"] == "COMPLETED"
    assert _committed(run) == [5, 10]
    step_dir = run / "checkpoints" / "t" / layout.step_dir_name(10)
    check = layout.verify(str(step_dir))
    assert check.ok, check.problems
    # ZeRO-3: every rank writes its own partition of the weights.
    assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} \
        <= set(check.manifest["files"])
    assert not (step_dir / "mp_rank_00_model_states.pt").exists()
    records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # it trains

    # Exported to HF format (DeepSpeed's consolidation of the two ranks' partitions), the
    # weights' norm is the parameter norm the run reported at step 10, which the stepper
    # reduced over the same partitions in the run.
    from trainer.hf import export_checkpoint, read_hf_dir

    export_checkpoint(str(step_dir), check.manifest, tmp_path / "hf", log=lambda m: None)
    _, weights = read_hf_dir(tmp_path / "hf")
    norm = torch.stack([w.float().norm() for w in weights.values()]).norm().item()
    assert norm == pytest.approx(records[-1]["param_norm"], rel=1e-5)


def test_a_rank_failing_to_save_releases_the_others(tmp_path: Path,
                                                    deepspeed_ops: None) -> None:
    """Rank 1's write fails (ENOSPC) while rank 0's succeeds and waits in DeepSpeed's closing
    barrier: the failing rank meets it there, both learn the outcome, nothing is committed,
    and the next save commits."""
    script = Path(__file__).parent / "scripts" / "deepspeed_save_failure.py"
    # In a process group of its own, killed whole on timeout: killing torch.distributed.run
    # alone once left its two ranks running for 25 minutes.
    out = run_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], timeout=180,
        env={**env(), "CKPT_ROOT": str(tmp_path / "ckpt"), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    results = {r["rank"]: r for r in (json.loads(line) for line in out.stdout.splitlines()
                                      if line.startswith("{"))}
    assert sorted(results) == [0, 1]
    failed = [e for e in results[0]["events"] if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 1
    assert "rank 1: disk full (ENOSPC)" in failed[0]["error"]
    committed = [e["step"] for e in results[0]["events"] if e["event"] == "checkpoint_committed"]
    assert committed == [2]
    # Rank 0 (which commits) removed the partial directory, then committed step 2.
    assert not results[0]["first_dir_exists"]
    assert results[0]["second_ok"] and results[0]["failures"] == 0


_HOLD = ("import sys, time; from torch.utils.file_baton import FileBaton; "
         "assert FileBaton(sys.argv[1]).try_acquire(); print('held', flush=True); "
         "time.sleep(600)")


def test_a_stale_build_lock_is_cleared_and_a_held_one_kept(tmp_path: Path) -> None:
    """Two builds take torch's FileBaton on their op's lock; one is SIGKILLed (its lock is
    now stale), the other still runs (a build under way): only the stale one goes."""
    root = tmp_path / "torch_extensions"
    locks = {name: root / "py311_cpu" / name / "lock" for name in ("killed", "running")}
    procs = {}
    for name, lock in locks.items():
        lock.parent.mkdir(parents=True)
        procs[name] = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)],
                                       stdout=subprocess.PIPE, text=True,
                                       start_new_session=True)
        assert procs[name].stdout.readline().strip() == "held"
    try:
        os.kill(procs["killed"].pid, signal.SIGKILL)
        procs["killed"].wait()
        assert locks["killed"].exists()  # what a killed build leaves behind
        assert clear_stale_build_locks(root) == [locks["killed"]]
        assert not locks["killed"].exists() and locks["running"].exists()
        assert clear_stale_build_locks(root) == []  # nothing else is stale
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    # Its holder gone, the other lock is stale too.
    assert clear_stale_build_locks(root) == [locks["running"]]


def test_a_rank_stuck_on_a_build_lock_is_a_hang_with_its_stack(tmp_path: Path,
                                                                dataset_dir: Path) -> None:
    """The job-side half: a stale lock in the ranks' extension directory leaves each rank
    waiting in DeepSpeed's op build during ``init``; the supervisor calls it a hang after
    the init timeout, dumps the ranks' stacks (torch's FileBaton.wait on top) and stops."""
    ext = tmp_path / "ext"
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    (ext / "deepspeed_shm_comm" / "lock").touch()  # no process holds it: stale
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"name": "t", "env": {"TORCH_EXTENSIONS_DIR": str(ext)}},
                       trainer={"steps": 5, "parallelism": {"strategy": "deepspeed",
                                                            "zero_stage": 1}},
                       # Above a loaded machine's imports: the CI run once saw a rank still
                       # importing (stability's models) 25 s after its start.
                       timeouts={"phases": {"init": 60}},
                       restart={"max_restarts": 0})
    run = tmp_path / "run"
    result = up(cfg, run, timeout=300)
    assert result.returncode != 0, result.stdout[-4000:]
    st = status(run)
    assert st["state"] == "FAILED", st
    failures = [e for e in journal(run) if e["kind"] == "failure"]
    assert failures and failures[0]["cause"] == "hang", failures
    stacks = sorted((run / "stacks").rglob("*"))
    dumps = [p.read_text(errors="replace") for p in stacks if p.is_file()]
    assert dumps, f"no stack dumps under {run / 'stacks'}"
    assert any("file_baton.py" in d and "wait" in d for d in dumps), dumps[0][-3000:]
