"""The ``deploy:`` section: what ``orchestrator deploy kubernetes|slurm|sagemaker`` needs
beyond the job itself (the image, the pods' resources and placement, the sbatch header, the
SageMaker request). Sizes are never set here: pod count, ``--procs``, ``--nodes`` and the
instance count all come from ``cluster`` (nodes, spares, procs_per_node), so one job.yaml
decides them everywhere."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Kubernetes' quantity syntax (resource.Quantity): "90", "500m", "1000Gi", "1.5e3".
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|m|k)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]"
                        r"{0,61}[A-Za-z0-9])?$")
_S3 = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$")
_SBATCH_VALUE = re.compile(r"^[^\s'\"\\$`;#]{1,200}$")
_RESERVED_MOUNTS = ("/", "/dev/shm", "/etc/orchestrator", "/var/run/orchestrator",
                    "/var/run/orchestrator-secret", "/scratch")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class Toleration(_Section):
    """A pod toleration (Kubernetes' own fields)."""

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    def manifest(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def _quantity(v: str | None) -> str | None:
    if v is not None and not _QUANTITY.match(v):
        raise ValueError(f"{v!r} is not a Kubernetes quantity (90, 500m, 1000Gi)")
    return v


class KubernetesDeploy(_Section):
    """The pods: one supervisor Job, one Indexed Job of agents (a pod per node)."""

    namespace: str = Field("training", description="Namespace of every object.")
    accelerator_resource: str | None = Field(
        None, description="Extended resource a rank's accelerator is (default by "
        "cluster.accelerator: nvidia.com/gpu for cuda, aws.amazon.com/neuroncore for neuron, "
        "none for cpu); each agent pod asks for cluster.procs_per_node of them.")
    efa: int = Field(0, ge=0, le=64, description="vpc.amazonaws.com/efa devices per agent "
                                                 "pod (0: none).")
    cpu: str | None = Field(None, description="CPU request of an agent pod (e.g. '90').")
    memory: str | None = Field(None, description="Memory request of an agent pod (e.g. "
                                                 "'1000Gi').")
    shm_size: str = Field("64Gi", description="Size of /dev/shm (memory-backed) per agent "
                                              "pod: DataLoader workers and the memory tier.")
    cache_host_path: str = Field(
        "/var/cache/orchestrator", description="Node-local directory (hostPath) for the "
        "compile caches (Neuron, inductor, torch extensions): never a shared filesystem.")
    host_paths: dict[str, str] = Field(
        default_factory=dict, description="More node-local directories for the agent pods: "
        "path in the pod -> directory on the node (the paths job.env and health.scratch_dir "
        "name, e.g. a local NVMe).")
    service_account: str | None = Field(
        None, description="Service account of every pod (S3 access through IRSA or EKS "
        "Pod Identity); created by the manifests when role_arn is set.")
    role_arn: str | None = Field(
        None, description="IAM role for the service account (annotation "
        "eks.amazonaws.com/role-arn).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node selector of the agent pods (e.g. "
        "node.kubernetes.io/instance-type: p5.48xlarge).")
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations of the agent pods (the taints of "
        "accelerator nodes).")
    runs_storage: str = Field("10Gi", description="Size of the supervisor's run-directory "
                                                  "volume (journal, logs).")
    storage_class: str | None = Field(None, description="Storage class of that volume "
                                                        "(default: the cluster's).")
    supervisor_restarts: int = Field(
        10, ge=0, le=1000, description="Times a crashed supervisor pod is replaced (each "
        "resumes the run: up --resume) before the Job fails (backoffLimit).")

    @field_validator("cpu", "memory", "shm_size", "runs_storage", mode="before")
    @classmethod
    def _quantities(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            v = str(v)  # YAML reads `cpu: 90` as a number
        return _quantity(v) if isinstance(v, str) else v

    @field_validator("namespace", "service_account", "storage_class")
    @classmethod
    def _dns_label(cls, v: str | None) -> str | None:
        if v is not None and not _DNS_LABEL.match(v):
            raise ValueError(f"{v!r}: lowercase letters, digits and '-' (a DNS label)")
        return v

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _LABEL_KEY.match(key) or len(value) > 63:
                raise ValueError(f"{key!r}: {value!r} is not a node label")
        return v

    @field_validator("cache_host_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or "\0" in v:
            raise ValueError("an absolute path on the node")
        return v

    @field_validator("host_paths")
    @classmethod
    def _paths(cls, v: dict[str, str]) -> dict[str, str]:
        for inside, node in v.items():
            for path in (inside, node):
                if not path.startswith("/") or "\0" in path or len(path) > 4096:
                    raise ValueError(f"{inside!r}: {node!r}: absolute paths")
            if inside in _RESERVED_MOUNTS or inside.startswith("/scratch/"):
                raise ValueError(f"{inside!r} is where the pods mount their own volumes")
        return v


class SlurmDeploy(_Section):
    """The sbatch header (#SBATCH lines) beyond the sizes the cluster section decides."""

    job_name: str | None = Field(None, description="--job-name (default: job.name).")
    partition: str | None = Field(None, description="--partition.")
    account: str | None = Field(None, description="--account.")
    time: str | None = Field(None, description="--time (e.g. 2-00:00:00).")
    gpus_per_node: bool = Field(
        True, description="Ask for cluster.procs_per_node GPUs a node (--gpus-per-node) "
        "when cluster.accelerator is cuda.")
    exclusive: bool = Field(True, description="--exclusive: whole nodes for the job.")
    requeue: bool = Field(
        False, description="--requeue and the requeue-aware start: a requeued run resumes "
        "(run_dir must then be on shared storage).")
    run_dir: str | None = Field(
        None, description="Run directory (default: ./runs/<slurm job id>; with requeue, a "
        "directory on shared storage holding one run per start).")
    python: str = Field("python3", description="The interpreter with the orchestrator "
                                               "installed, on every node.")

    @field_validator("job_name", "partition", "account", "time")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        if v is not None and not _SBATCH_VALUE.match(v):
            raise ValueError(f"{v!r}: no spaces, quotes or shell characters")
        return v


class SageMakerDeploy(_Section):
    """The CreateTrainingJob request (`orchestrator deploy sagemaker`, `sagemaker submit`)."""

    instance_type: str | None = Field(None, description="e.g. ml.p5.48xlarge, "
                                                        "ml.trn1.32xlarge.")
    role_arn: str | None = Field(None, description="IAM role the training job runs as.")
    output_s3: str | None = Field(None, description="s3:// prefix for the config, the model "
                                                    "and the run directory.")
    volume_gb: int = Field(200, ge=1, le=16384, description="EBS volume per instance, GB.")
    max_runtime_s: int = Field(5 * 24 * 3600, ge=1, le=28 * 24 * 3600,
                               description="MaxRuntimeInSeconds.")

    @field_validator("output_s3")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is not None and not _S3.match(v):
            raise ValueError("an s3://bucket/prefix URI")
        return v


class DeployConfig(_Section):
    """What `orchestrator deploy` renders from this job.yaml (Kubernetes manifests, an sbatch
    file, a SageMaker request); the job itself never reads it."""

    image: str = Field("orchestrator:0.1.0", min_length=1, max_length=255,
                       description="The container image (deploy/container), in your "
                                   "registry: REGISTRY/orchestrator:TAG.")
    kubernetes: KubernetesDeploy = Field(default_factory=KubernetesDeploy)
    slurm: SlurmDeploy = Field(default_factory=SlurmDeploy)
    sagemaker: SageMakerDeploy = Field(default_factory=SageMakerDeploy)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if any(c.isspace() for c in v):
            raise ValueError("an image reference has no spaces")
        return v
