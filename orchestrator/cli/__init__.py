"""The ``orchestrator`` command line: parses, then hands off. No logic lives here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# -h and --help on every command (click hands the names down to each subcommand's context).
_CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="orchestrator",
    help="Fault-tolerant training orchestrator: keeps training productive through crashes, "
         "hangs, lost nodes and divergence.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings=_CONTEXT,
)
data_app = typer.Typer(help="Prepare training data.", no_args_is_help=True,
                       context_settings=_CONTEXT)
app.add_typer(data_app, name="data")
stability_app = typer.Typer(help="Training-stability detectors.", no_args_is_help=True,
                            context_settings=_CONTEXT)
app.add_typer(stability_app, name="stability")
ckpt_app = typer.Typer(help="List, verify, prune and sign checkpoints (paths or s3:// URLs).",
                       no_args_is_help=True, context_settings=_CONTEXT)
app.add_typer(ckpt_app, name="checkpoints")
config_app = typer.Typer(help="Show the config: resolved values with descriptions and "
                              "defaults, or the JSON schema.", no_args_is_help=True,
                         context_settings=_CONTEXT)
app.add_typer(config_app, name="config")
from orchestrator.cli.sagemaker import sagemaker_app

app.add_typer(sagemaker_app, name="sagemaker", context_settings=_CONTEXT)
deploy_app = typer.Typer(help="Render what a platform needs to run a job from its config "
                              "(sizes from cluster, the rest from the deploy: section).",
                         no_args_is_help=True, context_settings=_CONTEXT)
app.add_typer(deploy_app, name="deploy")


def _version(value: bool) -> None:
    if value:
        from orchestrator.cli.configdoc import package_version

        typer.echo(f"orchestrator {package_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print the version and exit.")] = False) -> None:
    """Fault-tolerant training orchestrator: keeps training productive through crashes, hangs,
    lost nodes and divergence."""

ConfigArg = Annotated[Path | None, typer.Argument(
    help="Config YAML (default: the embedded configs/local.yaml).", show_default=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override a field: --set trainer.steps=100 (repeatable).")]
RunDirArg = Annotated[Path | None, typer.Argument(
    help="Run directory (default: runs/latest).", show_default=False)]


@app.command()
def up(
    config: ConfigArg = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run directory to create and use.")] = None,
    overrides: SetOpt = None,
    detach: Annotated[bool, typer.Option(help="Run as a daemon; write a pid file.")] = False,
    resume: Annotated[Path | None, typer.Option(
        help="Restart the supervisor of an existing run (its agents keep training).")] = None,
    chaos_kill_at: Annotated[list[int] | None, typer.Option(
        help="SIGKILL a random rank once it reaches this step (repeatable).")] = None,
    log_format: Annotated[str, typer.Option(
        help="auto (a live progress line on a terminal, key=value lines otherwise), rich, "
             "plain, or json (log lines as JSON on stdout, for systemd and Kubernetes). The "
             "JSON log is always in RUN_DIR/supervisor.log.")] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Errors and the summary only.")]
    = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Every log line too.")]
    = False,
    standby: Annotated[bool, typer.Option(
        help="Wait as a standby supervisor (leader.etcd): take the job of --run-dir over when "
             "its leader's lease lapses.")] = False,
    advertise_host: Annotated[str | None, typer.Option(
        help="Address agents reach this supervisor at (default: launcher.advertise_host, "
             "else this host's name); a standby on another host has its own.")] = None,
) -> None:
    """Start the supervisor and run the job to completion; exit 0 only when it completed.

    `--resume RUN_DIR` continues a stopped job, or restarts the supervisor of a running one
    (its agents keep training). In a terminal a live progress line shows the step, loss,
    tokens/s, goodput, ETA and checkpoint age."""
    from orchestrator.cli.live import LogFormat, Verbosity
    from orchestrator.cli.up import run_up

    try:
        fmt = LogFormat(log_format)
    except ValueError:
        raise typer.BadParameter("must be auto, rich, plain or json",
                                 param_hint="--log-format") from None
    if quiet and verbose:
        raise typer.BadParameter("--quiet and --verbose exclude each other")
    verbosity = Verbosity.QUIET if quiet else Verbosity.VERBOSE if verbose else Verbosity.NORMAL
    raise typer.Exit(run_up(config, run_dir, overrides or [], detach=detach, resume=resume,
                            chaos_kill_at=chaos_kill_at or [], log_format=fmt,
                            verbosity=verbosity, standby=standby,
                            advertise_host=advertise_host))


@app.command()
def status(
    run_dir: RunDirArg = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch", "-w", help="Redraw every --interval seconds until the job ends.")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between redraws.")] = 2.0,
) -> None:
    """Show a job's state, progress, restarts, checkpoints and supervisor (live or after).

    Without RUN_DIR: runs/latest, the newest run started (with or without --run-dir)."""
    from orchestrator.cli.views import show_status

    raise typer.Exit(show_status(run_dir, json_out, watch=watch, interval=interval))


@app.command()
def down(
    run_dir: RunDirArg = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the stop.")] = 120.0,
    checkpoint: Annotated[bool, typer.Option(
        "--checkpoint/--no-checkpoint",
        help="Ask the ranks to commit a checkpoint at the next step boundary before they "
             "stop (default), or stop at once.")] = True,
) -> None:
    """Stop a running job (cause operator, final state STOPPED) after a final checkpoint.

    Continue it later with `orchestrator up --resume RUN_DIR`."""
    from orchestrator.cli.control import stop_job

    raise typer.Exit(stop_job(run_dir, timeout, checkpoint=checkpoint))


@app.command()
def profile(
    run_dir: RunDirArg = None,
    steps: Annotated[int, typer.Option(
        "--steps", "-n", min=1, max=200, help="Steps to profile (1-200).")] = 5,
    rank: Annotated[list[int] | None, typer.Option(
        "--ranks", "--rank", "-r", min=0,
        help="A rank to profile (repeatable; default: every rank).")] = None,
    wait: Annotated[bool, typer.Option(
        "--wait", help="Wait until every rank has written its trace.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits.")] = 600.0,
) -> None:
    """Profile the next N steps of a running job with torch.profiler (no restart).

    Traces (Chrome/Perfetto JSON) go to RUN_DIR/profiles/<first step>/rank-K/."""
    from orchestrator.cli.profile import profile_job

    raise typer.Exit(profile_job(run_dir, steps, rank, wait, timeout))


@app.command()
def logs(
    run_dir: RunDirArg = None,
    rank: Annotated[list[int] | None, typer.Option(
        "--rank", "-r", min=0, help="This rank's log (repeatable; default: rank 0).")] = None,
    all_ranks: Annotated[bool, typer.Option("--all", "-a", help="Every rank's log.")] = False,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing new lines, across restarts, until the job ends.")]
    = False,
    since: Annotated[str | None, typer.Option(
        help="Only generations started since then: a duration (10m, 2h) or a local time "
             "(2026-11-22 18:07).", show_default=False)] = None,
) -> None:
    """The ranks' output (every generation), each line prefixed \\[rankN]: like torchrun."""
    from orchestrator.cli.control import show_rank_logs

    if rank and all_ranks:
        raise typer.BadParameter("--rank and --all exclude each other")
    raise typer.Exit(show_rank_logs(run_dir, None if all_ranks else (rank or [0]), follow,
                                    since))


@config_app.command("show")
def config_show(
    config: ConfigArg = None,
    overrides: SetOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="The resolved values as JSON.")]
    = False,
) -> None:
    """The resolved config as YAML, each field with its description and default."""
    from orchestrator.cli.configdoc import show_config

    raise typer.Exit(show_config(config, overrides or [], json_out))


@config_app.command("schema")
def config_schema() -> None:
    """The config's JSON schema (point your editor's YAML validation at it)."""
    from orchestrator.cli.configdoc import print_schema

    raise typer.Exit(print_schema())


@app.command()
def validate(config: Annotated[Path, typer.Argument(help="Config YAML to check.")],
             overrides: SetOpt = None) -> None:
    """Check a config: print every problem with its dotted field; exit 1 if any."""
    from orchestrator.cli.views import validate_config

    raise typer.Exit(validate_config(config, overrides or []))


@app.command()
def health(
    config: ConfigArg = None,
    overrides: SetOpt = None,
    level: Annotated[str | None, typer.Option(
        help="quick or full (default: the config's health.preflight).",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    run_dir: Annotated[Path | None, typer.Option(
        help="Run directory for the journal and logs (default: runs/health-<job>-<time>).")]
    = None,
) -> None:
    """Run the cluster health checks now and print a table; exit 1 if a fatal check failed.

    Starts agents with the configured launcher and checks every node."""
    from orchestrator.cli.health import run_health
    from orchestrator.health.base import Level

    if level not in (None, "quick", "full"):
        raise typer.BadParameter("must be quick or full", param_hint="--level")
    raise typer.Exit(run_health(config, overrides or [], Level(level) if level else None,
                                json_out, run_dir))


@app.command(hidden=True)
def agent(
    head: Annotated[str, typer.Option(help="Supervisor URL.")],
    node_id: Annotated[str, typer.Option(help="This node's id.")],
    addr: Annotated[str, typer.Option(help="Address other nodes reach this one at.")],
    procs: Annotated[int, typer.Option(help="Ranks this node can run.")] = 1,
    run_dir: Annotated[Path, typer.Option(help="Where logs and rank files go.")] = Path("."),
    token_file: Annotated[Path | None, typer.Option(help="0600 file with the token.")] = None,
    orphan_timeout: Annotated[float, typer.Option(
        help="Exit after this long without a supervisor and no ranks (0: never).")] = 0.0,
) -> None:
    """Run a node agent (started by a launcher; the token comes from ORCH_TOKEN)."""
    from orchestrator.cli.control import run_agent

    raise typer.Exit(run_agent(head, node_id, addr, procs, run_dir, token_file,
                               orphan_timeout))


@app.command("node-credential", hidden=True)
def node_credential(
    node_id: Annotated[str, typer.Option(help="The node's id (as its agent registers).")],
    token_file: Annotated[Path, typer.Option(help="The job secret (0400/0600 file).")],
    out: Annotated[Path, typer.Option(help="Where the node's credential goes (0400).")],
) -> None:
    """Write one node's own credential for its agent, which then never holds the job secret
    (the Kubernetes manifests' init container runs this)."""
    from orchestrator.cli.control import write_node_credential

    raise typer.Exit(write_node_credential(node_id, token_file, out))


@data_app.command("prepare")
def data_prepare(
    out: Annotated[Path, typer.Option(help="Directory for the shards and index.json.")],
    source: Annotated[list[str] | None, typer.Option(
        help="Text/jsonl files or globs (repeatable); default: the Python stdlib.")] = None,
    tokenizer: Annotated[str, typer.Option(help="'byte' or a tokenizer.json.")] = "byte",
    max_bytes: Annotated[int | None, typer.Option(
        min=1, help="Cap on source bytes read (default: every byte of --source files; 8 MiB "
                    "of the stdlib). Documents past it are left out, and said so.",
        show_default=False)] = None,
) -> None:
    """Turn text / jsonl files into packed token shards."""
    from orchestrator.cli.views import prepare_data

    raise typer.Exit(prepare_data(out, source or "stdlib", tokenizer, max_bytes))


DeployConfigArg = Annotated[Path, typer.Argument(help="The job's config YAML.")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", help="Directory to write the files to (default: print them).",
    show_default=False)]


@deploy_app.command("kubernetes")
def deploy_kubernetes(config: DeployConfigArg, overrides: SetOpt = None,
                      out: OutOpt = None) -> None:
    """A kustomization directory: the supervisor as a Job, the agents as an Indexed Job of
    nodes + spares pods, the config as a ConfigMap (kubectl apply -k OUT)."""
    from orchestrator.cli.deploy import render_deploy

    raise typer.Exit(render_deploy("kubernetes", config, overrides or [], out))


@deploy_app.command("slurm")
def deploy_slurm(config: DeployConfigArg, overrides: SetOpt = None, out: OutOpt = None) -> None:
    """One sbatch file with the job's config inside (--nodes, --ntasks-per-node,
    --gpus-per-node from the cluster section)."""
    from orchestrator.cli.deploy import render_deploy

    raise typer.Exit(render_deploy("slurm", config, overrides or [], out))


@deploy_app.command("sagemaker")
def deploy_sagemaker(config: DeployConfigArg, overrides: SetOpt = None, out: OutOpt = None,
                     job_name: Annotated[str | None, typer.Option(
                         help="Training job name (default: job.name).")] = None) -> None:
    """The CreateTrainingJob request (token hidden) and its config channel's file; the
    instance count is cluster.nodes + cluster.spares."""
    from orchestrator.cli.deploy import render_deploy

    raise typer.Exit(render_deploy("sagemaker", config, overrides or [], out, job_name))


@stability_app.command("replay")
def stability_replay(
    records: Annotated[Path, typer.Argument(
        help="JSONL step records (step, loss, grad_norm, param_norm, lr; a run's steps.jsonl).")],
    config: Annotated[Path | None, typer.Option(
        help="Job config or stability section (default: the run's config.yaml beside a "
             "steps.jsonl, else the built-in defaults).")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a threshold: --set grad_spike.margin=0.2 (repeatable).")]
    = None,
) -> None:
    """Run the detectors over recorded steps; print one JSON object a line per event."""
    from orchestrator.cli.replay import run_replay

    raise typer.Exit(run_replay(records, config, overrides or []))


EndpointOpt = Annotated[str | None, typer.Option(
    help="S3-compatible endpoint (default: AWS_ENDPOINT_URL_S3, else AWS).")]
CkptUrlArg = Annotated[str, typer.Argument(
    help="A job's checkpoint root (<root>/<job>) or one step-XXXXXXXX directory.")]
KeyFileOpt = Annotated[str | None, typer.Option(
    help="The job's signing key file (default: ORCH_CHECKPOINT_KEY / ORCH_CHECKPOINT_KEY_FILE, "
         "else checkpoint.key beside a local checkpoint root).")]
TrustUnsignedOpt = Annotated[bool, typer.Option(
    help="Accept unsigned checkpoints (older versions, imports) whose files verify.")]


@ckpt_app.command("list")
def checkpoints_list(
    urls: Annotated[list[str] | None, typer.Argument(
        help="Job checkpoint roots (<root>/<job>), e.g. the local tier and the S3 tier, or "
             "run directories (every tier of their job). Default: runs/latest.",
        show_default=False)] = None,
    checksums: Annotated[bool, typer.Option(
        help="Read every file and check its checksum (default: sizes only).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="JSON rows.")] = False,
    endpoint_url: EndpointOpt = None,
    key_file: KeyFileOpt = None,
    trust_unsigned: TrustUnsignedOpt = False,
) -> None:
    """Table of checkpoints: step, tier, size, age, signature, verified; exit 1 when a
    committed one fails or there is none."""
    from orchestrator.cli.checkpoints import list_checkpoints, use_endpoint

    use_endpoint(endpoint_url)
    raise typer.Exit(list_checkpoints(urls or [], checksums, json_out, key_file, trust_unsigned))


@ckpt_app.command("verify")
def checkpoints_verify(url: CkptUrlArg, endpoint_url: EndpointOpt = None,
                       key_file: KeyFileOpt = None,
                       trust_unsigned: TrustUnsignedOpt = False) -> None:
    """Verify a checkpoint (or a job's newest one): signed, unsigned or forged, and every
    file; exit 1 naming each bad file and why."""
    from orchestrator.cli.checkpoints import use_endpoint, verify_checkpoint

    use_endpoint(endpoint_url)
    raise typer.Exit(verify_checkpoint(url, key_file, trust_unsigned))


@ckpt_app.command("prune")
def checkpoints_prune(
    url: CkptUrlArg,
    keep_last: Annotated[int, typer.Option(min=1, help="Newest committed ones to keep.")],
    keep_every: Annotated[int | None, typer.Option(
        min=1, help="Also keep every step that is a multiple of N.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only say what would go.")] = False,
    checksums: Annotated[bool, typer.Option(
        help="Read every file to decide which checkpoints verify (--no-checksums: sizes and "
             "signatures only).")] = True,
    remove_failing: Annotated[bool, typer.Option(
        help="Also remove checkpoints that fail verification (default: report, leave).")
    ] = False,
    endpoint_url: EndpointOpt = None,
    key_file: KeyFileOpt = None,
    trust_unsigned: TrustUnsignedOpt = False,
) -> None:
    """Delete verified checkpoints beyond the retention rule, and stale debris. Only
    checkpoints that verify count; failing ones are reported (exit 1) and left."""
    from orchestrator.cli.checkpoints import prune_checkpoints, use_endpoint

    use_endpoint(endpoint_url)
    raise typer.Exit(prune_checkpoints(url, keep_last, keep_every, dry_run, checksums,
                                       remove_failing, key_file, trust_unsigned))


@ckpt_app.command("sign")
def checkpoints_sign(
    url: CkptUrlArg,
    key_file: KeyFileOpt = None,
    from_key_file: Annotated[str | None, typer.Option(
        help="The key that signed them (checkpoints moved from another job).")] = None,
    trust_unsigned: TrustUnsignedOpt = False,
    endpoint_url: EndpointOpt = None,
) -> None:
    """Sign checkpoints with this job's key after they verify in full under the old key
    (--from-key-file) or unsigned (--trust-unsigned): moving checkpoints between jobs."""
    from orchestrator.cli.checkpoints import sign_checkpoints, use_endpoint

    use_endpoint(endpoint_url)
    raise typer.Exit(sign_checkpoints(url, key_file, from_key_file, trust_unsigned))


@app.command()
def export(
    checkpoint: Annotated[str, typer.Option(
        help="Checkpoint: a step directory, or a job root (its newest verified one).")],
    to_hf: Annotated[Path, typer.Option(help="Directory for the Hugging Face Llama files.")],
    dtype: Annotated[str, typer.Option(
        help="float32, bfloat16 or float16 (or fp32, bf16, fp16, as configs spell them).")]
    = "float32",
    tokenizer: Annotated[str | None, typer.Option(
        help="tokenizer.json to include (default: the one the checkpoint was trained "
             "with, when it is a file).")] = None,
    endpoint_url: EndpointOpt = None,
    adapter_only: Annotated[bool, typer.Option(
        help="LoRA/QLoRA checkpoints: write the adapter alone in peft's format instead of "
             "merging it into the base.")] = False,
    key_file: KeyFileOpt = None,
    trust_unsigned: TrustUnsignedOpt = False,
) -> None:
    """Write a checkpoint's weights as a Llama-format directory (config.json, safetensors)."""
    from orchestrator.cli.checkpoints import export_hf, use_endpoint
    from orchestrator.cli.configdoc import canonical_dtype

    use_endpoint(endpoint_url)
    raise typer.Exit(export_hf(checkpoint, to_hf, canonical_dtype(dtype), tokenizer,
                               key_file, trust_unsigned, adapter_only))


def main() -> None:
    try:
        app()
    except ImportError as exc:
        # An optional dependency a command met without a check of its own: one line naming
        # the extra that installs it, not a traceback.
        from orchestrator.extras import from_import_error

        missing = from_import_error(exc)
        if missing is None:
            raise
        import sys

        print(f"error: {missing}", file=sys.stderr)
        raise SystemExit(2) from None
