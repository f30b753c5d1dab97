"""The machine's CPUs for one test at a time, when a test measures a control plane under load.

A parallel run (pytest-xdist) shares the 2-core CI machine between its workers. Most tests
only wait longer for that; a test whose subject is how the supervisor keeps up with
thousands of simulated ranks (``test_scale.py``) instead measures the other workers' load,
and a healthy node of its generator goes silent. Such a test runs ``alone``: no other test of
the run starts until it is done, and it starts only once the tests in flight are done.
A test whose bound is seconds of the machine (a hang found within 3 x the step + 2 s) runs
alone too.

Two ``flock`` files of the run (named by xdist's run id, so two runs never wait on each
other): every test holds ``cpu`` shared; ``alone`` holds it exclusively. Shared holders that
keep arriving would starve an exclusive waiter, so every acquisition passes a ``gate`` first,
which ``alone`` holds while it waits and runs. Locks die with their process: a killed worker
never leaves one behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _paths(config: pytest.Config) -> tuple[Path, Path] | None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # one process: nothing runs beside a test
        return None
    base = Path(tempfile.gettempdir()) / f"orchestrator-tests-{workerinput['testrunuid']}"
    return base.with_suffix(".gate"), base.with_suffix(".cpu")


@contextlib.contextmanager
def _locked(path: Path, how: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def shared(config: pytest.Config) -> Iterator[None]:
    """Held by every test while it runs: waits only while a test runs ``alone``."""
    paths = _paths(config)
    if paths is None:
        yield
        return
    gate, cpu = paths
    fd = os.open(cpu, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with _locked(gate, fcntl.LOCK_SH):  # passes unless a test runs or waits to run alone
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def alone(config: pytest.Config) -> Iterator[None]:
    """The block runs with no other test of this run in flight: a whole test (conftest's
    ``alone`` marker), or a module fixture of tests that hold no share (``alone_setup``).
    Never from inside a block that holds ``shared``: it would wait on itself."""
    paths = _paths(config)
    if paths is None:
        yield
        return
    gate, cpu = paths
    with _locked(gate, fcntl.LOCK_EX), _locked(cpu, fcntl.LOCK_EX):
        yield
