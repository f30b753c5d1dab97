"""Leadership held as an etcd lease, against a real etcd: one leader at a time, a larger
epoch for every new term, a standby that takes over once the leader stops refreshing, a
deposed leader that finds out and stops acting, endpoints tried in turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import etcd

from orchestrator.supervisor.leader import Leadership, LeadershipLost


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, **kw: object) -> None:
        self.lines.append(msg)

    warning = error = info


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with etcd(tmp_path_factory.mktemp("etcd")) as url:
        yield url


def _raise(reason: str) -> None:
    raise LeadershipLost(reason)


def test_one_leader_then_the_standby_with_a_larger_epoch(etcd_url: str) -> None:
    async def scenario() -> None:
        lost: list[str] = []
        a = Leadership([etcd_url], "orchestrator/t1", 2, Log(), on_lost=lost.append)
        b = Leadership([etcd_url], "orchestrator/t1", 2, Log(), on_lost=_raise)
        term_a = await a.campaign()
        keeper = asyncio.create_task(a.keep())
        standby = asyncio.create_task(b.campaign(poll_s=0.1))
        await asyncio.sleep(3.0)  # longer than the TTL: the leader's refreshes hold it
        assert not standby.done() and a.refreshes >= 2 and lost == []
        a.check()  # still leading: nothing happens
        a.stop_keeping()  # the leader stops refreshing (it died, or hangs)
        stopped = time.monotonic()
        term_b = await asyncio.wait_for(standby, 10)
        took = time.monotonic() - stopped
        await keeper
        assert term_b.epoch > term_a.epoch
        assert took <= 2 + 1.5  # the TTL, plus a refresh period and a poll at most
        a.check()  # the deposed leader's next action finds out
        assert lost and a.lost is not None
        await b.resign()

    asyncio.run(scenario())


def test_a_leader_told_its_lease_is_gone_stops_acting(etcd_url: str) -> None:
    async def scenario() -> None:
        lost: list[str] = []
        a = Leadership([etcd_url], "orchestrator/t2", 2, Log(), on_lost=lost.append)
        await a.campaign()
        a._lock.lease.revoke()  # an operator (or etcd) took the lease away
        await asyncio.wait_for(a.keep(), 5)
        assert a.lost == "etcd says the lease has expired"
        assert lost == ["etcd says the lease has expired"]

    asyncio.run(scenario())


def test_resigning_hands_over_at_once_and_a_dead_endpoint_is_skipped(etcd_url: str) -> None:
    async def scenario() -> None:
        dead = "http://127.0.0.1:9"  # nothing listens there
        a = Leadership([dead, etcd_url], "orchestrator/t3", 5, Log(), on_lost=_raise)
        b = Leadership([etcd_url], "orchestrator/t3", 5, Log(), on_lost=_raise)
        first = await asyncio.wait_for(a.campaign(poll_s=0.05), 10)
        standby = asyncio.create_task(b.campaign(poll_s=0.05))
        await asyncio.sleep(0.3)
        assert not standby.done()
        t0 = time.monotonic()
        await a.resign()
        second = await asyncio.wait_for(standby, 5)
        assert time.monotonic() - t0 < 2.0  # not the 5 s TTL: the lock was released
        assert second.epoch > first.epoch
        await b.resign()

    asyncio.run(scenario())


def test_a_busy_event_loop_does_not_lose_the_lease(etcd_url: str) -> None:
    async def scenario() -> None:
        lost: list[str] = []
        a = Leadership([etcd_url], "orchestrator/t5", 2, Log(), on_lost=lost.append)
        await a.campaign()
        keeper = asyncio.create_task(a.keep())
        await asyncio.sleep(0)
        time.sleep(3.0)  # the loop blocked for longer than the TTL (a big journal, say)
        a.check()
        assert lost == [] and a.refreshes >= 2
        await a.resign()
        await keeper

    asyncio.run(scenario())


def test_a_paused_leader_is_deposed_by_its_own_clock(tmp_path: Path, etcd_url: str) -> None:
    clock = [1000.0]
    a = Leadership([etcd_url], "orchestrator/t4", 3, Log(), clock=lambda: clock[0],
                   on_lost=_raise)
    asyncio.run(a.campaign())
    a.check()
    clock[0] += 3.01  # no refresh confirmed within the TTL (a SIGSTOP, a cut network)
    with pytest.raises(LeadershipLost, match="no refresh confirmed"):
        a.check()
