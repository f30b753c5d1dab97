"""The supervisor's event loop: uvloop (libuv) by default, the standard library's on request.

At 2,048 nodes x 8 ranks the supervisor's loop spends most of its CPU in aiohttp's request
handling, one heartbeat per node per second; uvloop's transports and scheduler cut the CPU of
one HTTP heartbeat by 16-20 % on the same machine in one run (``bench/results/
heartbeat-http-*.json``). ``api.event_loop: asyncio`` is the fallback should uvloop misbehave on
some platform; the choice is checked here, once, before anything runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
LoopKind = Literal["uvloop", "asyncio"]


class EventLoopUnavailable(RuntimeError):
    """The configured event loop cannot be used here (its package is not importable)."""


def loop_factory(kind: LoopKind) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What ``asyncio.Runner`` builds its loop with: None is the standard library's."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        raise EventLoopUnavailable(
            f"api.event_loop is uvloop, but uvloop cannot be imported ({exc}); install it "
            "(pip install uvloop) or set api.event_loop=asyncio") from None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: LoopKind) -> T:
    """``asyncio.run`` on the chosen loop (signals, executors and shutdown as asyncio's)."""
    try:
        factory = loop_factory(kind)
    except EventLoopUnavailable:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
