"""``orchestrator up``: build the parts, run the supervisor, print the summary, close."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from orchestrator.cli.live import LogFormat, Verbosity
from orchestrator.cli.liveness import api_ssl_context, api_urls, healthz, supervisor_info
from orchestrator.cli.liveness import check as supervisor_liveness
from orchestrator.cli.liveness import pid_alive
from orchestrator.config import Config, ConfigError, load_config
from orchestrator.config.loader import read_yaml, validate_data
from orchestrator.contracts.rundir import RunDir, make_private
from orchestrator.contracts.state import JobState
from orchestrator.textsafe import shown

console = Console(stderr=True)
# `up --detach` waits this long for the daemon to listen (data preparation comes first and
# can take a minute on a cold machine); past it, the daemon keeps starting on its own.
_DETACH_WAIT_S = 600.0
# `up --resume` of a stopped job waits for its old supervisor's exit: the agents' stop grace
# plus this (one long-poll round trip, closing the API, writing the summary).
_SHUTDOWN_MARGIN_S = 20.0


def _load(config: Path | None, overrides: list[str], chaos_kill_at: list[int]) -> Config:
    extra = [f"chaos.kill={[{'step': s} for s in chaos_kill_at]!r}"] if chaos_kill_at else []
    return load_config(config, [*overrides, *extra])


def run_up(config: Path | None, run_dir: Path | None, overrides: list[str], *, detach: bool,
           resume: Path | None, chaos_kill_at: list[int],
           log_format: LogFormat = LogFormat.AUTO,
           verbosity: Verbosity = Verbosity.NORMAL, standby: bool = False,
           advertise_host: str | None = None) -> int:
    if standby:
        from orchestrator.cli.standby import standby_problem

        problem = standby_problem(config, run_dir, resume, detach)
        if problem:
            console.print(f"[red]error[/red] {problem}")
            return 2
    make_private()  # the run directory, and what the supervisor and its agents write
    try:
        if resume is not None:
            run = RunDir.open(resume)
            run.narrow()
            cfg = validate_data(read_yaml(run.config), str(run.config))
        else:
            cfg = _load(config, overrides, chaos_kill_at)
    except ConfigError as exc:
        console.print(f"[red]config error[/red] {exc}")
        return 2
    except FileNotFoundError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    problem = _launcher_problem(cfg) or (
        "--standby needs leader.etcd in the config (the store the supervisors elect "
        "their leader through)" if standby and not cfg.leader.etcd else None)
    if problem:
        console.print(f"[red]error[/red] {problem}")
        return 2
    if resume is not None and not cfg.leader.etcd:  # with a standby, etcd decides
        refusal = _resume_refusal(run, cfg)
        if refusal:  # never a second supervisor, never its pid file
            console.print(f"[red]error[/red] {refusal}")
            return 1
    elif standby:
        assert run_dir is not None  # standby_problem checked it
        run = RunDir(run_dir.expanduser().resolve())
    else:
        try:
            run = _new_run_dir(cfg, run_dir)
        except OSError as exc:
            console.print(f"[red]error[/red] {exc}")
            return 2
    if detach:
        extra = [] if log_format is LogFormat.AUTO else ["--log-format", log_format.value]
        extra += {Verbosity.QUIET: ["--quiet"], Verbosity.VERBOSE: ["--verbose"]}.get(
            verbosity, [])
        return _detach(config, run, overrides, chaos_kill_at, resume, extra)
    return _foreground(cfg, run, resumed=resume is not None,
                       log_format=log_format.resolve(sys.stderr), verbosity=verbosity,
                       standby=standby, advertise_host=advertise_host)


def _launcher_problem(cfg: Config) -> str | None:
    """A launcher that cannot start here, said before anything starts (not in a traceback)."""
    if cfg.launcher.kind == "slurm" and not (
            os.environ.get("SLURM_JOB_ID")
            and (os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST"))):
        return ("launcher.kind slurm runs inside an allocation: start `orchestrator up` under "
                "salloc or sbatch (no SLURM_JOB_ID / SLURM_JOB_NODELIST here)")
    return None


def _resume_refusal(run: RunDir, cfg: Config) -> str | None:
    """Why ``up --resume`` cannot start a supervisor for ``run`` now; None when it can.

    A stopped job's supervisor journals STOPPED, then tells its agents to exit and waits
    for them: a resume right after ``down`` (or Ctrl-C) waits for that process to end."""
    from orchestrator.journal.status import load_view

    alive = supervisor_liveness(run)
    if not alive.running:
        return None
    state = load_view(run).state
    if state.terminal and alive.pid is not None:
        wait_s = cfg.timeouts.stop_grace_s + _SHUTDOWN_MARGIN_S
        with console.status(f"waiting for the supervisor of the {state.value} job (pid "
                            f"{alive.pid}) to finish shutting down..."):
            deadline = time.monotonic() + wait_s
            while pid_alive(alive.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        if not pid_alive(alive.pid):
            return None
        return (f"the supervisor of {run.root} (pid {alive.pid}) has journaled {state.value} "
                f"but is still shutting down after {wait_s:.0f} s; wait for it to exit, or "
                f"end it (kill {alive.pid}), then resume")
    return (f"the supervisor of {run.root} is already {alive.describe()}; the job is "
            f"{state.value}: follow it (orchestrator status --watch {run.root}) or stop it "
            f"first (orchestrator down {run.root})")


def _new_run_dir(cfg: Config, run_dir: Path | None) -> RunDir:
    if run_dir is None:
        return RunDir.create(cfg.job.run_root, cfg.job.name)
    run_dir = run_dir.expanduser().resolve()
    journal = run_dir / "events.jsonl"
    if journal.exists() and journal.stat().st_size > 0:
        raise FileExistsError(_taken_run_dir(RunDir(run_dir)))
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    _point_latest(Path(cfg.job.run_root).expanduser().resolve(), run_dir)
    run = RunDir(run_dir)
    run.narrow()
    return run


def _taken_run_dir(run: RunDir) -> str:
    """What to do with a run directory that already holds a job, by the job's state."""
    from orchestrator.journal.status import load_view

    state = load_view(run).state
    alive = supervisor_liveness(run)
    if alive.running:
        return (f"{run.root} holds a {state.value} job whose supervisor is {alive.describe()}:"
                f" follow it (orchestrator status --watch {run.root}), stop it (orchestrator "
                f"down {run.root}), or give this job another --run-dir")
    if state is JobState.STOPPED:
        return (f"{run.root} holds a STOPPED job: continue it with orchestrator up --resume "
                f"{run.root}, or give this job another --run-dir")
    if state.terminal:
        return f"{run.root} holds a {state.value} job: give this job another --run-dir"
    return (f"{run.root} holds a {state.value} job with no supervisor running: resume it "
            f"with orchestrator up --resume {run.root} --detach, or give this job another "
            "--run-dir")


def _point_latest(run_root: Path, run_dir: Path) -> None:
    """``<run_root>/latest`` names the newest run wherever it lives, so `status`, `logs` and
    `down` without an argument find a run started with ``--run-dir``."""
    latest = run_root / "latest"
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        tmp = run_root / f".latest-{os.getpid()}"
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(run_dir if run_dir.parent != run_root else Path(run_dir.name))
        os.replace(tmp, latest)  # atomic: a reader sees the old link or the new one
    except OSError:
        pass  # the link is a convenience; a filesystem without symlinks still runs


def _detach(config: Path | None, run: RunDir, overrides: list[str], chaos_kill_at: list[int],
            resume: Path | None, extra: list[str]) -> int:
    """Start the same command in the background, in its own session; write a pid file."""
    cmd = [sys.executable, "-P", "-m", "orchestrator", "up"]
    if resume is not None:
        cmd += ["--resume", str(run.root)]
    else:
        cmd += ([str(config)] if config else []) + ["--run-dir", str(run.root)]
        for o in overrides:
            cmd += ["--set", o]
        for s in chaos_kill_at:
            cmd += ["--chaos-kill-at", str(s)]
    cmd += extra
    out_path = run.root / "supervisor.out"
    start = out_path.stat().st_size if out_path.exists() else 0
    with open(out_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    code = _wait_listening(run, proc)
    if code is not None:
        tail = out_path.read_bytes()[start:].decode(errors="replace").splitlines()[-15:]
        console.print(f"[red]error[/red] the supervisor exited with code {code} before it "
                      f"listened; its output ({out_path}):")
        for line in tail:
            console.print(f"  {shown(line)}", markup=False, highlight=False)
        return code or 1
    # The daemon writes it too, once it listens; written here as well so that it is there
    # when this command returns.
    run.pid_file.write_text(f"{proc.pid}\n")
    info = supervisor_info(run) or {}
    console.print(f"supervisor listening in the background: pid {proc.pid}, "
                  f"{info.get('url', '?')}\n"
                  f"run dir: {run.root}\n"
                  f"follow:  orchestrator status --watch {run.root}\n"
                  f"logs:    orchestrator logs -f {run.root}\n"
                  f"stop:    orchestrator down {run.root}")
    return 0


def _wait_listening(run: RunDir, proc: subprocess.Popen) -> int | None:
    """None once the daemon's API answers; its exit code if it died first (the code is 1 when
    it exited 0 without listening: the job cannot have run)."""
    deadline = time.monotonic() + _DETACH_WAIT_S
    with console.status("waiting for the supervisor to listen..."):
        while time.monotonic() < deadline:
            code = proc.poll()
            info = supervisor_info(run)
            if info and info.get("pid") == proc.pid and any(
                    healthz(u, context=api_ssl_context(run)) for u in api_urls(info)):
                return None
            if code is not None:
                return code or 1
            time.sleep(0.2)
    console.print(f"[yellow]the supervisor (pid {proc.pid}) has not listened after "
                  f"{_DETACH_WAIT_S:.0f} s; it goes on starting: orchestrator status "
                  f"{run.root}[/yellow]")
    return None


def _foreground(cfg: Config, run: RunDir, resumed: bool,
                log_format: LogFormat = LogFormat.PLAIN,
                verbosity: Verbosity = Verbosity.NORMAL, standby: bool = False,
                advertise_host: str | None = None) -> int:
    from orchestrator.cli.live import setup_logging
    from orchestrator.logs import get_logger

    setup_logging(run.log, log_format, verbosity, console)
    log = get_logger("orchestrator.cli")
    if resumed:
        _say_resuming(run, log_format)
    if (not resumed or standby) and cfg.job.entrypoint is None:
        try:
            _prepare_data(cfg, show=log_format is LogFormat.RICH)
        except (OSError, ValueError) as exc:
            console.print(f"[red]data error[/red] {exc}")
            return 2
    log.info("starting job", job=cfg.job.name, run_dir=str(run.root), resumed=resumed,
             nodes=cfg.cluster.nodes, procs_per_node=cfg.cluster.procs_per_node,
             spares=cfg.cluster.spares, launcher=cfg.launcher.kind)
    try:
        state = asyncio.run(_supervise(cfg, run, resumed, log_format, verbosity, standby,
                                       advertise_host))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        from orchestrator.supervisor.gateway.server import bind_host

        console.print(f"[red]error[/red] cannot listen on {cfg.metrics.host or bind_host(cfg)}:"
                      f"{cfg.metrics.port}: the port is in use (set metrics.port, or 0 for a "
                      "free one)")
        return 2
    if log_format is LogFormat.JSON:  # stdout stays JSON lines: the summary is one more
        import json

        from orchestrator.journal.status import load_view
        from orchestrator.cli.summary import build_summary

        print(json.dumps({"event": "summary", "run_dir": str(run.root),
                          **build_summary(load_view(run), run)}, default=str), flush=True)
    else:
        from orchestrator.cli.views import print_summary

        print_summary(run)
    return 0 if state is JobState.COMPLETED else 1


def _say_resuming(run: RunDir, log_format: LogFormat) -> None:
    from orchestrator.journal.status import load_view

    view = load_view(run)
    if log_format is LogFormat.JSON:
        return
    if view.state is JobState.STOPPED:
        console.print(f"continuing the stopped job {view.job} from step {view.last_step} "
                      f"(newest checkpoint {view.newest_checkpoint_step})")
    elif not view.state.terminal:
        console.print(f"resuming the supervisor of {view.job} ({view.state.value}, step "
                      f"{view.last_step}); its agents keep training")


async def _supervise(cfg: Config, run: RunDir, resumed: bool,
                     log_format: LogFormat = LogFormat.PLAIN,
                     verbosity: Verbosity = Verbosity.NORMAL, standby: bool = False,
                     advertise_host: str | None = None) -> JobState:
    from orchestrator.cli.standby import NothingToLead, lead
    from orchestrator.supervisor.core import Supervisor

    # With leader.etcd, nothing is done before this process leads the job (``leader``).
    try:
        leadership, cfg, resumed = await lead(cfg, run, resumed, standby)
    except NothingToLead as done:
        console.print(f"the job in {run.root} has ended ({done.state.value}): nothing to "
                      "take over")
        return done.state
    try:
        return await _run_supervisor(Supervisor(cfg, run, resumed=resumed,
                                                leadership=leadership,
                                                advertise_host=advertise_host),
                                     run, log_format, verbosity)
    finally:
        if leadership is not None:
            leadership.stop_keeping()  # the lease lapses: a standby may take over


async def _run_supervisor(sup: Any, run: RunDir, log_format: LogFormat,
                          verbosity: Verbosity) -> JobState:
    from orchestrator.cli.live import ConsoleView, follow_job

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop, f"signal {sig.name}")
    helpers = [asyncio.create_task(_write_pid_when_listening(run), name="pid-file")]
    view = ConsoleView(run.root, console, verbosity) if log_format is LogFormat.RICH else None
    if view is not None:
        view.follower.poll()  # a resumed run's past is in the summary, not replayed as news
        helpers.append(asyncio.create_task(follow_job(view, run.root), name="console"))
    try:
        if view is None:
            return await sup.run()
        with view:
            try:
                return await sup.run()
            finally:
                view.step()  # the last lines (the final state) before the summary
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)


async def _write_pid_when_listening(run: RunDir) -> None:
    """Write ``supervisor.pid`` once this process's supervisor has written its address (it
    listens): a supervisor that fails to start never takes the pid file of a live one."""
    me = os.getpid()
    while True:
        info = await asyncio.to_thread(supervisor_info, run)
        if info and info.get("pid") == me:
            await asyncio.to_thread(run.pid_file.write_text, f"{me}\n")
            return
        await asyncio.sleep(0.2)


def _prepare_data(cfg: Config, show: bool = True) -> None:
    """Build the default token shards once, with a progress bar, before any rank starts."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from trainer.data.prepare import ensure_dataset

    data = cfg.trainer.data
    if data.format == "arrow":  # read as it is by the ranks (trainer.data.arrow)
        return
    if cfg.checkpoint.endpoint_url:  # data on an S3-compatible store: check it there
        os.environ.setdefault("AWS_ENDPOINT_URL_S3", cfg.checkpoint.endpoint_url)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=console, transient=True,
                  disable=not show) as bar:
        task = bar.add_task(f"preparing {data.path}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        ensure_dataset(data, progress)
