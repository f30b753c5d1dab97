"""Accelerator checks: inventory, ECC, memory retirement, XIDs, memory test, matmul throughput.

CUDA goes through NVML (``nvidia-ml-py``, optional) with ``torch.cuda`` as the fallback for
the inventory; Neuron through ``neuron-ls``. On a CPU job every check here is skipped with the
reason. torch is imported only inside the device tests, never at module load.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

from orchestrator.health import neuron as nrn
from orchestrator.health import nvml
from orchestrator.health.base import Outcome, failed, passed, skipped
from orchestrator.health.context import NodeContext

GIB = 1024**3
# Memory already in use on a device before our test (a leftover process from a crash): more
# than this fraction of the device and the ranks of the next generation may not fit.
_USED_FRACTION_MAX = 0.10
# The multiplier of a 32-bit multiplicative hash (Knuth): neighbouring words get unrelated
# patterns, so an address line fault shows as a mismatch rather than a plausible value.
_HASH = 2654435761


def detect(ctx: NodeContext) -> tuple[str, str]:
    """(kind, why): the node's accelerator kind, ``none`` with the reasons when nothing found."""
    if ctx.accelerator != "auto":
        return ctx.accelerator, f"cluster.accelerator is {ctx.accelerator}"
    snap = nvml.read_nvml()
    if snap["available"] and snap["devices"]:
        return "cuda", "NVML"
    if shutil.which("neuron-ls"):
        return "neuron", "neuron-ls"
    reasons = [snap["reason"] or "NVML sees no GPU", "neuron-ls: not installed"]
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda", "torch.cuda"
        reasons.append("torch.cuda: not available")
    except ImportError:
        reasons.append("torch: not installed")
    return "none", "; ".join(reasons)


def _not_here(ctx: NodeContext, wanted: str = "cuda") -> Outcome | None:
    """A skip outcome when this check does not apply to the node's accelerator."""
    kind, why = detect(ctx)
    if kind == "cpu":
        return skipped("no accelerator: cluster.accelerator is cpu")
    if kind == "none":
        return skipped(f"no accelerator found ({why})")
    if kind != wanted:
        return skipped(f"not applicable to {kind} devices")
    return None


def check_inventory(ctx: NodeContext) -> Outcome:
    kind, why = detect(ctx)
    if kind == "cpu":
        return skipped("no accelerator: cluster.accelerator is cpu")
    if kind == "none":
        return skipped(f"no accelerator found ({why})")
    if kind == "neuron":
        return nrn.neuron_inventory(ctx)
    snap = nvml.read_nvml()
    if snap["available"]:
        out = nvml.judge_inventory(snap["devices"], ctx.devices, ctx.expect_device_name)
        out.details.update(driver=snap.get("driver"), source="nvml")
        return out
    return _torch_inventory(ctx, snap["reason"])


def _torch_inventory(ctx: NodeContext, nvml_reason: str) -> Outcome:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [{"index": i, "name": torch.cuda.get_device_name(i), "errors": {}}
               for i in range(count)]
    if not devices and ctx.devices:
        return failed(f"no CUDA device visible ({nvml_reason}; torch.cuda sees none)")
    out = nvml.judge_inventory(devices, ctx.devices, ctx.expect_device_name)
    out.details.update(source="torch.cuda", nvml=nvml_reason)
    return out


def _nvml_devices(ctx: NodeContext) -> tuple[list[dict[str, Any]] | None, Outcome | None]:
    if (skip := _not_here(ctx)) is not None:
        return None, skip
    snap = nvml.read_nvml()
    if not snap["available"]:
        return None, skipped(f"NVML not available ({snap['reason']}): counters unreadable")
    return snap["devices"], None


def check_ecc(ctx: NodeContext) -> Outcome:
    devices, skip = _nvml_devices(ctx)
    return skip if devices is None else nvml.judge_ecc(devices)


def check_memory_retirement(ctx: NodeContext) -> Outcome:
    devices, skip = _nvml_devices(ctx)
    return skip if devices is None else nvml.judge_retirement(devices,
                                                              ctx.floors.retired_pages)


def check_xid(ctx: NodeContext) -> Outcome:
    if (skip := _not_here(ctx)) is not None:
        return skip
    text, source = nvml.read_kernel_log()
    if text is None:
        return skipped(f"kernel log not readable ({source})")
    return nvml.judge_xids(nvml.parse_xids(text))


# -- device tests (torch) -----------------------------------------------------------------------
def pattern(start: int, stop: int, seed: int, device: Any) -> Any:
    """The int32 words a memory test writes at indices [start, stop)."""
    import torch

    idx = torch.arange(start, stop, dtype=torch.int64, device=device)
    words = (idx * _HASH + seed) & 0xFFFFFFFF
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def count_mismatches(x: Any, seed: int, inverted: bool = False, chunk: int = 1 << 26) -> int:
    """Words of ``x`` that differ from the pattern (or its bitwise complement)."""
    bad = 0
    for a in range(0, x.numel(), chunk):
        b = min(a + chunk, x.numel())
        want = pattern(a, b, seed, x.device)
        if inverted:
            want = want.bitwise_not()
        bad += int((x[a:b] != want).sum().item())
    return bad


def memory_test(device: Any, nbytes: int, seed: int = 0x5A5A5A5A,
                chunk: int = 1 << 26) -> dict[str, Any]:
    """Write a pattern over ``nbytes``, verify, complement every bit in place, verify again."""
    import torch

    n = max(1, nbytes // 4)
    start = time.perf_counter()
    x = torch.empty(n, dtype=torch.int32, device=device)
    for a in range(0, n, chunk):
        x[a:min(a + chunk, n)] = pattern(a, min(a + chunk, n), seed, x.device)
    bad = count_mismatches(x, seed, chunk=chunk)
    x.bitwise_not_()
    bad += count_mismatches(x, seed, inverted=True, chunk=chunk)
    _sync(device)
    del x
    return {"bytes": n * 4, "mismatches": bad, "seconds": round(time.perf_counter() - start, 3)}


def matmul_tflops(device: Any, n: int, dtype: Any = None, seconds: float = 0.5) -> float:
    """Sustained ``n x n`` matmul TFLOP/s on ``device`` (bf16 by default), ~``seconds`` long."""
    import torch

    dtype = dtype or torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):  # kernel selection, clocks up
        a @ b
    _sync(device)
    t = time.perf_counter()
    a @ b
    _sync(device)
    iters = max(3, min(200, int(seconds / max(time.perf_counter() - t, 1e-6))))
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e12


def judge_matmul(tflops: list[float], floor: float | None, relative: float) -> Outcome:
    """Each device against the absolute floor and against ``relative`` x the node's fastest."""
    if not tflops:
        return failed("no device measured")
    best = max(tflops)
    slow = []
    for i, v in enumerate(tflops):
        if floor is not None and v < floor:
            slow.append(f"device {i}: {v:.1f} TFLOP/s, floor {floor:g}")
        elif v < relative * best:
            slow.append(f"device {i}: {v:.1f} TFLOP/s, under {relative:.0%} of the node's "
                        f"fastest ({best:.1f})")
    details = {"tflops": [round(v, 2) for v in tflops]}
    if slow:
        return failed("; ".join(slow), **details)
    return passed(f"{len(tflops)} devices, {min(tflops):.1f}-{best:.1f} TFLOP/s", **details)


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_devices(ctx: NodeContext) -> list[int]:
    import torch

    count = torch.cuda.device_count()
    return list(range(count if ctx.accelerator == "auto" or not ctx.devices
                      else min(count, max(ctx.devices, 1))))


def check_memory_test(ctx: NodeContext) -> Outcome:
    if (skip := _not_here(ctx)) is not None:
        return skip
    import torch

    problems, rows = [], []
    for i in _cuda_devices(ctx):
        dev = torch.device("cuda", i)
        free, total = torch.cuda.mem_get_info(dev)
        if total - free > _USED_FRACTION_MAX * total:
            problems.append(f"GPU {i}: {(total - free) / GIB:.1f} of {total / GIB:.0f} GiB "
                            "already in use (a leftover process?)")
        want = int(min(ctx.memtest_gib * GIB, 0.8 * free))
        try:
            r = memory_test(dev, want)
        except torch.cuda.OutOfMemoryError as exc:
            problems.append(f"GPU {i}: cannot allocate {want / GIB:.1f} GiB: {exc}")
            continue
        finally:
            torch.cuda.empty_cache()
        rows.append({"device": i, **r})
        if r["mismatches"]:
            problems.append(f"GPU {i}: {r['mismatches']} words read back wrong")
    if not rows and not problems:
        return failed("no CUDA device to test")
    if problems:
        return failed("; ".join(problems), devices=rows)
    return passed(f"{len(rows)} GPUs x {rows[0]['bytes'] / GIB:.1f} GiB written and verified "
                  "twice (pattern, complement)", devices=rows)


def check_matmul(ctx: NodeContext) -> Outcome:
    if (skip := _not_here(ctx)) is not None:
        return skip
    import torch

    devices = _cuda_devices(ctx)
    values = [matmul_tflops(torch.device("cuda", i), ctx.matmul_size) for i in devices]
    return judge_matmul(values, ctx.floors.matmul_tflops, ctx.floors.matmul_relative)
