"""``orchestrator sagemaker submit``: a SageMaker ``CreateTrainingJob`` request for a config.

The config travels as the job's ``config`` input channel (one YAML file under the output
prefix, which SageMaker copies to ``/opt/ml/input/data/config/`` on every host), the image's
``orchestrator sagemaker host`` is the container entrypoint on every instance, checkpoints
sync between ``/opt/ml/checkpoints`` and ``checkpoint_s3``, and the job's token is generated
here and handed over in the job's environment (``ORCH_TOKEN``; shown as ``***`` by
``--dry-run``). boto3 does the signing and sending; nothing here speaks HTTP itself.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.contracts.env import TOKEN

CONTAINER_ENTRYPOINT = ["orchestrator", "sagemaker", "host"]
CONFIG_CHANNEL = "config"
REDACTED = "***"

_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's own pattern
_ROLE_ARN = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
_INSTANCE = re.compile(r"^ml\.[a-z0-9]+[a-z0-9\-]*\.[a-z0-9]+$")
_S3 = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$")


class SubmitSpec(BaseModel):
    """Everything ``submit`` was told, checked before any request is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_name: str
    image: str = Field(min_length=1, max_length=255)
    instance_type: str
    instance_count: int = Field(ge=1, le=1000)
    role_arn: str
    output_s3: str
    checkpoint_s3: str | None  # None: the config's checkpoint.url is s3://, nothing to sync
    max_runtime_s: int = Field(ge=1, le=28 * 24 * 3600)  # SageMaker's ceiling: 28 days
    volume_gb: int = Field(ge=1, le=16384)

    @field_validator("job_name")
    @classmethod
    def _job_name(cls, v: str) -> str:
        if not _JOB_NAME.match(v):
            raise ValueError("1-63 letters, digits and '-', not starting with '-'")
        return v

    @field_validator("instance_type")
    @classmethod
    def _instance(cls, v: str) -> str:
        if not _INSTANCE.match(v):
            raise ValueError("a SageMaker instance type, e.g. ml.p5.48xlarge")
        return v

    @field_validator("role_arn")
    @classmethod
    def _role(cls, v: str) -> str:
        if not _ROLE_ARN.match(v):
            raise ValueError("an IAM role ARN, arn:aws:iam::123456789012:role/Name")
        return v

    @field_validator("output_s3", "checkpoint_s3")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not _S3.match(v):
            raise ValueError("an s3://bucket/prefix URI")
        return v.rstrip("/")

    @property
    def config_prefix(self) -> str:
        return f"{self.output_s3}/{self.job_name}/{CONFIG_CHANNEL}"

    @property
    def config_key(self) -> tuple[str, str]:
        """(bucket, key) of the config file the request's channel points at."""
        bucket, _, prefix = self.config_prefix.removeprefix("s3://").partition("/")
        return bucket, f"{prefix}/job.yaml" if prefix else "job.yaml"


def training_job_request(spec: SubmitSpec, token: str) -> dict[str, Any]:
    """The ``CreateTrainingJob`` parameters (boto3's keyword arguments) for ``spec``."""
    request = {
        "TrainingJobName": spec.job_name,
        "RoleArn": spec.role_arn,
        "AlgorithmSpecification": {
            "TrainingImage": spec.image,
            "TrainingInputMode": "File",
            "ContainerEntrypoint": list(CONTAINER_ENTRYPOINT),
        },
        "InputDataConfig": [{
            "ChannelName": CONFIG_CHANNEL,
            "DataSource": {"S3DataSource": {
                "S3DataType": "S3Prefix", "S3Uri": spec.config_prefix,
                "S3DataDistributionType": "FullyReplicated"}},
            "InputMode": "File",
        }],
        "OutputDataConfig": {"S3OutputPath": spec.output_s3},
        "ResourceConfig": {"InstanceType": spec.instance_type,
                           "InstanceCount": spec.instance_count,
                           "VolumeSizeInGB": spec.volume_gb},
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_runtime_s},
        "Environment": {TOKEN: token, "PYTHONUNBUFFERED": "1"},
    }
    if spec.checkpoint_s3 is not None:
        # SageMaker uploads /opt/ml/checkpoints to S3 as it changes and puts it back when a
        # (spot) job restarts: the supervisor then resumes from the newest checkpoint there.
        request["CheckpointConfig"] = {"S3Uri": spec.checkpoint_s3,
                                       "LocalPath": "/opt/ml/checkpoints"}
    return request


def redacted(request: dict[str, Any]) -> dict[str, Any]:
    """The request with the token hidden, for printing."""
    env = {k: (REDACTED if k == TOKEN else v)
           for k, v in request.get("Environment", {}).items()}
    return {**request, "Environment": env}


def submit(request: dict[str, Any], spec: SubmitSpec, config_yaml: str, *,
           region: str | None, endpoint_url: str | None = None) -> str:
    """Upload the config, then create the training job; returns the job's ARN."""
    import boto3

    session = boto3.session.Session(region_name=region)
    bucket, key = spec.config_key
    session.client("s3", endpoint_url=endpoint_url).put_object(
        Bucket=bucket, Key=key, Body=config_yaml.encode())
    answer = session.client("sagemaker", endpoint_url=endpoint_url).create_training_job(
        **request)
    return str(answer["TrainingJobArn"])


class Plan(BaseModel):
    """A checked submission: the spec, and what the operator should read before sending."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    spec: SubmitSpec
    notes: list[str]


class PlanError(ValueError):
    """The job cannot run as asked: every problem, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def plan(data: dict[str, Any], source: str, *, job_name: str, image: str, instance_type: str,
         instance_count: int, role_arn: str, output_s3: str, checkpoint_s3: str | None,
         max_runtime_s: int, volume_gb: int) -> Plan:
    """Check a submission the way the instances will run it, before anything is sent.

    The config is validated with ``cluster.nodes`` as the instances will set it (instance
    count minus ``cluster.spares``): a count that leaves no node, or one the config's other
    rules refuse, is a problem, not a note. Checkpoints: an ``s3://`` ``checkpoint.url`` is
    where they go (no CheckpointConfig to sync, and a ``checkpoint_s3`` given is ignored:
    said so); otherwise ``/opt/ml/checkpoints`` syncs with ``checkpoint_s3`` (default under
    the output prefix), each instance its own copy: several instances need an s3:// url or
    a filesystem mounted at that path on every host (said so)."""
    from orchestrator.config import ConfigError
    from orchestrator.config.loader import validate_data

    spares = int(((data.get("cluster") or {}).get("spares")) or 0)
    nodes = instance_count - spares
    if nodes < 1:
        raise PlanError([f"--instance-count {instance_count} leaves no node after "
                         f"cluster.spares {spares} (cluster.nodes would be {nodes}): ask "
                         f"for at least {spares + 1} instances"])
    runs_as = {**data, "cluster": {**(data.get("cluster") or {}), "nodes": nodes}}
    try:
        cfg = validate_data(runs_as, f"{source} with cluster.nodes={nodes}")
    except ConfigError as exc:
        raise PlanError([f"{p.path}: {p.message}" for p in exc.problems]) from None
    notes = []
    configured = (data.get("cluster") or {}).get("nodes")
    if configured is not None and configured != nodes:
        notes.append(f"cluster.nodes is {nodes} on the instances ({instance_count} instances "
                     f"minus {spares} spare(s)), not the config's {configured}")
    url = cfg.checkpoint.url or ""
    if url.startswith("s3://"):
        if checkpoint_s3:
            notes.append(f"--checkpoint-s3 {checkpoint_s3} is not used: checkpoints go to "
                         f"the config's checkpoint.url {url}")
        notes.append(f"checkpoints: {url}/{cfg.job.name} (checkpoint.url); no "
                     "CheckpointConfig, nothing under /opt/ml/checkpoints to sync")
        sync = None
    else:
        sync = checkpoint_s3 or f"{output_s3.rstrip('/')}/{job_name}/checkpoints"
        notes.append(f"checkpoints: /opt/ml/checkpoints on each instance, synced with {sync} "
                     "(CheckpointConfig; put back when a spot job restarts)")
        if instance_count > 1:
            notes.append(f"warning: {instance_count} instances each keep their own "
                         "/opt/ml/checkpoints; the ranks of one job must share checkpoints: "
                         "set checkpoint.url to an s3:// URL, unless a shared filesystem "
                         "(FSx) is mounted at /opt/ml/checkpoints on every host")
    try:
        spec = SubmitSpec(job_name=job_name, image=image, instance_type=instance_type,
                          instance_count=instance_count, role_arn=role_arn,
                          output_s3=output_s3.rstrip("/"), checkpoint_s3=sync,
                          max_runtime_s=max_runtime_s, volume_gb=volume_gb)
    except ValidationError as exc:
        raise PlanError([f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                         for e in exc.errors()]) from None
    return Plan(spec=spec, notes=notes)
