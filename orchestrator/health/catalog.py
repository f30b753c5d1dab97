"""Every health check the orchestrator knows, in the order a node runs them.

Reading this module imports no check code (functions are named, not imported), so the
supervisor's metrics can create one failure series per check at start-up and the config can
validate check names cheaply. Timeouts here are defaults; ``health.timeouts`` overrides them.
"""

from __future__ import annotations

from orchestrator.health.base import Check, Level, Severity

_F, _W = Severity.FATAL, Severity.WARN
_Q, _FULL = Level.QUICK, Level.FULL
_ACC = "orchestrator.health.accelerators"
_HOST = "orchestrator.health.host"
_NEURON = "orchestrator.health.neuron"

CHECKS: tuple[Check, ...] = (
    # -- accelerators (skipped on CPU jobs) --------------------------------------------------
    Check("accelerator.inventory", _F, _Q, 60, "node",
          "Accelerator count and type against the config (NVML or torch.cuda; neuron-ls).",
          f"{_ACC}:check_inventory"),
    Check("accelerator.ecc", _F, _Q, 30, "node",
          "No uncorrectable ECC error since the driver loaded (NVML volatile counters).",
          f"{_ACC}:check_ecc"),
    Check("accelerator.memory_retirement", _F, _Q, 30, "node",
          "No page retirement or row remapping pending a reset, none failed (NVML).",
          f"{_ACC}:check_memory_retirement"),
    Check("accelerator.xid", _F, _Q, 30, "node",
          "No critical XID event in the kernel log (hardware errors, fallen off the bus).",
          f"{_ACC}:check_xid"),
    Check("accelerator.memory_test", _F, _FULL, 180, "node",
          "Allocate device memory on every device, write patterns, read them back.",
          f"{_ACC}:check_memory_test"),
    Check("accelerator.matmul", _F, _FULL, 180, "node",
          "bf16 matmul throughput per device against a floor and the node's fastest device.",
          f"{_ACC}:check_matmul"),
    Check("neuron.compile_cache", _W, _Q, 15, "node",
          "The Neuron compile cache is on a local disk, not a shared filesystem.",
          f"{_NEURON}:check_compile_cache"),
    Check("neuron.nccom", _F, _FULL, 300, "node",
          "nccom-test all-reduce across the node's NeuronCores (when installed).",
          f"{_NEURON}:check_nccom"),
    # -- host and storage ----------------------------------------------------------------------
    Check("host.python_modules", _F, _Q, 30, "node",
          "The optional Python modules the job needs (s3fs for s3://, safetensors, pyarrow, "
          "...) are installed; a missing one names the extra to install.",
          f"{_HOST}:check_modules"),
    Check("host.disk", _F, _Q, 30, "node",
          "Free disk on the checkpoint and scratch directories above the floor; both writable.",
          f"{_HOST}:check_disk"),
    Check("host.memory", _F, _Q, 10, "node",
          "Available host memory above the floor.", f"{_HOST}:check_memory"),
    Check("host.shared_fs", _F, _Q, 30, "node",
          "The checkpoint root is one shared filesystem: every node reads the head's file and "
          "the head reads every node's.", f"{_HOST}:check_shared_fs"),
    Check("storage.checkpoint", _F, _Q, 60, "node",
          "The checkpoint root (path or s3://) takes a write and returns the same bytes.",
          f"{_HOST}:check_storage"),
    # -- judged on the supervisor ---------------------------------------------------------------
    Check("host.clock_skew", _F, _Q, 0, "head",
          "The node's wall clock agrees with the supervisor's within the floor."),
    Check("agent.report", _F, _Q, 0, "head",
          "The node's agent reported its checks before the round's deadline."),
    # -- across nodes: ranks of a short health generation ---------------------------------------
    Check("network.allreduce", _F, _FULL, 120, "network",
          "All-reduce bus bandwidth across every rank (NCCL on GPUs, gloo otherwise)."),
    Check("network.pairwise", _F, _FULL, 120, "network",
          "Node-to-node bandwidth around a ring; a node whose every link is slow is named."),
)

BY_NAME: dict[str, Check] = {c.name: c for c in CHECKS}
CHECK_NAMES: tuple[str, ...] = tuple(BY_NAME)


def node_checks(level: Level) -> list[Check]:
    """The checks a node runs itself at ``level``, in order."""
    return [c for c in CHECKS if c.where == "node" and c.runs_at(level)]


def get(name: str) -> Check:
    """The check named ``name`` (KeyError names the unknown check)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown health check {name!r}") from None
