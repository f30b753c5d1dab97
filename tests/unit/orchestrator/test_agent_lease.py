"""The agent's lease with its supervisor (on a fake clock), the leader epochs it accepts,
the memory tier's continuity, and following the supervisor that leads among several URLs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent import lease as lease_mod
from orchestrator.agent.lease import SupervisorLease


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, msg: str, **kw: Any) -> None:
        self.lines.append((msg, kw))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=30))
def test_epochs_only_go_up(epochs: list[int]) -> None:
    lease = SupervisorLease(Log())
    highest = 0
    for e in epochs:
        assert lease.accepts(e) == (e >= highest)
        highest = max(highest, e)
        assert lease.epoch == highest
    assert lease.accepts(None) == (highest == 0)  # no election: epoch 0


def test_memory_serves_only_the_very_next_generation_of_a_node_that_kept_its_lease() -> None:
    lease = SupervisorLease(Log())
    assert lease.memory_continues(3, 4)
    assert not lease.memory_continues(3, 5)  # generation 4 ran without this node
    assert not lease.memory_continues(None, 1)
    lease.lapsed = 3
    assert not lease.memory_continues(3, 4)  # its ranks ran on as a deposed generation


def test_ranks_stop_once_the_lease_lapses_and_not_before(monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    monkeypatch.setattr(lease_mod, "_CHECK_S", 0.01)
    clock, log = Clock(), Log()
    lease = SupervisorLease(log, clock)
    running: list[int | None] = [7]
    stops: list[float] = []

    async def stop() -> None:
        stops.append(clock.now)
        running[0] = None

    async def scenario() -> None:
        task = asyncio.create_task(lease.watch(lambda: 8.0, lambda: running[0], stop))
        for _ in range(20):  # answers keep coming: 7.5 s of them
            clock.now += 0.5
            lease.renew()
            await asyncio.sleep(0.02)
        assert stops == []
        clock.now += 7.9  # silent, within the lease
        await asyncio.sleep(0.05)
        assert stops == []
        clock.now += 0.2  # past it
        await asyncio.sleep(0.05)
        assert stops == [clock.now] and lease.lapsed == 7 and lease.expiries == 1
        clock.now += 30  # nothing runs: nothing more to stop
        await asyncio.sleep(0.05)
        assert len(stops) == 1
        running[0] = 9  # a new generation's ranks, from a live supervisor
        lease.renew()
        await asyncio.sleep(0.05)
        assert lease.lapsed is None
        task.cancel()

    asyncio.run(scenario())
    assert any("lease expired" in msg for msg, _ in log.lines)


def test_no_lease_when_it_is_zero() -> None:
    lease = SupervisorLease(Log(), Clock())
    assert not lease.expired(0.0)


class FakeClient:
    """Several supervisor URLs; ``answers``: what /healthz says at each (None: silent)."""

    def __init__(self, answers: dict[str, int | None]) -> None:
        self.heads = list(answers)
        self.answers = answers
        self.head_url = self.heads[0]
        self.switched: list[str] = []
        self.probes = 0

    async def probe(self) -> list[tuple[str, int]]:
        self.probes += 1
        return [(u, e) for u, e in self.answers.items() if e is not None]

    async def switch(self, url: str) -> None:
        self.head_url = url
        self.switched.append(url)


def test_a_silent_leader_is_left_for_the_one_that_leads_now(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_mod, "_CHECK_S", 0.01)
    clock, log = Clock(), Log()
    lease = SupervisorLease(log, clock)
    lease.accepts(5)
    client = FakeClient({"http://a:9410": None, "http://b:9410": None})
    cleared: list[int] = []

    async def scenario() -> None:
        task = asyncio.create_task(lease.follow(client, lambda: 0.25,
                                                lambda: cleared.append(1)))
        await asyncio.sleep(0.05)
        assert client.probes == 0  # answers are recent: nobody is asked
        clock.now += 1.5
        await asyncio.sleep(0.05)
        assert client.probes > 0 and client.switched == []  # nobody answers yet
        client.answers["http://b:9410"] = 4  # an older leader than the one followed
        await asyncio.sleep(0.05)
        assert client.switched == []
        client.answers["http://b:9410"] = 9  # the standby took over
        await asyncio.sleep(0.05)
        assert client.switched == ["http://b:9410"] and cleared == [1]
        lease.renew()
        lease.accepts(9)
        task.cancel()

    asyncio.run(scenario())


def test_one_supervisor_url_has_nothing_to_follow() -> None:
    client = FakeClient({"http://a:9410": 1})
    lease = SupervisorLease(Log(), Clock())
    asyncio.run(asyncio.wait_for(lease.follow(client, lambda: 0.5, lambda: None), 1))
    assert client.probes == 0
