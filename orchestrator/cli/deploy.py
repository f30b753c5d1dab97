"""``orchestrator deploy kubernetes|slurm|sagemaker CONFIG``: render what the platform needs
from the job's config, into ``--out`` or on stdout."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

err = Console(stderr=True, soft_wrap=True)


def render_deploy(platform: str, config: Path, overrides: list[str], out: Path | None,
                  job_name: str | None = None) -> int:
    from orchestrator.config import ConfigError, validate_data
    from orchestrator.config.loader import apply_overrides, read_yaml
    from orchestrator.launchers.sagemaker_submit import PlanError

    try:
        data = apply_overrides(read_yaml(config), overrides)
        cfg = validate_data(data, str(config) + (" (with --set overrides)" if overrides
                                                 else ""))
    except ConfigError as exc:
        err.print(f"[red]config error[/red] {exc}", highlight=False, markup=False)
        return 2
    source = str(config)
    notes: list[str] = []
    try:
        if platform == "kubernetes":
            from orchestrator.render.kubernetes import render
            files = render(cfg, data, source)
        elif platform == "slurm":
            from orchestrator.render.slurm import render as render_slurm
            files = render_slurm(cfg, data, source, f"{cfg.job.name}.sbatch")
        else:
            from orchestrator.render.sagemaker import render as render_sm
            files, notes = render_sm(cfg, data, source, job_name)
    except (PlanError, ValueError) as exc:
        for problem in getattr(exc, "problems", [str(exc)]):
            err.print(f"[red]error[/red] {problem}", highlight=False)
        return 2
    for note in notes:
        err.print(note, highlight=False, markup=False)
    if out is None:
        for name, text in files.items():
            print(f"# ---- {name}\n{text}", end="")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    if platform == "slurm":
        for name in files:
            (out / name).chmod(0o755)
    err.print(f"wrote {', '.join(sorted(files))} to {out}" + _next_step(platform, out),
              highlight=False, markup=False)
    return 0


def _next_step(platform: str, out: Path) -> str:
    if platform == "kubernetes":
        return (f"; next: python -c 'import secrets; print(secrets.token_urlsafe(32))' > "
                f"{out}/token && kubectl apply -k {out}")
    if platform == "slurm":
        return f"; next: sbatch {out}/<job>.sbatch"
    return f"; next: orchestrator sagemaker submit {out}/job.yaml ... (or send request.json)"
