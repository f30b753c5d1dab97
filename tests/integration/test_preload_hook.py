"""The preload hook in a real interpreter: a script that knows nothing of the orchestrator
beats to a real agent socket with its optimizer steps counted, gets the supervisor's
collective timeout, keeps its children quiet, and a hook that cannot start stops the rank at
once with the reason."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.contracts import env as ec
from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
from orchestrator.agent.nodeconfig import preload_pythonpath

SCRIPT = """
import os, subprocess, sys, time
import torch
import torch.distributed.distributed_c10d as c10d
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(7):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
print("timeout", c10d.default_pg_timeout.total_seconds(), flush=True)
# A child of the rank inherits the environment; it must not beat as the rank.
subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0)"], check=True)
time.sleep(1.0)
"""


def _rank_env(sock: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(ec.AgentEnv(agent_socket=sock, run_dir=str(tmp_path),
                           heartbeat_interval_s=0.05).to_env())
    env.update(ec.GenerationEnv(job="t", generation=2, collective_timeout_s=123.0).to_env())
    env.update({"RANK": "0", "PYTHONPATH": preload_pythonpath(env.get("PYTHONPATH"))})
    env.update(extra)
    return env


def test_a_script_without_the_sdk_beats_with_its_optimizer_steps(tmp_path: Path) -> None:
    pids: set[int] = set()

    async def scenario() -> tuple[LocalHub, subprocess.CompletedProcess]:
        hub = LocalHub(on_event=lambda msg: None)
        original = hub.handle

        def handle(msg: dict) -> None:
            if msg.get("t") == "beat":
                pids.add(msg.get("pid"))
            original(msg)

        hub.handle = handle  # type: ignore[method-assign]
        server = LocalSocketServer(hub)
        await server.start()
        try:
            out = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", SCRIPT], capture_output=True,
                text=True, env=_rank_env(server.path, tmp_path), timeout=180)
        finally:
            await server.close()
        return hub, out

    hub, out = asyncio.run(scenario())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "timeout 123.0" in out.stdout  # the supervisor's, not gloo's 30 minutes
    beat = hub.beats[0]
    # The last beat is the one sent as the script ended: past its last step, finishing.
    assert beat.step == 7 and beat.phase == "finishing" and beat.finished
    assert beat.progress == "hook"
    assert beat.generation == 2
    assert [r["step"] for r in hub.records] == list(range(1, 8))
    assert len(pids) == 1  # the child never beat


def test_a_script_using_the_sdk_reports_its_own_steps(tmp_path: Path) -> None:
    script = ("import torch, orchestrator.worker as ow\n"
              "w = ow.init()\n"
              "m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for s in range(40, 43):\n"
              "    m(torch.ones(1, 2)).sum().backward(); o.step(); ow.step_done(s + 1)\n"
              "ow.shutdown()\n")

    async def scenario() -> tuple[LocalHub, subprocess.CompletedProcess]:
        hub = LocalHub(on_event=lambda msg: None)
        server = LocalSocketServer(hub)
        await server.start()
        try:
            out = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", script], capture_output=True,
                text=True, env=_rank_env(server.path, tmp_path), timeout=180)
        finally:
            await server.close()
        return hub, out

    hub, out = asyncio.run(scenario())
    assert out.returncode == 0, out.stderr[-3000:]
    assert hub.beats[0].step == 43 and hub.beats[0].progress == "sdk"
    assert hub.beats[0].finished  # shutdown's last beat: tearing down, not hung
    assert [r["step"] for r in hub.records] == [41, 42, 43]


def test_a_hook_that_cannot_start_stops_the_rank_at_once_with_the_reason(
        tmp_path: Path) -> None:
    env = _rank_env("/nonexistent/agent.sock", tmp_path, ORCH_HEARTBEAT_INTERVAL="soon")
    out = subprocess.run([sys.executable, "-c", "print('the script ran')"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 3 and "the script ran" not in out.stdout
    assert "ORCH_HEARTBEAT_INTERVAL='soon': expected a number" in out.stderr


PHASES_SCRIPT = """
import io, time
import torch
model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    model(torch.ones(1, 2)).sum().backward(); opt.step()
step(); step()
model.eval()                      # evaluating, until train() or the next step
with torch.no_grad():
    model(torch.ones(1, 2))
time.sleep(0.3)
model.train()
class SlowDisk(io.BytesIO):
    def write(self, b):
        time.sleep(0.3); return super().write(b)
torch.save(model.state_dict(), SlowDisk())   # checkpointing, for the call
for _ in torch.utils.data.DataLoader([1, 2]):  # an epoch's start: loading
    time.sleep(0.3)
    step()
"""


def test_a_script_without_the_sdk_evaluates_saves_and_loads_in_their_phases(
        tmp_path: Path) -> None:
    phases: list[str] = []

    async def scenario() -> subprocess.CompletedProcess:
        hub = LocalHub(on_event=lambda msg: None)
        original = hub.handle

        def handle(msg: dict) -> None:
            if msg.get("t") == "beat" and (not phases or phases[-1] != msg.get("phase")):
                phases.append(msg.get("phase"))
            original(msg)

        hub.handle = handle  # type: ignore[method-assign]
        server = LocalSocketServer(hub)
        await server.start()
        try:
            return await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", PHASES_SCRIPT], capture_output=True,
                text=True, env=_rank_env(server.path, tmp_path), timeout=180)
        finally:
            await server.close()

    out = asyncio.run(scenario())
    assert out.returncode == 0, out.stderr[-3000:]
    # Beats sample the phase (a step's return to training sends none); a marked phase is
    # sent at once, so each is seen, in the script's order.
    marks = iter(phases)
    assert all(p in marks for p in ("init", "evaluating", "checkpointing", "loading")), phases
