"""A real agent between two real HTTP supervisors (a leader and a standby): it carries out no
order from a deposed leader's epoch, follows the one that leads once its own goes silent,
and exits on the new leader's order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from orchestrator.agent.agent import Agent
from orchestrator.config.schema import Config


class FakeSupervisor:
    """Answers an agent as a supervisor of leader epoch ``epoch`` would; ``orders`` is the
    queue of assignments its long-poll hands out."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.orders: list[dict[str, Any]] = []
        self.registered = 0
        self.polls = 0
        self.silent = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/register", self.register)
        app.router.add_post("/v1/heartbeat", self.ok)
        app.router.add_post("/v1/events", self.ok)
        app.router.add_get("/v1/assignment", self.assignment)
        app.router.add_get("/healthz", self.healthz)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001

    async def _hang_if_silent(self) -> None:
        while self.silent:  # a host cut off: requests get no answer
            await asyncio.sleep(0.05)

    async def register(self, request: web.Request) -> web.Response:
        await self._hang_if_silent()
        self.registered += 1
        return web.json_response({"node_id": "n0", "job": "t", "heartbeat_interval_s": 0.1,
                                  "config": Config().model_dump(mode="json"),
                                  "epoch": self.epoch})

    async def ok(self, request: web.Request) -> web.Response:
        await self._hang_if_silent()
        return web.json_response({})

    async def healthz(self, request: web.Request) -> web.Response:
        await self._hang_if_silent()
        return web.json_response({"ok": True, "epoch": self.epoch})

    async def assignment(self, request: web.Request) -> web.Response:
        await self._hang_if_silent()
        self.polls += 1
        after = int(request.query["after"])
        for order in self.orders:
            if order["version"] > after:
                return web.json_response(order)
        await asyncio.sleep(0.2)
        return web.json_response({})


def test_orders_of_a_deposed_leader_are_ignored_and_the_new_leader_is_followed(
        tmp_path: Path) -> None:
    async def scenario() -> tuple[int, FakeSupervisor, FakeSupervisor, str]:
        old, new = FakeSupervisor(epoch=7), FakeSupervisor(epoch=9)
        await old.start()
        await new.start()
        agent = Agent(f"{old.url},{new.url}", "token", "n0", addr="127.0.0.1", procs=1,
                      run_dir=tmp_path)
        run = asyncio.create_task(agent.run())
        try:
            for _ in range(100):
                if old.registered:
                    break
                await asyncio.sleep(0.05)
            assert agent.lease.epoch == 7
            # The leader hangs and drops off; the standby takes over (epoch 9).
            old.silent = True
            for _ in range(200):
                if new.registered:
                    break
                await asyncio.sleep(0.05)
            assert new.registered and agent.client.head_url == new.url
            assert agent.lease.epoch == 9
            # The deposed leader comes back and orders an exit: not carried out.
            old.silent = False
            old.orders.append({"version": 50, "epoch": 7, "action": "exit"})
            await agent.client.switch(old.url)
            for _ in range(100):
                if agent.client.head_url == new.url and old.polls:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert not run.done() and agent.version < 50
            # The leader's own order is.
            new.orders.append({"version": 60, "epoch": 9, "action": "exit"})
            code = await asyncio.wait_for(run, 30)
            return code, old, new, agent.client.head_url
        finally:
            if not run.done():
                run.cancel()
            for s in (old, new):
                s.silent = False
                if s.runner is not None:
                    await s.runner.cleanup()

    code, old, new, head = asyncio.run(scenario())
    assert code == 0 and head == new.url
    assert old.polls >= 1  # it did ask the deposed leader, and left it for the new one
