"""CI cannot hang: a test that times out takes everything it started with it.

A pytest run inside this test runs one test that starts a process which starts another in a
session of its own and exits, orphaning it (what agents and ranks look like), then hangs.
pytest-timeout ends that test after 3 s; conftest's teardown must then kill the orphan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jobs import env

TESTS = Path(__file__).resolve().parents[1]

INNER = '''
import subprocess, sys, time

SPAWN = ("import subprocess, sys; "
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
         "start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid))")


def test_hangs(tmp_path):
    subprocess.run([sys.executable, "-c", SPAWN, PIDFILE], check=True)
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped by its new parent


def test_a_timed_out_test_kills_the_processes_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "orphan.pid"
    inner = tmp_path / "test_inner.py"
    inner.write_text(f"PIDFILE = {str(pidfile)!r}\n" + INNER)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
         "--timeout", "3", "--timeout-method", "signal", str(inner)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**env(), "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get(
            "PYTHONPATH", "")])})
    assert "Timeout" in out.stdout and out.returncode == 1, out.stdout[-3000:]
    orphan = int(pidfile.read_text())
    try:
        assert not _alive(orphan), f"pid {orphan} outlived the test that started it"
        assert "killed 1 process(es) the test left running" in out.stdout
    finally:
        if _alive(orphan):
            os.kill(orphan, 9)
