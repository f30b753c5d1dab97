"""The supervisor's event loop is the configured one, and a missing uvloop is a clear error."""

from __future__ import annotations

import asyncio
import sys
import warnings

import pytest

from orchestrator import eventloop
from orchestrator.config import ConfigError, load_config


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_the_default_and_runs_the_coroutine() -> None:
    cfg = load_config(None, [])
    assert cfg.api.event_loop == "uvloop"
    assert eventloop.run(_loop_module(), cfg.api.event_loop).startswith("uvloop")


def test_asyncio_on_request() -> None:
    cfg = load_config(None, ["api.event_loop=asyncio"])
    assert eventloop.run(_loop_module(), cfg.api.event_loop).startswith("asyncio")


def test_an_unknown_loop_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="event_loop"):
        load_config(None, ["api.event_loop=trio"])


def test_uvloop_missing_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    coro = _loop_module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be a warning
        with pytest.raises(eventloop.EventLoopUnavailable, match="api.event_loop=asyncio"):
            eventloop.run(coro, "uvloop")
    assert coro.cr_frame is None  # closed, not left pending
