"""``orchestrator profile``: ask the running job's ranks for a torch.profiler trace."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console

from orchestrator.cli.control import resolve_run_dir
from orchestrator.cli.liveness import api_ssl_context, resume_command
from orchestrator.cli.liveness import check as supervisor_liveness
from orchestrator.contracts.rundir import RunDir
from orchestrator.journal.status import load_view, profile_summary

console = Console(stderr=True)
out = Console()


def request_body(steps: int, ranks: list[int] | None) -> dict[str, Any]:
    """What ``profile`` POSTs to ``/v1/profile`` (no ranks: every rank)."""
    return {"steps": steps, **({"ranks": sorted(set(ranks))} if ranks else {})}


def _post(run: RunDir, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {run.ensure_token()}", "Content-Type": "application/json"})
    context = api_ssl_context(run) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except json.JSONDecodeError:
            return exc.code, {"error": exc.reason}


def _refusal(answer: dict[str, Any]) -> str:
    problems = answer.get("problems") or []
    return "; ".join([str(answer.get("error", "refused")), *map(str, problems)])


def profile_job(run_dir: Path | None, steps: int, ranks: list[int] | None, wait: bool,
                timeout: float) -> int:
    try:
        run = resolve_run_dir(run_dir)
    except FileNotFoundError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    view = load_view(run)
    if view.state.terminal:
        console.print(f"[red]error[/red] no running job to profile: job {view.job} is "
                      f"{view.state.value}")
        return 1
    alive = supervisor_liveness(run)
    if not alive.api_ok:
        console.print(f"[red]error[/red] the supervisor is {alive.describe()}; nobody can "
                      f"order a profile.\nresume it: {resume_command(run)}")
        return 1
    try:
        status, answer = _post(run, f"{alive.api_url}/v1/profile", request_body(steps, ranks))
    except (urllib.error.URLError, OSError) as exc:
        console.print(f"[red]error[/red] the supervisor did not answer: {exc}")
        return 1
    if status != 200:
        console.print(f"[red]error[/red] {_refusal(answer)}")
        return 2 if status in (400, 422) else 1
    pid, start = answer["id"], answer["start_step"]
    console.print(f"profile {pid}: ranks {_ranks(answer['ranks'])}, steps {start}-"
                  f"{start + answer['steps'] - 1}, traces in {answer['dir']}")
    if not wait:
        console.print("see it with: orchestrator status (or --wait next time)")
        return 0
    return wait_for_profile(run, pid, timeout)


def wait_for_profile(run: RunDir, pid: int, timeout: float) -> int:
    """Until every rank of profile ``pid`` wrote or failed, or its generation ended."""
    deadline = time.monotonic() + timeout
    with console.status(f"waiting for profile {pid}..."):
        while True:
            view = load_view(run)
            profile = view.profiles.get(pid)
            summary = profile_summary(profile, view.generation) if profile else None
            if summary and summary["state"] != "pending" or view.state.terminal:
                break
            if time.monotonic() > deadline:
                console.print(f"[yellow]profile {pid} not written after {timeout:.0f} s"
                              f"[/yellow]" + (f" ({summary['written']} of {summary['ranks']} "
                                              f"ranks)" if summary else ""))
                return 1
            time.sleep(0.5)
    if summary is None:
        console.print(f"[red]error[/red] profile {pid} is not in the journal")
        return 1
    for rank, written in sorted(profile["written"].items()):
        late = " (started late)" if (written.get("first_step") or 0) > profile["start_step"] \
            else ""
        out.print(f"rank {rank}: {written['path']} ({(written.get('bytes') or 0) / 2**20:.1f}"
                  f" MiB, steps {written.get('first_step')}-{written.get('last_step')}){late}")
    for rank, error in sorted(profile["failed"].items()):
        out.print(f"rank {rank}: failed: {error}")
    if summary["state"] != "written":
        console.print(f"[yellow]profile {pid}: {summary['state']}[/yellow]")
        return 1
    console.print("open a trace in https://ui.perfetto.dev or chrome://tracing")
    return 0


def _ranks(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
