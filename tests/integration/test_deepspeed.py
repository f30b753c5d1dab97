"""DeepSpeed jobs end to end: ZeRO-2 killed and resumed bit-identically, ZeRO-3 to the end.

Real supervisor, agents and two gloo ranks on the CPU. DeepSpeed's files are compared as
saved (torch.load), and every checkpoint must carry our manifest and verify, as DCP ones do.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import deepspeed_state_dict, env, journal, status, up, write_config

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
    """
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c",
                    "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   check=True, env=env(), timeout=900, capture_output=True)
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
    kill = random.Random().randrange(11, 20)  # after the first checkpoint (10)
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
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True, text=True, timeout=180, check=False,
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
