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

from orchestrator.envcontract import TOKEN, read_token
from orchestrator.rundir import RunDir
from orchestrator.status import load_view

console = Console(stderr=True)


def resolve_run_dir(run_dir: Path | None) -> RunDir:
    """The given run directory, or ``runs/latest``; FileNotFoundError names what is missing."""
    return RunDir.open(run_dir if run_dir is not None else Path("runs") / "latest")


def stop_job(run_dir: Path | None, timeout: float) -> int:
    try:
        run = resolve_run_dir(run_dir)
    except FileNotFoundError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    view = load_view(run)
    if view.state.terminal:
        console.print(f"job already ended: {view.state.value}")
        return 0
    info = run.read_supervisor_info()
    if not info:
        console.print("[red]error[/red] no supervisor.json: is the supervisor running?")
        return 1
    url = f"http://127.0.0.1:{info['port']}/v1/stop"
    req = urllib.request.Request(url, data=json.dumps({"reason": "orchestrator down"}).encode(),
                                 method="POST", headers={
                                     "Authorization": f"Bearer {run.ensure_token()}",
                                     "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as exc:
        console.print(f"[red]error[/red] the supervisor at {url} did not answer: {exc}")
        return 1
    deadline = time.monotonic() + timeout
    with console.status("stopping the job..."):
        while time.monotonic() < deadline:
            view = load_view(run)
            if view.state.terminal:
                console.print(f"job {view.job}: {view.state.value}")
                return 0
            time.sleep(0.5)
    console.print(f"[yellow]still {load_view(run).state.value} after {timeout:.0f} s[/yellow]")
    return 1


def run_agent(head: str, node_id: str, addr: str, procs: int, run_dir: Path,
              token_file: Path | None, orphan_timeout: float) -> int:
    from orchestrator.agent.agent import Agent
    from orchestrator.logs import configure_logging

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
