"""Shared fixtures: a small prepared dataset, job configs, and running real jobs."""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpulock
from procs import TAG_VAR, kill_tagged

# Workers for a whole-suite run (pytest-xdist). Most integration tests wait on their jobs'
# subprocesses, so more workers than the CI machine's 2 cores may pay. Not settled yet: the
# count must be the one under which the timing-bound tests (a hang found within N s) still
# pass on the loaded 2-core machine (PYTEST_WORKERS=N to try another).
WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run in ``WORKERS`` processes unless told otherwise: ``-n N`` (``-n0``: in this
    process) and ``-p no:xdist`` win, and so do ``--pdb``, ``--collect-only`` and named tests
    (``file.py::test``: a developer's single test starts no workers). Parallel runs use
    ``--dist loadgroup``, which keeps ``xdist_group`` tests on one worker (see
    ``_group_shared_setups``)."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    opt = config.option
    if opt.numprocesses is None and not (opt.usepdb or opt.collectonly
                                         or any("::" in a for a in config.args)):
        opt.numprocesses = int(os.environ.get("PYTEST_WORKERS", WORKERS))
    if opt.numprocesses and opt.dist == "no":
        opt.dist = "loadgroup"


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        _compile_the_product()
    if workerinput is not None and config.option.dist == "no":
        # A worker re-reads the command line, not the choice pytest_cmdline_main made in
        # the controller: the default parallel run is a loadgroup one (xdist reads this
        # option when it names the worker's tests with their group).
        config.option.loadgroup = True
    # Processes started by session- and module-scoped fixtures carry this session's tag and
    # are killed when the session ends; each test's own processes carry the test's tag.
    # Under xdist every worker is a session of its own, with its own tag: a worker kills
    # only what its tests started.
    config.stash[_SESSION_TAG] = os.environ[TAG_VAR] = f"s-{uuid.uuid4().hex[:12]}"


def pytest_unconfigure(config: pytest.Config) -> None:
    tag = config.stash.get(_SESSION_TAG, None)
    if tag:
        kill_tagged(tag)


_SESSION_TAG = pytest.StashKey[str]()


def _compile_the_product() -> None:
    """Write the product's bytecode once, before any job starts. Under
    ``PYTHONDONTWRITEBYTECODE`` (set on the CI machine) Python writes no ``.pyc``, so each of
    the suite's thousands of processes (ranks, agents, supervisors, CLI calls) would compile
    the modules it imports again; ``compileall`` writes them regardless, and every process
    then reads them (checked against the source's mtime and size, so an edit is never
    stale)."""
    import compileall

    for package in ("orchestrator", "trainer", "stability"):
        compileall.compile_dir(ROOT / package, quiet=1, workers=1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """A test, with the setup and teardown of its fixtures of every scope, runs while no
    test runs alone (tests/cpulock.py). A test marked ``alone`` (a bound measured in seconds
    of a loaded machine) runs with no other test in flight. One marked ``alone_setup``
    takes no share: its module's fixture runs the measured part alone, and the test only
    reads the result."""
    if item.get_closest_marker("alone_setup"):
        return (yield)
    hold = cpulock.alone if item.get_closest_marker("alone") else cpulock.shared
    with hold(item.config):
        return (yield)


@pytest.fixture(autouse=True)
def _kill_what_the_test_started(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever the test started dies with it, process groups included, even when the test
    timed out (pytest-timeout's signal method raises in the test, then teardown runs)."""
    tag = f"t-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv(TAG_VAR, tag)
    yield
    killed = kill_tagged(tag)
    if killed:
        print(f"killed {len(killed)} process(es) the test left running: {killed}")


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level shards of 1 MiB of the stdlib's source, prepared once per session."""
    from trainer.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "stdlib-1m"
    prepare_dataset("stdlib", out, "byte", max_bytes=1 << 20)
    return out


@pytest.fixture(scope="session")
def clean_fast_run(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> Path:
    """One uninterrupted run of tests/jobs.py's FAST job, the reference of every bit-exact
    comparison that uses that job as it is. Made once per pytest run, not per worker: the
    first worker to ask runs it under a file lock in the run's shared temporary directory,
    the others wait for it and read it. Tests only read it (``final_state_dict`` converts
    elsewhere)."""
    import fcntl
    import shutil

    from jobs import up, write_config

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    home = shared / "clean-fast"
    with open(shared / "clean-fast.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (home / "done").exists():
                shutil.rmtree(home, ignore_errors=True)  # a worker's attempt that failed
                home.mkdir()
                result = up(write_config(home / "job.yaml", dataset_dir), home / "run")
                assert result.returncode == 0, result.stdout[-4000:]
                (home / "done").touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return home / "run"


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group, as the trainer's checkpoint group would be (a file store: no
    port to race other tests for)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_inherited_orchestrator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A test run from inside a rank (or a developer shell) must not leak worker settings.
    for key in list(os.environ):
        if key.startswith("ORCH_"):
            monkeypatch.delenv(key)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked long (fault campaigns of minutes each, "
                          "kept out of the default run for CI's time budget)")


# Fixtures a group of tests shares (a clean training run, a server): built once only when
# those tests run on one worker.
_SHARED_SCOPES = ("package", "module", "class")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _group_shared_setups(items)
    _skip_unrunnable(config, items)


def _group_shared_setups(items: list[pytest.Item]) -> None:
    """Tests that use a module- or class-scoped fixture run on one worker, in the group of
    their module, so the fixture (often a whole training run) is built once, as in a serial
    run. Tests with an ``xdist_group`` of their own (a machine-wide resource) keep it; GPU
    tests share one (the device, and the fixed store ports of NCCL's groups); all others
    are spread one by one."""
    # A module whose fuzz-count test checks how many cases its other tests tried reads
    # counters those tests filled in this process: the module runs on one worker.
    tallied = {item.nodeid.split("::", 1)[0] for item in items
               if re.fullmatch(r"test_\w*fuzz\w*_counts?", item.name)}
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("gpu"):  # one device, and fixed ports for NCCL's store
            item.add_marker(pytest.mark.xdist_group("gpu"))
            continue
        if item.nodeid.split("::", 1)[0] in tallied:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = any(defs and defs[-1].scope in _SHARED_SCOPES
                     for defs in info.name2fixturedefs.values())
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(trylast=True)  # after xdist named each grouped test with its group
def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker of a loadgroup run stops at once if its grouped tests lost their group: they
    would run side by side on several workers (pytest-xdist#1386 did this silently)."""
    config = session.config
    if not (hasattr(config, "workerinput") and config.getoption("loadgroup", False)):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"xdist_group is ignored by this pytest and pytest-xdist "
                                f"({len(lost)} tests, e.g. {lost[0]}): see pyproject.toml")


def _skip_unrunnable(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` run with ``--long`` only; GPU tests run only where CUDA is (the
    lent H100). Elsewhere they are skipped, with the reason."""
    if not config.getoption("--long"):
        skip_long = pytest.mark.skip(reason="a fault test of minutes: run it with --long")
        for item in items:
            if item.get_closest_marker("long"):
                item.add_marker(skip_long)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
