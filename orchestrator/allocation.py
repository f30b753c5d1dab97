"""Does the allocation this process runs in fit the job's config?

Slurm, Kubernetes and SageMaker each size the job their own way (``sbatch --nodes``, an
Indexed Job's pods, the instance count) while the config says ``cluster.nodes``,
``cluster.spares`` and ``cluster.procs_per_node``. ``orchestrator deploy`` renders them from
the config; this module checks a running allocation against it, from the variables each
platform sets, and says what disagrees in one line. ``validate`` prints it; the supervisor
journals it as a ``config`` failure before it starts anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.contracts.env import NODE_COUNT

if TYPE_CHECKING:
    from orchestrator.config.schema import Config


@dataclass(frozen=True)
class Allocation:
    """What the platform gave: its name and the sizes it reports (None: not reported)."""

    platform: str
    nodes: int | None = None
    tasks_per_node: int | None = None
    devices_per_node: int | None = None
    pod_index: int | None = None


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = (env.get(name) or "").strip()
        # Slurm writes per-node counts as "2(x3)" when they repeat: the first is ours.
        raw = raw.split("(", 1)[0].split(",", 1)[0]
        if raw.isascii() and raw.isdigit():  # "²" is a digit to str.isdigit, not to int
            return int(raw)
    return None


def detect(env: Mapping[str, str]) -> Allocation | None:
    """The allocation the environment describes, or None outside one."""
    if env.get("SLURM_JOB_ID"):
        return Allocation("slurm", nodes=_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
                          tasks_per_node=_int(env, "SLURM_NTASKS_PER_NODE",
                                              "SLURM_TASKS_PER_NODE"),
                          devices_per_node=_int(env, "SLURM_GPUS_ON_NODE"))
    if env.get("JOB_COMPLETION_INDEX") is not None and env.get("KUBERNETES_SERVICE_HOST"):
        return Allocation("kubernetes", nodes=_int(env, NODE_COUNT),
                          pod_index=_int(env, "JOB_COMPLETION_INDEX"))
    hosts = env.get("SM_HOSTS")
    if hosts:
        try:
            count = len(json.loads(hosts))
        except (ValueError, TypeError):
            count = None
        return Allocation("sagemaker", nodes=count,
                          devices_per_node=_int(env, "SM_NUM_GPUS"))
    return None


def mismatch(cfg: Config, env: Mapping[str, str]) -> str | None:
    """One line saying how the running allocation disagrees with ``cfg``; None when it fits
    or when there is none to check."""
    alloc = detect(env)
    if alloc is None:
        return None
    c = cfg.cluster
    need = c.nodes + c.spares
    wants = f"cluster.nodes {c.nodes} + cluster.spares {c.spares} = {need} node(s)"
    render = f"(orchestrator deploy {alloc.platform} renders it from the config)"
    # GPUs are counted per rank; a Neuron device holds several cores (ranks): not compared.
    accel = c.accelerator == "cuda"
    if alloc.platform == "slurm":
        per = cfg.launcher.slurm.agents_per_node
        if alloc.nodes is not None and alloc.nodes * per < need:
            return (f"the Slurm allocation has {alloc.nodes} node(s) x {per} agent(s) "
                    f"(launcher.slurm.agents_per_node); the job needs {wants}: submit with "
                    f"sbatch --nodes={-(-need // per)} {render}")
        if accel and alloc.devices_per_node is not None \
                and alloc.devices_per_node < c.procs_per_node * per:
            return (f"the Slurm allocation gives {alloc.devices_per_node} GPU(s) a node; "
                    f"cluster.procs_per_node {c.procs_per_node} needs "
                    f"{c.procs_per_node * per}: sbatch --gpus-per-node={c.procs_per_node} "
                    f"{render}")
    elif alloc.platform == "kubernetes":
        if alloc.nodes is not None and alloc.nodes != need:
            return (f"the agents' Indexed Job was rendered for {alloc.nodes} pod(s) "
                    f"({NODE_COUNT}); the job's config wants {wants}: render the manifests "
                    f"again from this config {render}")
        if alloc.pod_index is not None and alloc.pod_index >= need:
            return (f"this pod's completion index {alloc.pod_index} is past the job's {wants}:"
                    f" the Indexed Job's completions exceed the config {render}")
    elif alloc.platform == "sagemaker":
        if alloc.nodes is not None and alloc.nodes - c.spares < 1:
            return (f"the training job has {alloc.nodes} instance(s): none is left for a node "
                    f"after cluster.spares {c.spares}: --instance-count {c.spares + 1} at "
                    f"least {render}")
        if accel and alloc.devices_per_node is not None \
                and alloc.devices_per_node < c.procs_per_node:
            return (f"each instance has {alloc.devices_per_node} GPU(s); "
                    f"cluster.procs_per_node is {c.procs_per_node}: choose an instance type "
                    "with as many, or lower procs_per_node")
    return None
