"""``orchestrator deploy sagemaker``: the CreateTrainingJob request for one job, from its
config (instance count = ``cluster.nodes + cluster.spares``; type, role, S3 prefixes and
limits from ``deploy.sagemaker``; the image from ``deploy.image``), with the token hidden,
and the config file its ``config`` channel carries. ``orchestrator sagemaker submit`` sends
the same request (checked by the same ``plan``)."""

from __future__ import annotations

import json
import re
from typing import Any

from orchestrator.config.schema import Config
from orchestrator.launchers.sagemaker_submit import (
    Plan,
    PlanError,
    plan,
    redacted,
    training_job_request,
)
from orchestrator.render import job_yaml


def default_job_name(cfg: Config) -> str:
    """job.name as SageMaker spells a training job's name (letters, digits, '-')."""
    return re.sub(r"[^A-Za-z0-9-]+", "-", cfg.job.name).strip("-")[:63] or "orchestrator"


def planned(cfg: Config, data: dict[str, Any], source: str, job_name: str | None) -> Plan:
    sm = cfg.deploy.sagemaker
    missing = [f"deploy.sagemaker.{k}" for k in ("instance_type", "role_arn", "output_s3")
               if getattr(sm, k) is None]
    if missing:
        raise PlanError([f"{k}: not set (the request needs it)" for k in missing])
    assert sm.instance_type and sm.role_arn and sm.output_s3  # narrowed above
    return plan(data, source, job_name=job_name or default_job_name(cfg),
                image=cfg.deploy.image, instance_type=sm.instance_type,
                instance_count=cfg.cluster.nodes + cfg.cluster.spares, role_arn=sm.role_arn,
                output_s3=sm.output_s3, checkpoint_s3=None, max_runtime_s=sm.max_runtime_s,
                volume_gb=sm.volume_gb)


def render(cfg: Config, data: dict[str, Any], source: str,
           job_name: str | None = None) -> tuple[dict[str, str], list[str]]:
    """({"request.json": ..., "job.yaml": ...}, notes); PlanError when it cannot run."""
    p = planned(cfg, data, source, job_name)
    request = redacted(training_job_request(p.spec, "***"))
    files = {"request.json": json.dumps(request, indent=2) + "\n",
             "job.yaml": job_yaml("sagemaker", source, data, {"launcher.kind": "sagemaker"})}
    return files, p.notes
