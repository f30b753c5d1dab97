"""Leadership of a job among its supervisors, held as an etcd lease: the standby supervisor.

With ``leader.etcd`` set, every ``orchestrator up`` of the job campaigns before it acts: it
takes etcd's lock for the job (``etcd3gw``'s ``Lock``: a key created under a lease in one
transaction that succeeds only when the key does not exist). The winner is the leader; the
others wait as standbys, retrying the lock until the leader's lease lapses, then take over
the run directory (on shared storage) and its journal, as ``up --resume`` does. No election
protocol of our own: etcd's lease and transaction are the whole of it.

The leader's **epoch** is the lock key's create revision: etcd's revision counter only grows,
so each leadership term has a larger epoch than every earlier one. Every order the leader
sends (``protocol.Assignment.epoch``) and every registration answer carries it; agents
ignore orders from a lower epoch than one they have seen (``agent.lease``).

The leader refreshes its lease every third of its TTL, from a thread (its event loop may
be busy for seconds at a time). It counts itself leader only until
``TTL`` after it *sent* the last refresh that etcd confirmed (etcd starts the new TTL when it
receives the refresh, later than that): past it, a standby may already lead. ``check()``
guards every journal write and every order; once the term is over (a refresh answered that
the lease is gone, or no refresh confirmed in time: etcd unreachable, this process paused)
it calls ``on_lost``, which ends the process (as Kubernetes' client-go leader election does):
a deposed leader neither writes the shared journal nor sends an order again.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# The process's exit code once its leadership is lost (the supervisor's own; 3: deposed).
EXIT_DEPOSED = 3


class LeadershipLost(RuntimeError):
    """This supervisor is no longer the job's leader."""


@dataclass(frozen=True)
class Term:
    """A won election: the epoch, and the lock's key in etcd."""

    epoch: int
    key: str


def _exit_deposed(reason: str) -> None:
    print(f"supervisor: leadership lost ({reason}); exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_DEPOSED)


class Leadership:
    """One supervisor's side of the election (see the module).

    ``endpoints`` are etcd client URLs (``http://host:2379``; tried in turn when one does
    not answer), ``name`` the lock's name (one per job), ``ttl_s`` the lease's TTL. ``clock``
    is monotonic seconds; ``on_lost`` is called once the term is over (default: exit the
    process with ``EXIT_DEPOSED``).
    """

    def __init__(self, endpoints: list[str], name: str, ttl_s: int, log: Any, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_lost: Callable[[str], None] = _exit_deposed) -> None:
        if not endpoints:
            raise ValueError("leadership needs at least one etcd endpoint")
        self.endpoints = endpoints
        self.name = name
        self.ttl_s = ttl_s
        self.log = log
        self._clock = clock
        self._on_lost = on_lost
        self._clients: list[Any] = []
        self._at = 0  # the endpoint in use
        self._lock: Any = None
        self.term: Term | None = None
        self.valid_until = float("-inf")
        self.lost: str | None = None
        self.refreshes = 0
        self._stop = threading.Event()

    # -- etcd ------------------------------------------------------------------------------
    def _client(self) -> Any:
        import etcd3gw

        if not self._clients:
            for url in self.endpoints:
                parts = urlsplit(url)
                # Each request is bounded well within one refresh period, so a cut network
                # costs one period, never the whole lease.
                self._clients.append(etcd3gw.client(
                    host=parts.hostname or "localhost", port=parts.port or 2379,
                    protocol=parts.scheme or "http", timeout=max(0.5, self.ttl_s / 3)))
        return self._clients[self._at]

    def _next_endpoint(self) -> None:
        self._at = (self._at + 1) % len(self.endpoints)
        if self._lock is not None:
            self._lock.client = self._client()
            if self._lock.lease is not None:
                self._lock.lease.client = self._lock.client

    def _try_acquire(self) -> Term | None:
        """One attempt at the lock (blocking: runs in a thread)."""
        from etcd3gw.lock import Lock

        lock = Lock(self.name, ttl=self.ttl_s, client=self._client())
        if not lock.acquire():
            try:  # each attempt grants a lease: give a losing one back at once
                if lock.lease is not None:
                    lock.lease.revoke()
            except Exception:  # noqa: BLE001 - it lapses within its TTL anyway
                pass
            return None
        found = lock.client.get(lock.key, metadata=True)
        mine = [meta for value, meta in found if value == lock.uuid.encode("latin-1")]
        if not mine:  # lapsed between the two requests: another campaigner has it now
            return None
        self._lock = lock
        return Term(int(mine[0]["create_revision"]), lock.key)

    def _refresh(self) -> int:
        assert self._lock is not None
        return self._lock.refresh()

    # -- campaign and keep -----------------------------------------------------------------
    async def campaign(self, poll_s: float | None = None) -> Term:
        """Wait until this supervisor leads; returns the term (its epoch)."""
        poll = poll_s if poll_s is not None else min(0.5, self.ttl_s / 4)
        waiting_since = self._clock()
        said, failures = False, 0
        while True:
            sent = self._clock()
            try:
                term = await asyncio.to_thread(self._try_acquire)
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: try the next one
                if failures % 20 == 0:  # said once, then every 20th try
                    self.log.warning("etcd unreachable while campaigning",
                                     endpoint=self.endpoints[self._at], tries=failures + 1,
                                     error=f"{type(exc).__name__}: {exc}"[:300])
                failures += 1
                self._next_endpoint()
                term = None
            if term is not None:
                self.term, self.valid_until = term, sent + self.ttl_s
                self.log.info("leader elected", epoch=term.epoch, key=term.key,
                              waited_s=round(self._clock() - waiting_since, 3))
                return term
            if not said:
                self.log.info("standby: another supervisor leads this job; waiting for its "
                              "lease to lapse", key=self.name, ttl_s=self.ttl_s)
                said = True
            await asyncio.sleep(poll)

    def start_keeping(self) -> threading.Thread:
        """Refresh the lease every third of its TTL for as long as this process leads, in a
        thread of its own, started now: whatever the supervisor does next on its event loop
        (build its view from a long journal, serve 2,048 nodes) must not let the lease
        lapse. The thread ends once the term is over (after ``on_lost``) or
        ``stop_keeping`` was called."""
        thread = threading.Thread(target=self.keep_blocking, name="leader-lease",
                                  daemon=True)
        thread.start()
        return thread

    async def keep(self) -> None:
        """``start_keeping``, awaited until the thread ends."""
        await asyncio.to_thread(self.keep_blocking)

    def keep_blocking(self) -> None:
        period = self.ttl_s / 3
        while self.lost is None and not self._stop.wait(period):
            sent = self._clock()
            try:
                ttl = self._refresh()
            except Exception as exc:  # noqa: BLE001 - unanswered: the next endpoint, then
                self.log.warning("etcd did not confirm the leader's lease", error=(
                    f"{type(exc).__name__}: {exc}")[:300], valid_for_s=round(
                    self.valid_until - self._clock(), 2))
                self._next_endpoint()
                self.check()
                continue
            if ttl <= 0:
                self._lose("etcd says the lease has expired")
                return
            self.refreshes += 1
            self.valid_until = max(self.valid_until, sent + self.ttl_s)
            self.check()

    def stop_keeping(self) -> None:
        """Stop refreshing (the lease then lapses within its TTL)."""
        self._stop.set()

    def check(self) -> None:
        """Raise nothing while this process leads; once its term is over, ``on_lost``."""
        if self.lost is None and self._clock() > self.valid_until:
            self._lose(f"no refresh confirmed within the {self.ttl_s} s lease")

    def _lose(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        self.log.error("leadership lost: this supervisor stops acting", reason=reason,
                       epoch=self.term.epoch if self.term else None)
        self._on_lost(reason)

    async def resign(self) -> None:
        """Give the lock up (the job ended): a standby need not wait for the lease."""
        self._stop.set()
        if self._lock is None or self.lost is not None:
            return
        try:
            await asyncio.to_thread(self._lock.release)
        except Exception as exc:  # noqa: BLE001 - the lease lapses on its own anyway
            self.log.warning("could not release the leader lock", error=str(exc)[:300])
