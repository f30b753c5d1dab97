"""``orchestrator up``: build the parts, run the supervisor, print the summary, close."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from orchestrator.config import Config, ConfigError, load_config
from orchestrator.config.loader import read_yaml, validate_data
from orchestrator.rundir import RunDir
from orchestrator.state import JobState

console = Console(stderr=True)


def _load(config: Path | None, overrides: list[str], chaos_kill_at: list[int]) -> Config:
    extra = [f"chaos.kill={[{'step': s} for s in chaos_kill_at]!r}"] if chaos_kill_at else []
    return load_config(config, [*overrides, *extra])


def run_up(config: Path | None, run_dir: Path | None, overrides: list[str], *, detach: bool,
           resume: Path | None, chaos_kill_at: list[int]) -> int:
    try:
        if resume is not None:
            run = RunDir.open(resume)
            cfg = validate_data(read_yaml(run.config), str(run.config))
        else:
            cfg = _load(config, overrides, chaos_kill_at)
            run = _new_run_dir(cfg, run_dir)
    except ConfigError as exc:
        console.print(f"[red]config error[/red] {exc}")
        return 2
    except FileNotFoundError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    if detach:
        return _detach(config, run, overrides, chaos_kill_at, resume)
    return _foreground(cfg, run, resumed=resume is not None)


def _new_run_dir(cfg: Config, run_dir: Path | None) -> RunDir:
    if run_dir is None:
        return RunDir.create(cfg.job.run_root, cfg.job.name)
    run_dir = run_dir.expanduser().resolve()
    journal = run_dir / "events.jsonl"
    if journal.exists() and journal.stat().st_size > 0:
        raise FileNotFoundError(f"{run_dir} already holds a job; use --resume {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunDir(run_dir)


def _detach(config: Path | None, run: RunDir, overrides: list[str], chaos_kill_at: list[int],
            resume: Path | None) -> int:
    """Start the same command in the background, in its own session; write a pid file."""
    cmd = [sys.executable, "-m", "orchestrator", "up"]
    if resume is not None:
        cmd += ["--resume", str(run.root)]
    else:
        cmd += ([str(config)] if config else []) + ["--run-dir", str(run.root)]
        for o in overrides:
            cmd += ["--set", o]
        for s in chaos_kill_at:
            cmd += ["--chaos-kill-at", str(s)]
    with open(run.root / "supervisor.out", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    run.pid_file.write_text(f"{proc.pid}\n")
    console.print(f"supervisor started in the background: pid {proc.pid}\n"
                  f"run dir: {run.root}\n"
                  f"follow:  orchestrator status {run.root}\n"
                  f"stop:    orchestrator down {run.root}")
    return 0


def _foreground(cfg: Config, run: RunDir, resumed: bool) -> int:
    from orchestrator.logs import configure_logging, get_logger

    configure_logging(run.log, component="supervisor")
    log = get_logger("orchestrator.cli")
    if not run.pid_file.exists() or resumed:
        run.pid_file.write_text(f"{os.getpid()}\n")
    if not resumed and cfg.job.entrypoint is None:
        try:
            _prepare_data(cfg)
        except (OSError, ValueError) as exc:
            console.print(f"[red]data error[/red] {exc}")
            return 2
    log.info("starting job", job=cfg.job.name, run_dir=str(run.root), resumed=resumed,
             nodes=cfg.cluster.nodes, procs_per_node=cfg.cluster.procs_per_node,
             spares=cfg.cluster.spares, launcher=cfg.launcher.kind)
    try:
        state = asyncio.run(_supervise(cfg, run, resumed))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        console.print(f"[red]error[/red] cannot listen on {cfg.metrics.host}:"
                      f"{cfg.metrics.port}: the port is in use (set metrics.port, or 0 for a "
                      "free one)")
        return 2
    from orchestrator.cli.views import print_summary

    print_summary(run)
    return 0 if state is JobState.COMPLETED else 1


async def _supervise(cfg: Config, run: RunDir, resumed: bool) -> JobState:
    from orchestrator.supervisor.core import Supervisor

    sup = Supervisor(cfg, run, resumed=resumed)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop, f"signal {sig.name}")
    return await sup.run()


def _prepare_data(cfg: Config) -> None:
    """Build the default token shards once, with a progress bar, before any rank starts."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from trainer.data.prepare import ensure_dataset

    data = cfg.trainer.data
    if data.format == "arrow":  # read as it is by the ranks (trainer.data.arrow)
        return
    if cfg.checkpoint.endpoint_url:  # data on an S3-compatible store: check it there
        os.environ.setdefault("AWS_ENDPOINT_URL_S3", cfg.checkpoint.endpoint_url)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(f"preparing {data.path}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        ensure_dataset(data, progress)
