"""``orchestrator sagemaker submit|host``: send a job to SageMaker; run inside one."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

sagemaker_app = typer.Typer(help="Run jobs as SageMaker training jobs.", no_args_is_help=True)
err = Console(stderr=True)


@sagemaker_app.command("submit")
def submit(
    config: Annotated[Path, typer.Argument(help="Config YAML for the job.")],
    image: Annotated[str, typer.Option(help="Image URI in ECR (deploy/container).")],
    instance_type: Annotated[str, typer.Option(help="e.g. ml.p5.48xlarge, ml.trn1.32xlarge.")],
    instance_count: Annotated[int, typer.Option(help="Instances (cluster.nodes + spares).")],
    role: Annotated[str, typer.Option(help="IAM role ARN SageMaker runs the job as.")],
    output_s3: Annotated[str, typer.Option(
        help="s3:// prefix for the config, the model and the run directory.")],
    checkpoint_s3: Annotated[str | None, typer.Option(
        help="s3:// prefix /opt/ml/checkpoints syncs with (default: OUTPUT_S3/JOB/checkpoints)."
    )] = None,
    job_name: Annotated[str | None, typer.Option(
        help="Training job name (default: the config's job.name and a timestamp).")] = None,
    max_runtime: Annotated[int, typer.Option(help="MaxRuntimeInSeconds.")] = 5 * 24 * 3600,
    volume_gb: Annotated[int, typer.Option(help="EBS volume per instance, GB.")] = 200,
    region: Annotated[str | None, typer.Option(help="AWS region (default: the AWS chain's).")]
        = None,
    endpoint_url: Annotated[str | None, typer.Option(
        help="SageMaker/S3 endpoint (a local moto server in tests).", hidden=True)] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a config field (repeatable).")] = None,
    dry_run: Annotated[bool, typer.Option(
        help="Print the CreateTrainingJob request (token hidden) and send nothing.")] = False,
) -> None:
    """Validate CONFIG as the instances will run it, upload it, and create a SageMaker
    training job running it (--dry-run: print the request and what to know about it)."""
    from orchestrator.config import ConfigError, validate_data
    from orchestrator.config.loader import apply_overrides, read_yaml
    from orchestrator.launchers.sagemaker_submit import PlanError, plan, redacted
    from orchestrator.launchers.sagemaker_submit import submit as send
    from orchestrator.launchers.sagemaker_submit import training_job_request

    try:
        data = apply_overrides(read_yaml(config), overrides or [])
    except ConfigError as exc:
        err.print(f"[red]config error[/red] {exc}", highlight=False, markup=False)
        raise typer.Exit(2) from None
    name = (data.get("job") or {}).get("name") or "local"
    name = job_name or f"{str(name).replace('_', '-').replace('.', '-')}-" \
                       f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    try:
        checked = plan(data, str(config), job_name=name, image=image,
                       instance_type=instance_type, instance_count=instance_count,
                       role_arn=role, output_s3=output_s3, checkpoint_s3=checkpoint_s3,
                       max_runtime_s=max_runtime, volume_gb=volume_gb)
    except PlanError as exc:
        for problem in exc.problems:
            err.print(f"[red]error[/red] {problem}", highlight=False)
        raise typer.Exit(2) from None
    for note in checked.notes:
        err.print(note, highlight=False, markup=False)
    spec = checked.spec
    request = training_job_request(spec, secrets.token_urlsafe(32))
    if dry_run:
        print(json.dumps(redacted(request), indent=2))
        raise typer.Exit(0)
    import yaml

    from orchestrator.extras import MissingExtra, require

    try:
        require("boto3", "sagemaker submit (CreateTrainingJob)")
    except MissingExtra as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False, markup=False)
        raise typer.Exit(2) from None
    try:  # the resolved config travels, as the instances will read it
        body = yaml.safe_dump(validate_data(data, str(config)).model_dump(mode="json"),
                              sort_keys=False)
    except ConfigError as exc:
        err.print(f"[red]config error[/red] {exc}", highlight=False, markup=False)
        raise typer.Exit(2) from None
    arn = send(request, spec, body, region=region, endpoint_url=endpoint_url)
    print(arn)


@sagemaker_app.command("host")
def host(
    config: Annotated[Path | None, typer.Argument(
        help="Config YAML (default: the one file of the job's config channel).")] = None,
) -> None:
    """Inside a SageMaker training job: the first host supervises, every host runs an agent."""
    from orchestrator.cli.checkpoints import export_hf
    from orchestrator.cli.control import run_agent
    from orchestrator.cli.up import run_up
    from orchestrator.config import ConfigError, load_config
    from orchestrator.launchers import sagemaker as sm_launcher

    try:
        sm = sm_launcher.read_env(os.environ)
        path = config or sm_launcher.find_config(sm.config_channel)
        cfg = load_config(path, [])
    except (sm_launcher.SageMakerEnvError, ConfigError, FileNotFoundError) as exc:
        err.print(f"[red]error[/red] {exc}")
        raise typer.Exit(2) from None
    port = cfg.launcher.sagemaker.port
    if not sm.is_leader:
        raise typer.Exit(run_agent(sm.head_url(port), sm.current_host, sm.current_host,
                                   cfg.cluster.procs_per_node, sm.run_dir, None,
                                   sm_launcher.SAGEMAKER_ORPHAN_TIMEOUT_S))
    try:
        sets = sm_launcher.leader_overrides(sm, port=port, spares=cfg.cluster.spares,
                                            checkpoint_url=cfg.checkpoint.url)
    except sm_launcher.SageMakerEnvError as exc:
        sm_launcher.write_failure(sm, str(exc))
        err.print(f"[red]error[/red] {exc}")
        raise typer.Exit(2) from None
    code = run_up(path, sm.run_dir, sets, detach=False, resume=None, chaos_kill_at=[])
    if code != 0:
        sm_launcher.write_failure(sm, f"the job did not complete (exit {code}); see "
                                      f"{sm.run_dir} in the job's output.tar.gz")
        raise typer.Exit(code)
    if cfg.job.entrypoint is None:  # the built-in trainer's checkpoints export to HF format
        url = cfg.checkpoint.url if (cfg.checkpoint.url or "").startswith("s3://") \
            else str(sm.checkpoint_dir)
        code = export_hf(f"{url.rstrip('/')}/{cfg.job.name}", sm.model_dir, "float32", None)
        if code != 0:
            sm_launcher.write_failure(sm, "the job completed but exporting the model failed")
    raise typer.Exit(code)
