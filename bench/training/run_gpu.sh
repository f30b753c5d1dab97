#!/usr/bin/env bash
# Runs the GPU benchmarks and tests on a GPU machine without network (the Python packages
# the GPU image lacks travel as wheels in .whl/). Part A: GPU tests + throughput/MFU.
# B: checkpoint stall. C: time to recover under `orchestrator up`. D: accelerator health checks.
# E: GPU tests, monitoring overhead, recovery with warm spares. F: FP8 vs bf16 loss curves.
# G: DeepSpeed ZeRO-Offload. P: profiling on demand (overhead, trace size).
# H (2 GPUs): recovery, hang detection, every save's stall, a clean fault-free end.
# R, S, T (2 GPUs): both recovery paths; an in-job smoke; the standbys' cost.
#   git rev-parse --short HEAD > .bench-commit; bash bench/training/run_gpu.sh A|B|...|T
# (results under bench/results/, copied to $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:-A}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# The copy of the tree on the GPU machine has no .git: say which commit is measured.
[ -f .bench-commit ] && export ORCH_BENCH_COMMIT=$(cat .bench-commit)
# NVLink multicast stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
if [ "$part" = A ]; then
  python3 -m pytest tests/gpu -q -p no:cacheprovider -x 2>&1 | tee "$out/gpu-tests.log" | tail -15
  python3 bench/training/gpu_train.py --out gpu-train-h100.json 2>&1 | tail -8
  cp bench/results/gpu-train-h100.json "$out/" 2>/dev/null
elif [ "$part" = B ]; then
  python3 bench/checkpoint/gpu_checkpoint.py --saves 3 --every 20 --out gpu-checkpoint-h100.json 2>&1 | tail -4
  cp bench/results/gpu-checkpoint-h100.json "$out/" 2>/dev/null
elif [ "$part" = C ]; then
  # Saves take ~40 s on this disk: space them so each commits before the next, and kill
  # only after one has committed (else the restart has nothing to resume).
  python3 bench/recovery/recovery.py configs/gpu-1b-h100.yaml --device "$(nvidia-smi --query-gpu=name \
    --format=csv,noheader | head -1)" --set trainer.steps=800 --set checkpoint.interval_steps=200 \
    --set timeouts.training_floor_s=5 --set restart.backoff_initial_s=0.5 \
    --kill-step 500 --stop-step 700 --out recovery-h100.json 2>&1 | tail -40
  cp bench/results/recovery-h100.json "$out/" 2>/dev/null
elif [ "$part" = E ]; then
  # GPU tests, monitoring overhead at the shipped defaults, and the recovery with warm
  # spare interpreters (micro-batch 4: 0.13 s steps).
  python3 -m pytest tests/gpu -q -p no:cacheprovider -x 2>&1 | tee "$out/gpu-tests.log" | tail -3
  python3 bench/training/gpu_train.py --runs eager:fsdp2:4 --overhead 4 --out gpu-overhead-h100.json \
    2>&1 | tail -3
  cp bench/results/gpu-overhead-h100.json "$out/" 2>/dev/null
  python3 bench/recovery/recovery.py configs/gpu-1b-h100.yaml --device "$(nvidia-smi --query-gpu=name \
    --format=csv,noheader | head -1)" --set trainer.steps=450 --set checkpoint.interval_steps=100 \
    --set trainer.data.micro_batch_size=4 --set timeouts.training_floor_s=5 \
    --set restart.backoff_initial_s=0.5 --kill-step 290 --stop-step 390 \
    --out recovery-warm-h100.json 2>&1 | tail -45
  cp bench/results/recovery-warm-h100.json "$out/" 2>/dev/null
elif [ "$part" = P ]; then
  # Profiling on demand: the step-time breakdown's cost, and a 5-step profile of
  # the 1.14B model (CPU + CUDA activities, shapes, memory): its overhead and trace size.
  python3 bench/training/profiling.py --device cuda --preset 1b --seq 2048 --mbs 4 --rounds 4 \
    --block 10 --profile-steps 5 --out profiling-h100.json 2>&1 | grep -v '^USDT' | tail -40
  cp bench/results/profiling-h100.json "$out/" 2>/dev/null
elif [ "$part" = F ]; then
  # FP8 vs bf16 with 300-step loss curves (~4 min on one H100).
  python3 bench/training/offload_fp8_gpu.py --parts fp8 --curve 300 \
    --out offload-fp8-gpu-h100-fp8.json 2>&1 | tail -4
  cp bench/results/offload-fp8-gpu-h100-fp8.json "$out/" 2>/dev/null
elif [ "$part" = G ]; then
  # DeepSpeed without offload vs ZeRO-Offload (stage 2 optimizer, stage 3 params);
  # needs deepspeed importable: carry its wheel in .whl/ (pip wheel --no-deps
  # deepspeed==0.19.8, plus hjson, py-cpuinfo, msgpack, ninja, einops). Skips, saying so, else.
  python3 bench/training/offload_fp8_gpu.py --parts deepspeed \
    --out offload-deepspeed-gpu-h100.json 2>&1 | tail -8
  cp bench/results/offload-deepspeed-gpu-h100.json "$out/" 2>/dev/null
elif [ "$part" = S ]; then
  # In-job recovery smoke on 2 GPUs (NCCL): a tiny model, two kills, the in-job path only.
  python3 bench/recovery/recovery.py --profile gpu2-smoke --paths in_job --device "$(nvidia-smi \
    --query-gpu=name --format=csv,noheader | head -1) x2" --budget 240 \
    --out recovery-gpu2-smoke.json 2>&1 | tail -60
  cp bench/results/recovery-gpu2-smoke.json "$out/" 2>/dev/null
elif [ "$part" = R ]; then
  # Both recovery paths, same call, same cards: the 1.14B model compiled at micro-batch 8,
  # memory tier on, three SIGKILLs and a SIGSTOP per run (in-job, then full restart).
  python3 bench/recovery/recovery.py --profile gpu2 --paths in_job,restart --device "$(nvidia-smi \
    --query-gpu=name --format=csv,noheader | head -1) x2" --budget 560 \
    --out recovery-gpu2-paths.json 2>&1 | tail -80
  cp bench/results/recovery-gpu2-paths.json "$out/" 2>/dev/null
elif [ "$part" = T ]; then
  # Standbys' cost: two fault-free runs, standbys on and off (tokens/s within 1 %).
  python3 bench/recovery/recovery.py --profile gpu2 --paths none --standby-ab 300 --device \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x2" --budget 560 \
    --out recovery-gpu2-standby.json 2>&1 | tail -30
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$out/apps.txt"
  cp bench/results/recovery-gpu2-standby.json "$out/" 2>/dev/null
elif [ "$part" = H ]; then
  # 1 node x 2 GPUs over NCCL, the 1.14B model compiled at micro-batch 8: a fault-free run
  # (no failure in its journal; its only save is a generation's first) and a run with a
  # SIGKILL and a SIGSTOP, each recovery broken down; the recovery targets judged in the JSON.
  # Both jobs within 8 minutes (--budget: the second is cut when 470 s are spent).
  python3 bench/recovery/recovery.py --profile h200x2 --device "$(nvidia-smi --query-gpu=name \
    --format=csv,noheader | head -1) x2" --budget 470 --out recovery-h200x2.json 2>&1 | tail -70
  cp bench/results/recovery-h200x2.json "$out/" 2>/dev/null
else
  python3 bench/health/gpu_health.py 2>&1 | tail -10
  cp bench/results/health-*.json "$out/" 2>/dev/null
fi
ls -la "$out"
