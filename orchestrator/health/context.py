"""What one node needs to run its checks: everything resolved by the supervisor.

The supervisor builds a ``NodeContext`` per node and sends it in the node's assignment; the
agent hands it unchanged to its check process. Nodes therefore need no config of their own
and every node of a round checks against the same floors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.health.base import Level
from orchestrator.health.config import HealthConfig, HealthFloors

Accelerator = Literal["cpu", "cuda", "neuron", "auto"]


class SharedFsProbe(BaseModel):
    """The head wrote ``content`` to ``path``; the node reads it and writes its own file."""

    model_config = ConfigDict(extra="forbid")

    path: str
    content: str
    write_path: str


class NodeContext(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nonce: str
    node_id: str
    level: Level
    checks: list[str]  # names, in the order to run them
    timeouts: dict[str, float]  # seconds per check in ``checks``
    accelerator: Accelerator = "cpu"
    devices: int = Field(0, ge=0)  # accelerators the node must have (ranks per node)
    expect_device_name: str | None = None
    checkpoint_root: str = ""
    scratch_dir: str | None = None  # None: the node's temp dir
    floors: HealthFloors = Field(default_factory=HealthFloors)
    memtest_gib: float = 1.0
    matmul_size: int = 8192
    shared_fs: SharedFsProbe | None = None
    shared_fs_note: str = ""  # why there is no probe (s3 root, one node, head cannot write)
    job_env: dict[str, str] = Field(default_factory=dict)
    # Optional module -> what of the job needs it (``orchestrator.extras.needs``).
    modules: dict[str, str] = Field(default_factory=dict)
    chaos_fail: list[str] = Field(default_factory=list)
    chaos_hang: list[str] = Field(default_factory=list)


def build_node_context(health: HealthConfig, *, nonce: str, node_id: str, level: Level,
                       checks: list[str], accelerator: Accelerator, devices: int,
                       checkpoint_root: str, shared_fs: SharedFsProbe | None = None,
                       shared_fs_note: str = "",
                       job_env: dict[str, str] | None = None,
                       modules: dict[str, str] | None = None) -> NodeContext:
    """A node's context from the ``health`` config section (``{node_id}`` expanded)."""
    scratch = health.scratch_dir.replace("{node_id}", node_id) if health.scratch_dir else None
    return NodeContext(
        nonce=nonce, node_id=node_id, level=level, checks=checks,
        timeouts={name: health.timeout_of(name) for name in checks},
        accelerator=accelerator, devices=devices,
        expect_device_name=health.expect_device_name, checkpoint_root=checkpoint_root,
        scratch_dir=scratch, floors=health.floors, memtest_gib=health.memtest_gib,
        matmul_size=health.matmul_size, shared_fs=shared_fs, shared_fs_note=shared_fs_note,
        job_env=dict(job_env or {}), modules=dict(modules or {}),
        chaos_fail=list(health.chaos.fail.get(node_id, [])),
        chaos_hang=list(health.chaos.hang.get(node_id, [])))
