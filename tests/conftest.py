"""Shared fixtures: a small prepared dataset, job configs, and running real jobs."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import TAG_VAR, kill_tagged


def pytest_configure(config: pytest.Config) -> None:
    # Processes started by session- and module-scoped fixtures carry this session's tag and
    # are killed when the session ends; each test's own processes carry the test's tag.
    config.stash[_SESSION_TAG] = os.environ[TAG_VAR] = f"s-{uuid.uuid4().hex[:12]}"


def pytest_unconfigure(config: pytest.Config) -> None:
    tag = config.stash.get(_SESSION_TAG, None)
    if tag:
        kill_tagged(tag)


_SESSION_TAG = pytest.StashKey[str]()


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
