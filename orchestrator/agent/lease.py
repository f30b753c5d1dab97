"""The agent's lease with its supervisor, and the leader epoch it accepts orders from.

A node cut off from the supervisor cannot tell a supervisor restart from a partition; the
supervisor, on its side, declares the node lost after ``node_lost_s`` and replaces it. So
the agent holds a lease that every answer of its supervisor renews: when none has come for
``timeouts.agent_lease_s``, it stops its ranks itself (split brain is bounded: a node that
is gone from the supervisor's view stops training, saving and uploading). What the ranks
wrote meanwhile is fenced by the readers (``trainer.checkpoint.fence``); the lease bounds how
long that can go on. The agent itself stays, and registers again when the network is back:
its node then rejoins as a spare, never as a member of the generation it left.

With a standby supervisor (``orchestrator.supervisor.leader``), every order carries the
leader's epoch (the etcd revision at which it won). The agent remembers the highest epoch it
has seen and ignores answers from a lower one: a deposed leader that comes back cannot act.

A node's memory tier (``orchestrator.agent.memory``) holds copies only a generation that
follows on from the one that wrote them may use: ``memory_continues`` says when a new
assignment does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

# How often the lease is looked at: well below any lease a config allows (>= 2 s).
_CHECK_S = 0.25
# With several supervisor URLs: how long the one in use may be silent (in heartbeat
# intervals, at least a second) before every URL is asked who leads now.
_FAILOVER_BEATS = 4


class SupervisorLease:
    """See the module. ``clock`` is monotonic seconds (a fake one in tests)."""

    def __init__(self, log: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self._clock = clock
        self.epoch = 0  # the highest leader epoch seen
        self.renewed_at = clock()
        self.lapsed: int | None = None  # generation whose ranks the lease stopped
        self.expiries = 0

    def renew(self) -> None:
        self.renewed_at = self._clock()

    def accepts(self, epoch: int | None) -> bool:
        """Whether an answer carrying ``epoch`` comes from the current leader (or a newer
        one: then it becomes the epoch to follow)."""
        epoch = epoch or 0
        if epoch < self.epoch:
            self.log.warning("answer from a deposed supervisor ignored", epoch=epoch,
                             leader_epoch=self.epoch)
            return False
        if epoch > self.epoch:
            if self.epoch:
                self.log.warning("following a new supervisor leader", epoch=epoch,
                                 previous_epoch=self.epoch)
            self.epoch = epoch
        return True

    def silent_for(self) -> float:
        return self._clock() - self.renewed_at

    def expired(self, lease_s: float) -> bool:
        return lease_s > 0 and self.silent_for() > lease_s

    def memory_continues(self, previous: int | None, generation: int | None) -> bool:
        """Whether the memory tier's copies (written by ``previous``, the generation this
        node ran last) may serve ``generation``: only the very next generation, and never
        after the lease stopped the ranks (they ran on as a deposed generation)."""
        return previous is not None and generation == previous + 1 and self.lapsed is None

    async def follow(self, client: Any, heartbeat_s: Callable[[], float],
                     on_switch: Callable[[], None]) -> None:
        """The agent's root task with several supervisor URLs (a leader and standbys):
        once the one in use has been silent for a few heartbeats, ask them all who leads
        (``client.probe``) and switch to the answer with the highest epoch (at least the
        one followed so far); ``on_switch`` then makes the agent register there."""
        if len(client.heads) < 2:
            return
        while True:
            await asyncio.sleep(_CHECK_S)
            if self.silent_for() < max(1.0, _FAILOVER_BEATS * heartbeat_s()):
                continue
            answers = [(epoch, url) for url, epoch in await client.probe()
                       if epoch >= self.epoch]
            if not answers:
                continue
            epoch, url = max(answers)
            if url != client.head_url:
                self.log.warning("supervisor silent: following the one that leads now",
                                 url=url, epoch=epoch, previous=client.head_url,
                                 silent_s=round(self.silent_for(), 1))
                await client.switch(url)
                on_switch()

    async def watch(self, lease_s: Callable[[], float], running: Callable[[], int | None],
                    stop: Callable[[], Awaitable[None]]) -> None:
        """The agent's root task: stop the ranks (``running()``: their generation, None
        when none runs) once the lease has expired; look again when it is renewed."""
        while True:
            await asyncio.sleep(_CHECK_S)
            generation = running()
            if generation is None or not self.expired(lease_s()):
                if generation is not None and self.lapsed is not None \
                        and self.silent_for() < lease_s():
                    self.lapsed = None  # ranks of a new assignment, from a live leader
                continue
            self.expiries += 1
            self.lapsed = generation
            self.log.warning("lease expired: no answer from the supervisor; stopping this "
                             "node's ranks", generation=generation,
                             silent_s=round(self.silent_for(), 1), lease_s=lease_s())
            await stop()
