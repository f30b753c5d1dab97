"""A rank's stacks: from its own faulthandler while it runs, from outside (py-spy) when it
has no handler or is stopped; a stopped rank stays stopped (it was judged hung: woken, it
would train on until its kill)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import stacks

LOOP = ("import faulthandler, signal, sys, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "print('ready', flush=True)\n"
        "def spinning_in_a_step():\n"
        "    while True: time.sleep(0.01)\n"
        "spinning_in_a_step()\n")


def _state(pid: int) -> str:
    return (stacks._status_field(pid, "State") or "?")[0]


def _wait_state(pid: int, want: str) -> None:
    deadline = time.monotonic() + 10
    while _state(pid) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(pid) == want


@pytest.fixture
def rank() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", LOOP], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_running_rank_with_a_handler_answers_the_signal_itself(rank) -> None:
    assert stacks.catches(rank.pid, signal.SIGUSR1) is True
    assert not stacks.needs_outside_dump(rank.pid)


@pytest.mark.skipif(stacks.pyspy() is None, reason="py-spy is not installed")
def test_a_stopped_rank_is_read_from_outside_and_stays_stopped(rank, tmp_path: Path) -> None:
    os.kill(rank.pid, signal.SIGSTOP)
    _wait_state(rank.pid, "T")
    # It has the handler, but a signal would only wake it if it were continued.
    assert stacks.catches(rank.pid, signal.SIGUSR1) is True
    assert stacks.needs_outside_dump(rank.pid)
    out = tmp_path / "gen0001-rank00000.txt"
    assert asyncio.run(stacks.dump_outside(rank.pid, out, label="rank 0"))
    text = out.read_text()
    assert "stacks read from outside by py-spy" in text and "stopped" in text
    assert "spinning_in_a_step" in text, text
    time.sleep(0.2)
    assert _state(rank.pid) == "T", "reading its stacks woke the stopped rank"
