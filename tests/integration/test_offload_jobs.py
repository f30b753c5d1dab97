"""CPU offload jobs end to end on the CPU (two gloo ranks): FSDP2's ``CPUOffloadPolicy`` and
DeepSpeed's ZeRO-Offload (optimizer at stage 2; optimizer and parameters at stage 3).

On a CPU-only machine offloading moves nothing, so what is tested here is that the offload
code paths run a whole job, checkpoint and finish: FSDP2's with the same result, bit for bit,
as without offload (same kernels, same order). The figures offload exists for (peak GPU memory
and step time) come from a GPU: bench/offload_fp8_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import assert_bit_identical, env, final_state_dict, status, up, write_config

pytestmark = pytest.mark.slow

STEPS = 10


def _run(tmp: Path, dataset: Path, name: str, parallelism: dict) -> Path:
    cfg = write_config(tmp / f"{name}.yaml", dataset,
                       trainer={"steps": STEPS, "parallelism": parallelism})
    result = up(cfg, tmp / name)
    assert result.returncode == 0, result.stdout[-4000:]
    assert status(tmp / name)["state"] == "COMPLETED"
    return tmp / name / "checkpoints" / "t" / f"step-{STEPS:08d}"


def test_fsdp2_cpu_offload_matches_the_run_without(tmp_path: Path, dataset_dir: Path) -> None:
    plain = _run(tmp_path, dataset_dir, "plain", {"strategy": "fsdp2"})
    offload = _run(tmp_path, dataset_dir, "offload", {"strategy": "fsdp2", "offload": "params"})
    n = assert_bit_identical(final_state_dict(plain), final_state_dict(offload),
                             ("app.model.", "app.optim.", "progress."))
    assert n > 30


@pytest.fixture(scope="module")
def deepspeed_ops() -> None:
    """DeepSpeed's CPU communication op, built once before any job (as test_deepspeed.py
    does: cached under ~/.cache/torch_extensions, so CI builds it once for both files)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c",
                    "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   check=True, env=env(), timeout=900, capture_output=True)
    print(f"DeepSpeed ops ready after {time.monotonic() - t0:.1f} s")


def test_deepspeed_zero_offload_runs_a_job(tmp_path: Path, dataset_dir: Path,
                                           deepspeed_ops: None) -> None:
    """ZeRO-3 with the optimizer and the parameters offloaded (stage 2 with the optimizer
    alone runs the same ZeRO-Offload optimizer path: its config is checked in the unit
    tests, tests/unit/trainer/test_memory.py)."""
    import torch

    stage, offload = 3, "params"

    step = _run(tmp_path, dataset_dir, "ds", {"strategy": "deepspeed", "zero_stage": stage,
                                              "offload": offload})
    log = (tmp_path / "ds" / "logs" / "rank-00000.log").read_text()
    where = "cpu" if offload == "params" else "the accelerator"
    # The engine's own parsed config, as the backend logs it.
    assert f"ZeRO-Offload: optimizer state and step on cpu, parameters on {where}" in log
    states = sorted(step.glob("*optim_states.pt"))
    assert len(states) == 2  # one ZeRO partition per rank, with the offloaded Adam state
    part = torch.load(states[0], map_location="cpu", weights_only=False)
    assert part["optimizer_state_dict"] is not None
