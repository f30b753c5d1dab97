"""``orchestrator deploy slurm``: one sbatch file for one job, with its config inside.

The ``#SBATCH`` sizes come from the config: ``--nodes`` holds ``cluster.nodes +
cluster.spares`` agents (``launcher.slurm.agents_per_node`` a node), ``--ntasks-per-node`` is
that many agents, ``--gpus-per-node`` is ``cluster.procs_per_node`` on CUDA. The job's
config travels inside the file (written into the run directory at start), so the file alone
is the job: ``sbatch llama.sbatch``. With ``deploy.slurm.requeue`` the start is the
requeue-aware one of ``deploy/slurm/train-requeue.sbatch``.
"""

from __future__ import annotations

from typing import Any

from orchestrator.config.schema import Config
from orchestrator.render import header, job_yaml

_EOF = "ORCHESTRATOR_JOB_YAML"


def settings(cfg: Config) -> dict[str, Any]:
    return {"launcher.kind": "slurm"}


def sbatch_options(cfg: Config) -> list[str]:
    """The ``#SBATCH`` options, sizes first."""
    c, s = cfg.cluster, cfg.deploy.slurm
    per = cfg.launcher.slurm.agents_per_node
    nodes = -(-(c.nodes + c.spares) // per)
    out = [f"--job-name={s.job_name or cfg.job.name}", f"--nodes={nodes}",
           f"--ntasks-per-node={per}"]
    if c.accelerator == "cuda" and s.gpus_per_node:
        out.append(f"--gpus-per-node={c.procs_per_node * per}")
    if s.exclusive:
        out.append("--exclusive")
    out += [f"--{k}={v}" for k, v in (("partition", s.partition), ("account", s.account),
                                      ("time", s.time)) if v]
    if s.requeue:
        out += ["--requeue", "--open-mode=append"]
    out.append("--output=%x-%j.out")
    return out


def render(cfg: Config, data: dict[str, Any], source: str, name: str) -> dict[str, str]:
    """``{name: the sbatch file}``."""
    config = job_yaml("slurm", source, data, settings(cfg))
    if any(line.strip() == _EOF for line in config.splitlines()):
        raise ValueError(f"the config holds a line {_EOF!r}, which ends the embedded copy")
    s = cfg.deploy.slurm
    lines = ["#!/bin/bash", header("slurm", source).rstrip("\n"),
             f"# cluster.nodes {cfg.cluster.nodes} + cluster.spares {cfg.cluster.spares}, "
             f"{cfg.cluster.procs_per_node} rank(s) a node. Environment (optional):",
             "#   RUN_DIR  the run directory (default below)",
             "#   PYTHON   the interpreter with the orchestrator installed",
             *(f"#SBATCH {o}" for o in sbatch_options(cfg)),
             "set -euo pipefail",
             f"python=\"${{PYTHON:-{s.python}}}\""]
    if s.requeue:
        lines += _requeue_start(s.run_dir, config, own_checkpoints=cfg.checkpoint.url is None)
    else:
        default = s.run_dir or "$PWD/runs/$SLURM_JOB_ID"
        lines += [f"run_dir=\"${{RUN_DIR:-{_shell_path(default)}}}\"",
                  'mkdir -p "$run_dir"',
                  f"cat > \"$run_dir/job.yaml\" <<'{_EOF}'", config.rstrip("\n"), _EOF,
                  'exec "$python" -m orchestrator up "$run_dir/job.yaml" --run-dir '
                  '"$run_dir" "$@"']
    return {name: "\n".join(lines) + "\n"}


def _shell_path(path: str) -> str:
    """A default path in double quotes: $VARIABLES expand, nothing else does."""
    if any(ch in path for ch in '"`\\'):
        raise ValueError(f"deploy.slurm.run_dir {path!r}: no quotes or backslashes")
    return path


def _requeue_start(run_root: str | None, config: str, own_checkpoints: bool) -> list[str]:
    """A requeued start resumes its run: the last start still live (its supervisor killed
    outright) is resumed, a stopped one is followed by a new start from the newest
    checkpoint (shared by every start: the config's checkpoint.url, else one beside the
    runs), a completed one ends the job."""
    root = _shell_path(run_root) if run_root else "$PWD/runs/$SLURM_JOB_ID"
    shared = ' --set "checkpoint.url=$root/checkpoints"' if own_checkpoints else ""
    return [
        f"root=\"${{RUN_DIR:-{root}}}\"",
        'mkdir -p "$root"',
        'echo "start $(date -u +%FT%TZ) restart count ${SLURM_RESTART_COUNT:-0}"',
        'last="$root/latest"',
        'if [ -s "$last/events.jsonl" ]; then',
        '  state=$("$python" -m orchestrator status "$last" --json | '
        "sed -n 's/^  \"state\": \"\\([A-Z_]*\\)\",$/\\1/p')",
        '  echo "the last start ($(readlink "$last")) ended $state"',
        '  case "$state" in',
        "    COMPLETED) exit 0 ;;",
        "    FAILED) exit 1 ;;",
        "    STOPPED) ;;",
        '    *) exec "$python" -m orchestrator up --resume "$(readlink -f "$last")" ;;',
        "  esac",
        "fi",
        'attempt="attempt-${SLURM_RESTART_COUNT:-0}"',
        'ln -sfn "$attempt" "$last"',
        f"cat > \"$root/job.yaml\" <<'{_EOF}'",
        config.rstrip("\n"),
        _EOF,
        f'exec "$python" -m orchestrator up "$root/job.yaml" --run-dir "$root/$attempt"{shared} '
        '"$@"',
    ]
