"""torch.distributed set-up: the process groups, the device, threads and determinism.

The rendezvous is torch's own (env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE from the agent or
torchrun). Collective timeouts are always explicit, never NCCL's ten-minute default, and sit
just above the orchestrator's hang timeout so the orchestrator, which can dump stacks and
name the stuck rank, acts first.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import tenacity
import torch
import torch.distributed as dist

from orchestrator.contracts import env as ec
from trainer.config import TrainerConfig

# Standalone (plain torchrun, no orchestrator to say its hang timeout): five minutes, long
# enough for a slow first collective on a big cluster, half of NCCL's silent ten.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    ckpt_group: dist.ProcessGroup | None  # dedicated gloo group for checkpoint I/O
    # A gloo group of its own for the training loop's control decisions (the operator's
    # stop): never shared with the async-save thread's collectives on ckpt_group.
    control_group: dist.ProcessGroup | None = None
    # Wall-clock ends of start-up's parts (the ``startup`` event: where a restart's seconds
    # go); None: nobody asked.
    marks: dict[str, float] | None = None

    def mark(self, name: str) -> None:
        if self.marks is not None:
            self.marks[name] = time.time()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


# How this process page-locks host memory (the checkpoint staging, gigabytes per GPU):
# PyTorch's host allocator faults the pages in with its own threads, then registers them
# (``cudaHostRegister``), instead of ``cudaHostAlloc``, which pins and zeroes them while it
# holds the CUDA driver. A restarted rank allocates its staging in the background after its
# first step, and until it is done every rank's steps run several times slower.
PINNED_BY_REGISTRATION = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pin_by_registration(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Before this process's first CUDA allocation: add :data:`PINNED_BY_REGISTRATION` to
    the allocator's settings (``PYTORCH_ALLOC_CONF`` where the job set it, else
    ``PYTORCH_CUDA_ALLOC_CONF``), unless the job's settings already say how to pin."""
    name = "PYTORCH_ALLOC_CONF" if env.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
    current = env.get(name, "").strip().strip(",")
    if "pinned_use_cuda_host_register" in current:
        return
    env[name] = f"{current},{PINNED_BY_REGISTRATION}" if current else PINNED_BY_REGISTRATION


def pick_device(cfg: TrainerConfig, local_rank: int) -> torch.device:
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device is cuda but no CUDA device is visible")
        pin_by_registration()
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if want == "xla":
        import torch_xla.core.xla_model as xm  # lazily: only on Trainium/TPU hosts

        return xm.xla_device()
    if want == "neuron":
        from trainer.backends.torchneuron import pick_device as neuron_device  # TorchNeuron

        return neuron_device(local_rank)
    return torch.device("cpu")


def configure_process(cfg: TrainerConfig, local_world_size: int) -> None:
    """Threads and determinism, before any tensor work."""
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # cuBLAS needs a fixed workspace for deterministic GEMMs.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


# trainer.parallelism.backend auto, by device type (anything else: gloo).
AUTO_BACKEND = {"cuda": "nccl", "xla": "xla", "neuron": "neuron"}


def process_group_spec(backend: str) -> str:
    """What ``init_process_group`` gets for ``backend``. "cpu:gloo,cuda:nccl" keeps a CPU
    backend on the default group, which DCP's async save requires for its CPU-side
    coordination; TorchNeuron's "neuron" backend gets the same (``trainer.backends.
    torchneuron``)."""
    if backend == "nccl":
        return "cpu:gloo,cuda:nccl"
    if backend == "neuron":
        from trainer.backends.torchneuron import PG_SPEC

        return PG_SPEC
    return backend


def collective_timeout_s() -> float:
    """From the orchestrator (hang timeout + margin) or the standalone default."""
    return ec.GenerationEnv.from_env(os.environ).collective_timeout_s \
        or DEFAULT_COLLECTIVE_TIMEOUT_S


def init_distributed(cfg: TrainerConfig, marks: dict[str, float] | None = None
                     ) -> DistContext:
    """The process groups (``marks``: wall-clock ends of the device pick and the default
    group, for the startup event)."""
    mark = (lambda name: marks.__setitem__(name, time.time())) if marks is not None \
        else (lambda name: None)
    env = os.environ
    rank = ec.get_int(env, "RANK", 0, minimum=0) or 0
    local_rank = ec.get_int(env, "LOCAL_RANK", 0, minimum=0) or 0
    world = ec.get_int(env, "WORLD_SIZE", 1, minimum=1) or 1
    local_world = ec.get_int(env, "LOCAL_WORLD_SIZE", 1, minimum=1) or 1
    configure_process(cfg, local_world)
    device = pick_device(cfg, local_rank)
    mark("device_ready")
    backend = cfg.parallelism.backend
    if backend == "auto":
        backend = AUTO_BACKEND.get(device.type, "gloo")
    if backend == "xla":
        # Registers the "xla" process-group backend (Neuron's collectives on Trainium).
        import torch_xla.distributed.xla_backend  # noqa: F401
    ckpt_group = None
    if world > 1 or "MASTER_ADDR" in os.environ:
        timeout = datetime.timedelta(seconds=collective_timeout_s())
        pg_backend = process_group_spec(backend)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        # init_process_group's own env:// rendezvous, done here to mark its end apart from
        # the backends' set-up (NCCL's communicator): the same store, the same prefix.
        await_store_host(env, timeout.total_seconds())
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        store.set_timeout(timeout)
        mark("store_ready")
        dist.init_process_group(backend=pg_backend, timeout=timeout, rank=rank,
                                world_size=world, store=dist.PrefixStore("default_pg", store),
                                **kwargs)
        mark("default_group_ready")
        # Checkpoint collectives run on their own gloo group, in the async-save thread, so
        # they never queue behind (or interleave with) the training step's collectives.
        ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
        control_group = dist.new_group(backend="gloo", timeout=timeout)
        return DistContext(rank, local_rank, world, device, backend, ckpt_group, control_group,
                           marks)
    return DistContext(rank, local_rank, world, device, backend, ckpt_group, marks=marks)


def _store_address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """The rendezvous store's (address, port) from ``env``; None with an agent store (the
    agent serves it) or for values out of bounds (the rank's own rendezvous then says what
    is wrong)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
        return None
    try:
        port = ec.get_int(env, "MASTER_PORT", None, minimum=1)
    except ec.EnvError:
        return None
    addr = env.get("MASTER_ADDR")
    return (addr, port) if addr and port is not None and port <= 65535 else None


def store_spec(env: Mapping[str, str]) -> tuple[str, int, int] | None:
    """The rendezvous store this rank hosts in the generation ``env`` describes: (address,
    port, world size) for RANK 0 without an agent store, None otherwise or for values out
    of bounds (the rank's own rendezvous then says what is wrong)."""
    where = _store_address(env)
    try:
        rank = ec.get_int(env, "RANK", None, minimum=0)
        world = ec.get_int(env, "WORLD_SIZE", None, minimum=1)
    except ec.EnvError:
        return None
    if where is None or rank != 0 or world is None:
        return None
    return (*where, world)


# How often a rank that does not host the rendezvous store looks for the host's port.
_STORE_PROBE_S = 0.01


def await_store_host(env: Mapping[str, str], timeout_s: float) -> None:
    """Wait until the rendezvous store's host (``MASTER_ADDR``:``MASTER_PORT``) accepts
    connections, probing every 10 ms, when this rank is not the host. TCPStore's own client
    retries with a growing delay: a surviving rank 1 reached a replacement rank 0's store
    0.74 s after the server came up on 2 x H200 (0.4 s on this CPU), and the whole recovery
    waited for it. A probe that connects and closes is no worker to the store. Raises
    ``TimeoutError`` naming the address when the host is not up within ``timeout_s``."""
    where = _store_address(env)
    if where is None or store_spec(env) is not None:
        return
    addr, port = where
    probe = tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s),
                              wait=tenacity.wait_fixed(_STORE_PROBE_S),
                              retry=tenacity.retry_if_exception_type(OSError), reraise=True)
    try:
        for attempt in probe:
            with attempt:
                socket.create_connection((addr, port), timeout=1.0).close()
    except OSError as exc:
        raise TimeoutError(f"the rendezvous store at {addr}:{port} did not accept a "
                           f"connection within {timeout_s:.0f} s: {exc}") from exc


def host_store_ahead(env: dict[str, str]) -> dist.TCPStore | None:
    """Serve the rendezvous store of the generation ``env`` describes now, when this rank
    hosts it (:func:`store_spec`), and return it; None otherwise.

    A peer that reaches the rendezvous before the store's host (a warm replacement, while a
    surviving rank 0 still aborts its old groups) is a TCPStore client that retries with a
    growing delay: it connected 0.2-0.6 s after the server came up on this CPU, and the
    next group formed 1.2-2.3 s after both ranks had arrived on 2 x H200 when the survivor
    hosted the store, against 0.5 s when the replacement did. ``init_process_group``'s
    env:// rendezvous makes rank 0's store multi-tenant, so it reuses this server while the
    returned object lives: keep it until the group is made."""
    spec = store_spec(env)
    if spec is None:
        return None
    addr, port, world = spec
    return dist.TCPStore(addr, port, world, True, wait_for_workers=False, multi_tenant=True,
                         timeout=datetime.timedelta(seconds=collective_timeout_s()))


def new_memory_group(dctx: DistContext) -> dist.ProcessGroup | None:
    """The memory tier's own gloo group (None without process groups): partner copies
    travel in the tier's commit thread, never beside the training thread's or the async
    save's collectives. Made right after ``init_distributed``'s groups, by a starting rank
    and by a survivor rejoining in place alike (the group names must match)."""
    if dctx.ckpt_group is None:
        return None
    return dist.new_group(backend="gloo",
                          timeout=datetime.timedelta(seconds=collective_timeout_s()))


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def teardown(dctx: DistContext | None = None) -> None:
    """Destroy the process groups; with ``dctx`` (a run that completed), first wait for
    every rank on the control group. NCCL's teardown waits for every peer anyway; the
    barrier makes every backend end the same way (a CPU run shows a GPU run's end), and
    rank 0, which hosts the rendezvous store and commits the final checkpoint, is the
    last to leave, not one its peers' teardown may still need."""
    if not dist.is_initialized():
        return
    if dctx is not None and dctx.control_group is not None:
        dist.barrier(group=dctx.control_group)
    dist.destroy_process_group()
