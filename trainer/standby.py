"""A warm standby's preparation: what a replacement rank can do before it knows it is one.

The agent keeps one spare interpreter per local rank with the trainer imported
(``orchestrator.worker.warm``); with ``restart.standby`` it then runs :func:`prepare`, and
the spare waits, ready to take a dead rank's place in an in-job recovery. On a GPU node that
means the CUDA context of its device (a few hundred MB of GPU memory and about a second,
paid now, not in the recovery), the job's compile cache loaded into the compiler's
in-memory caches (and Inductor's key of torch's sources computed), the job's step compiled
on a two-block copy of the model (``trainer.standby_compile``: the replacement's first step
compiles nothing), and the rank's memory-tier slots mapped and page-locked (a slot whose
first copy comes later, when it comes), so the restore copies host-to-device at full speed;
it also makes the rank's memory-tier copies for it, through CUDA IPC, so the rank itself
page-locks nothing (``trainer.checkpoint.copier``).
Nothing model-sized stays on the GPU (the copy is freed before the standby waits): the rank
that died may still hold its memory while its process is torn down.

Everything here is best effort: a step that fails leaves the spare as a plain pre-imported
one, and the rank it becomes does the same work on its own.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.contracts import env as ec

# What this process prepared, for the rank it becomes (read by the memory tier and the
# start-up breakdown).
PREPARED: dict[str, Any] = {}


def prepare(local_rank: int) -> None:
    """Device context, compile cache, page-locked memory slots, then the step compiled
    ahead (see the module)."""
    t0 = time.time()
    import torch

    if torch.cuda.is_available():
        from trainer.distributed import pin_by_registration

        pin_by_registration()  # before the context: the rank it becomes pins this way
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context and the allocator, not the model
        PREPARED["device"] = f"cuda:{torch.cuda.current_device()}"
    # The job's settings, read once for what is done ahead with them.
    job = job_settings() if torch.cuda.is_available() else None
    if job is not None:
        PREPARED.update(nccl_ahead(*job))
    cache = compile_cache_path(os.environ)
    if cache is not None and cache.is_file():
        PREPARED["compile_cache"] = load_compile_cache(cache)
    compiles = "torch._inductor.compile_fx" in sys.modules  # trainer.warm_compile
    if compiles:
        PREPARED["inductor_key"] = inductor_key()
    memory = ec.AgentEnv.from_env(os.environ).memory_dir
    rank = ec.get_int(os.environ, "RANK", None, minimum=0)
    if memory and rank is not None and torch.cuda.is_available():
        from trainer.checkpoint.memory_slots import pin_own_slots, watch_own_slots

        PREPARED["pinned_bytes"] = pin_own_slots(Path(memory), rank)
        # Slots whose first copy comes later (this standby started with the job) are
        # page-locked as their copies are committed, until the hand-off.
        watch_own_slots(Path(memory), rank)
    if compiles:  # whatever happens to it, the rest is prepared
        PREPARED.update(compile_step_ahead(local_rank, *(job or job_settings())))
    if memory and rank is not None and torch.cuda.is_available() and job is not None \
            and job[0] is not None and job[0].checkpoint.memory_copier:
        # Last, not to slow the rest: the rank's memory-tier copies are made here from now
        # on, so the rank page-locks nothing and its death holds the driver less.
        from trainer.checkpoint.memory_slots import serve_own_slots

        serve_own_slots(Path(memory), rank, lambda m: print(m, file=sys.stderr))
    PREPARED["prepare_s"] = time.time() - t0


def job_settings() -> tuple[Any | None, str | None]:
    """The job's settings from the standby's environment (its config file, read once for
    every step done ahead), or None and why not."""
    from trainer.settings import load_settings

    try:
        config = ec.AgentEnv.from_env(os.environ).config_path
        if not config:
            return None, "no job config in the standby's environment"
        return load_settings(config), None
    except Exception as exc:  # noqa: BLE001 - best effort: the rank reads its config itself
        return None, f"failed: {type(exc).__name__}: {exc}"[:300]


def nccl_ahead(settings: Any | None, why: str | None) -> dict[str, Any]:
    """NCCL set up in this process ahead (``trainer.parallelism.standby_nccl``): a one-rank
    communicator on the current device, one all-reduce, then shut down. What NCCL does
    once per process (its network plugin, interfaces and device probes) is then done
    before the rank this standby becomes meets its peers; nothing stays on the GPU.
    ``settings`` and ``why``: :func:`job_settings`."""
    import torch
    import torch.distributed as dist

    if settings is None:
        return {"nccl_ahead": why or "no job settings"}
    try:
        cfg = settings.trainer.parallelism
        if not cfg.standby_nccl:
            return {"nccl_ahead": "off (trainer.parallelism.standby_nccl)"}
        if cfg.backend not in ("auto", "nccl") or not dist.is_nccl_available():
            return {"nccl_ahead": "the job does not use NCCL"}
        t0 = time.perf_counter()
        pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1)
        one = torch.ones(1, device="cuda")
        pg.allreduce([one]).wait()
        torch.cuda.synchronize()
        pg.shutdown()
        return {"nccl_ahead_s": round(time.perf_counter() - t0, 6)}
    except Exception as exc:  # noqa: BLE001 - best effort: the rank sets NCCL up itself
        return {"nccl_ahead": f"failed: {type(exc).__name__}: {exc}"[:300]}


def compile_step_ahead(local_rank: int, settings: Any | None,
                       why: str | None) -> dict[str, Any]:
    """The job's step compiled ahead on a copy of the model (``trainer.standby_compile``);
    what it did, or why it did not. ``settings`` and ``why``: :func:`job_settings`."""
    from trainer import standby_compile

    if settings is None:
        return {"compile_ahead": why or "no job settings"}
    try:
        rank = ec.get_int(os.environ, "RANK", None, minimum=0)
        world = ec.get_int(os.environ, "WORLD_SIZE", None, minimum=1)
        if rank is None or world is None:
            return {"compile_ahead": "no rank or world size in the standby's environment"}
        not_ahead = standby_compile.why_not(settings)
        if not_ahead is not None:
            return {"compile_ahead": not_ahead}
        done = standby_compile.compile_ahead(settings, local_rank, rank, world)
    except Exception as exc:  # noqa: BLE001 - best effort: the rank compiles at its first step
        return {"compile_ahead": f"failed: {type(exc).__name__}: {exc}"[:300]}
    # The rank's ``startup`` event reports its own first step's compile, not this.
    return {**done, "compile_totals": compile_totals()}


def compile_totals() -> dict[str, float]:
    """The compiler's timed phases so far in this process, summed per phase (seconds)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        return {}
    return {str(k): sum(float(t) for t in v) for k, v in metrics.items()
            if isinstance(v, list) and v}


def inductor_key() -> bool:
    """Inductor's hash of torch's own source files, the key of every cache lookup: computed
    once per process, at its first compile, where it took 0.09-0.32 s of a replacement's
    first step on an H200 (``inductor_codecache_torch_key`` in its ``startup`` event).
    False where this torch has no such function."""
    try:
        from torch._inductor.codecache import torch_key

        torch_key()
    except Exception:  # noqa: BLE001 - a private function: best effort, as all of this
        return False
    return True


def compile_cache_path(env: Any) -> Path | None:
    """The job's compile cache (``torch.compiler.save_cache_artifacts``'s bytes), kept in
    the run directory: every new rank and standby loads it before its first compile."""
    run_dir = ec.AgentEnv.from_env(env).run_dir
    return Path(run_dir) / "compile-cache" / "artifacts.bin" if run_dir else None


def load_compile_cache(path: Path) -> int:
    """Load the cache's artifacts into this process's compiler caches; their size."""
    import torch

    data = path.read_bytes()
    if data:
        torch.compiler.load_cache_artifacts(data)
    return len(data)


def save_compile_cache(path: Path) -> int | None:
    """Write this process's compile artifacts (after its first compiled steps) for the next
    ranks and standbys, atomically; their size, or None when there are none."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return None
    data, _info = saved
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)
