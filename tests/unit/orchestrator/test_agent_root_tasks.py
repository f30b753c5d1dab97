"""The agent's supervised root tasks, and ranks that cannot even be spawned.

- the first root task to fail stops the others and surfaces its error (no swallowing);
- a real Agent, registered with a real HTTP server, exits 1 when a root task fails;
- a spawn failure (entrypoint not found) is that rank's exit, with the OS error as cause.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from aiohttp import web

from orchestrator.agent.agent import Agent
from orchestrator.agent.ranks import EXIT_NOT_FOUND, Rank, RankSet, RankSetup, warm_module
from orchestrator.config.schema import Config
from orchestrator.contracts.protocol import Assignment
from orchestrator.roottasks import RootTaskFailed, RootTasks


def test_the_first_failing_root_task_stops_the_others_and_raises() -> None:
    cancelled: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append(name)

    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise FileNotFoundError(2, "No such file or directory", "pyhton")

    async def scenario() -> None:
        roots = RootTasks({"heartbeat": forever("heartbeat"), "assignment": broken(),
                           "events": forever("events")})
        await roots.wait(asyncio.Event())

    with pytest.raises(RootTaskFailed) as info:
        asyncio.run(scenario())
    assert info.value.name == "assignment"
    assert isinstance(info.value.error, FileNotFoundError)
    assert "root task 'assignment' failed: FileNotFoundError" in str(info.value)
    assert sorted(cancelled) == ["events", "heartbeat"]


def test_a_stop_request_ends_the_wait_without_an_error() -> None:
    async def scenario() -> bool:
        stop = asyncio.Event()
        roots = RootTasks({"idle": asyncio.Event().wait(), "stopper": _set_soon(stop)})
        await roots.wait(stop)
        await roots.cancel()
        return all(t.done() for t in roots.tasks.values())

    assert asyncio.run(scenario())


async def _set_soon(event: asyncio.Event) -> None:
    await asyncio.sleep(0.01)
    event.set()


def test_an_agent_whose_root_task_fails_exits_non_zero(tmp_path: Path) -> None:
    """A real agent against a real HTTP server: registration succeeds, then writing the job's
    config fails (its path is a directory). The agent must exit 1, not heartbeat on."""
    beats: list[dict] = []

    async def register(request: web.Request) -> web.Response:
        return web.json_response({"node_id": "n0", "job": "t", "heartbeat_interval_s": 0.05,
                                  "config": Config().model_dump(mode="json")})

    async def heartbeat(request: web.Request) -> web.Response:
        beats.append(await request.json())
        return web.json_response({})

    async def scenario() -> int:
        app = web.Application()
        app.router.add_post("/v1/register", register)
        app.router.add_post("/v1/heartbeat", heartbeat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - port 0's pick
        (tmp_path / "agents" / "n0" / "config.json").mkdir(parents=True)
        agent = Agent(f"http://127.0.0.1:{port}", "token", "n0", addr="127.0.0.1", procs=1,
                      run_dir=tmp_path)
        try:
            return await asyncio.wait_for(agent.run(), 60)
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == 1
    assert beats == []  # it stopped instead of heartbeating with a dead register loop


def test_a_spawn_failure_is_reported_as_that_ranks_exit(tmp_path: Path) -> None:
    exits: list[Rank] = []

    async def on_exit(r: Rank, tail: list[str]) -> None:
        exits.append(r)

    async def scenario() -> list[int | None]:
        a = Assignment(action="run", generation=1, node_rank=0, nproc=2, world_size=2,
                       master_addr="127.0.0.1", master_port=29999,
                       entrypoint=["pyhton", "train.py"])
        ranks = RankSet(a, {"PATH": "/usr/bin:/bin"}, tmp_path / "logs", on_exit,
                        RankSetup(run_dir=tmp_path))
        infos = await ranks.start()
        await ranks.stop(grace=1.0)
        return [i.pid for i in infos]

    assert asyncio.run(scenario()) == [None, None]
    assert sorted(r.rank for r in exits) == [0, 1]
    for r in exits:
        assert r.exit_code == EXIT_NOT_FOUND and not r.alive
        assert r.error == "job.entrypoint 'pyhton' not found (No such file or directory)"
        assert r.tail == [r.error]
    log = (tmp_path / "logs" / "rank-00000.log").read_text()
    assert "job.entrypoint 'pyhton' not found" in log


@pytest.mark.parametrize(("entrypoint", "expected"), [
    (["python", "-m", "trainer"], ("trainer", [])),
    (["python", "-P", "-u", "-m", "trainer", "--config", "x"], ("trainer", ["--config", "x"])),
    (["python", "train.py", "-m", "x"], ("path:train.py", ["-m", "x"])),
    (["/venv/bin/python3", "-u", "/w/t.py"], ("path:/w/t.py", [])),
    (["python", "-c", "print(1)"], None),
    (["python", "train.sh"], None),
    (["bash", "train.py"], None),
    (["torchrun", "-m", "trainer"], None),
    (["python", "-m"], None),
])
def test_warm_spares_take_module_and_script_entrypoints(entrypoint, expected
                                                                    ) -> None:
    assert warm_module(entrypoint) == expected


@pytest.mark.timeout(120)
def test_a_supervisor_whose_root_task_fails_stops_with_its_error(tmp_path: Path) -> None:
    """A real Supervisor (its HTTP server on a real port): the books' task raises while the
    job is being driven. The drive is cancelled, the supervisor shuts down (its journal
    closed, the API stopped) and ``run`` raises the failure with the task's name."""
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.supervisor.core import Supervisor

    cfg = Config.model_validate({"job": {"name": "t"}, "metrics": {"port": 0,
                                                                   "host": "127.0.0.1"}})
    sup = Supervisor(cfg, RunDir(tmp_path / "run"))
    driving = asyncio.Event()
    cancelled: list[str] = []

    async def drive() -> None:
        driving.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append("drive")

    async def books() -> None:
        await driving.wait()
        raise ZeroDivisionError("a bug in the books")

    sup._drive = drive  # type: ignore[method-assign]
    sup.books.run = books  # type: ignore[method-assign]
    with pytest.raises(RootTaskFailed) as info:
        asyncio.run(sup.run())
    assert info.value.name == "books" and isinstance(info.value.error, ZeroDivisionError)
    assert cancelled == ["drive"]
    assert sup.journal._closed  # shut down as after any end of the drive


def test_a_supervisor_whose_drive_ends_stops_its_root_tasks(tmp_path: Path) -> None:
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.supervisor.core import Supervisor

    cfg = Config.model_validate({"job": {"name": "t"}, "metrics": {"port": 0,
                                                                   "host": "127.0.0.1"}})
    sup = Supervisor(cfg, RunDir(tmp_path / "run"))
    ended: list[str] = []

    async def drive() -> None:
        await asyncio.sleep(0.05)

    async def books() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("books")

    sup._drive = drive  # type: ignore[method-assign]
    sup.books.run = books  # type: ignore[method-assign]
    asyncio.run(sup.run())
    assert ended == ["books"]


def test_an_in_place_order_for_a_node_whose_ranks_are_all_gone_starts_replacements(
        tmp_path: Path) -> None:
    """A node whose only rank died and was reaped before the in-place order came still
    takes the order in place: its new rank is a replacement (its start-up breakdown is its
    own to send; the node's memory slots are kept, not provisioned anew). Taken as a fresh
    start, under CPU load, the replacement's breakdown went missing from the journal."""
    said = ("import os, sys; print('replacement=' + os.environ.get('ORCH_REPLACEMENT', '-'),"
            " 'generation=' + os.environ.get('ORCH_GENERATION', '-'), flush=True)")

    def order(generation: int, **extra: object) -> Assignment:
        return Assignment(action="run", version=generation, generation=generation,
                          node_rank=0, nproc=1, world_size=1, master_addr="127.0.0.1",
                          master_port=29999, entrypoint=[sys.executable, "-c", said],
                          env={"ORCH_GENERATION": str(generation)}, **extra)

    async def scenario() -> list[tuple[int | None, int | None]]:
        agent = Agent("http://127.0.0.1:9", "token", "n0", addr="127.0.0.1", procs=1,
                      run_dir=tmp_path)
        await agent._reconcile(order(1))
        first = agent.ranks
        assert first is not None
        async with asyncio.timeout(60):  # the rank exits at once and is reaped
            while first.alive:
                await asyncio.sleep(0.05)
        await agent._reconcile(order(2, in_place=True, replace=[0]))
        assert agent.ranks is first and agent.ranks.generation == 2
        def exits() -> list[tuple[int | None, int | None]]:
            return [(e["generation"], e["exit_code"]) for e in agent._events
                    if e.get("type") == "rank_exit"]

        async with asyncio.timeout(60):  # both exits reported, each once
            while len(exits()) < 2 or agent.ranks.alive:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        return exits()

    assert asyncio.run(scenario()) == [(1, 0), (2, 0)]
    log = (tmp_path / "logs" / "rank-00000.log").read_text()
    assert "replacement=- generation=1" in log
    assert "(replacing a failed rank in place)" in log
    assert "replacement=1 generation=2" in log
