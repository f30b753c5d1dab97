"""``orchestrator down`` and ``orchestrator agent``."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Console

from orchestrator.cli.liveness import check as supervisor_liveness
from orchestrator.cli.liveness import api_ssl_context, pid_alive, resume_command
from orchestrator.contracts.env import TOKEN, read_token
from orchestrator.journal.view import JobView
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.state import JobState
from orchestrator.journal.status import last_step_record, load_view

console = Console(stderr=True)
_TERMINAL = frozenset(s.value for s in JobState if s.terminal)


def resolve_run_dir(run_dir: Path | None) -> RunDir:
    """The given run directory, or ``runs/latest``; FileNotFoundError names what is missing."""
    return RunDir.open(run_dir if run_dir is not None else Path("runs") / "latest")


def stop_request_body(checkpoint: bool) -> dict[str, object]:
    """What ``down`` POSTs to ``/v1/stop``: the reason, and whether the ranks should commit a
    checkpoint at the next step boundary before they stop (``--no-checkpoint``: false)."""
    return {"reason": "orchestrator down", "checkpoint": checkpoint}


def stop_job(run_dir: Path | None, timeout: float, checkpoint: bool = True) -> int:
    try:
        run = resolve_run_dir(run_dir)
    except FileNotFoundError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    view = load_view(run)
    if view.state.terminal:
        console.print(f"job already ended: {view.state.value}")
        return 0
    alive = supervisor_liveness(run)
    if not alive.api_ok:
        console.print(f"[red]error[/red] the supervisor is {alive.describe()}; the job "
                      f"({view.state.value} in the journal) has nobody to stop it.\n"
                      f"resume it: {resume_command(run)}")
        return 1
    url = f"{alive.api_url}/v1/stop"
    req = urllib.request.Request(url, data=json.dumps(stop_request_body(checkpoint)).encode(),
                                 method="POST", headers={
                                     "Authorization": f"Bearer {run.ensure_token()}",
                                     "Content-Type": "application/json"})
    try:
        context = api_ssl_context(run) if url.startswith("https") else None
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as exc:
        console.print(f"[red]error[/red] the supervisor at {url} did not answer: {exc}\n"
                      f"if it is gone, resume it: {resume_command(run)}")
        return 1
    deadline = time.monotonic() + timeout
    with console.status("stopping the job (a final checkpoint first)..." if checkpoint
                        else "stopping the job..."):
        view = _wait_terminal(run, deadline)
        if view is None:
            console.print(f"[yellow]still {load_view(run).state.value} after {timeout:.0f} s"
                          "[/yellow]")
            return 1
        # The journal's final state comes before the supervisor's exit (it tells the agents
        # to exit and waits for them): `up --resume` right after must find it gone.
        gone = alive.pid is None or _wait_exit(alive.pid, deadline)
    step = stopped_step(view, run)
    ckpt = view.newest_checkpoint_step
    console.print(f"job {view.job}: {view.state.value} at step {step} (newest checkpoint "
                  f"{ckpt if ckpt is not None else 'none'})")
    if not gone:
        console.print(f"[yellow]the supervisor (pid {alive.pid}) is still shutting down after "
                      f"{timeout:.0f} s; `orchestrator up --resume {run.root}` waits for it"
                      "[/yellow]")
        return 1
    if view.state is JobState.STOPPED:
        console.print(f"continue it: orchestrator up --resume {run.root}")
    return 0


def _wait_terminal(run: RunDir, deadline: float) -> JobView | None:
    while time.monotonic() < deadline:
        view = load_view(run)
        if view.state.terminal:
            return view
        time.sleep(0.2)
    return None


def _wait_exit(pid: int, deadline: float) -> bool:
    """True once ``pid`` has exited (before ``deadline``)."""
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stopped_step(view: JobView, run: RunDir) -> int:
    """The step a stopped or ended job reached: rank 0's last step record when it is newer
    than the journal's last progress event (journaled every few seconds only)."""
    record = last_step_record(run) or {}
    step = record.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step > view.last_step:
        return step
    return view.last_step


def show_rank_logs(run_dir: Path | None, ranks: list[int] | None, follow: bool,
                   since: str | None) -> int:
    """``orchestrator logs``: the selected ranks' lines, following until the job ends."""
    from datetime import datetime

    from orchestrator.cli.ranklogs import parse_since, show_logs

    try:
        run = resolve_run_dir(run_dir)
        since_dt = parse_since(since, datetime.now()) if since else None
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    from orchestrator.cli.console import JobFollower

    world = load_view(run).world_size
    unknown = [r for r in ranks or [] if world and r >= world]
    if unknown:
        console.print(f"[red]error[/red] no rank {', '.join(map(str, unknown))}: job "
                      f"{run.root} has ranks 0-{world - 1}", highlight=False)
        return 1
    journal = JobFollower(run.root)  # reads only what the journal gained since the last poll

    def job_ended() -> bool:
        journal.poll()
        return journal.progress.state in _TERMINAL

    return show_logs(run.logs, ranks, since_dt, follow, job_ended=job_ended)


def run_agent(head: str, node_id: str, addr: str, procs: int, run_dir: Path,
              token_file: Path | None, orphan_timeout: float) -> int:
    from orchestrator.agent.agent import Agent
    from orchestrator.logs import configure_logging
    from orchestrator.contracts.rundir import make_private

    make_private()  # its logs, and what its ranks write (they inherit it)

    token = read_token(os.environ) or ""
    if token_file is not None:
        token = token_file.read_text().strip()
    if not token:
        console.print(f"[red]error[/red] no token: set {TOKEN} or pass --token-file")
        return 2
    run_dir = run_dir.expanduser().resolve()
    configure_logging(run_dir / "agents" / f"{node_id}.log", component="agent",
                      console=False)
    agent = Agent(head, token, node_id, addr=addr, procs=procs, run_dir=run_dir,
                  orphan_timeout_s=orphan_timeout)
    return asyncio.run(agent.run())


def write_node_credential(node_id: str, secret_file: Path, out: Path) -> int:
    """Write ``node_id``'s own credential (``contracts.auth.node_credential``) to ``out``,
    0400: what a Kubernetes init container hands its agent, so the agent never holds the job
    secret (with it, a node could speak for any other node, or stop the job)."""
    import re
    import tempfile

    from orchestrator.contracts.auth import authenticate, node_credential

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", node_id):
        console.print(f"[red]error[/red] node id {node_id!r}: 1-128 of A-Z a-z 0-9 _ . - "
                      "(starting with a letter or digit)")
        return 2
    try:
        secret = secret_file.read_text().strip()
    except OSError as exc:
        console.print(f"[red]error[/red] cannot read the job secret: {exc}")
        return 2
    if not secret:
        console.print(f"[red]error[/red] {secret_file} is empty: no job secret")
        return 2
    credential = node_credential(secret, node_id)
    principal = authenticate(secret, credential)  # the supervisor's own check, once here
    if principal is None or principal.node_id != node_id:
        console.print(f"[red]error[/red] node id {node_id!r} cannot carry a credential")
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".credential-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(credential + "\n")
        os.chmod(tmp, 0o400)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    console.print(f"wrote the credential of node {node_id} to {out}")
    return 0
