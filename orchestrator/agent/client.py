"""The agent's HTTP client to the supervisor, with tenacity retries on transient failures."""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from orchestrator.contracts.auth import is_node_credential, node_credential
from orchestrator.contracts.env import TLS_CA
from orchestrator.logs import redact


class SupervisorError(Exception):
    """A non-transient answer (4xx) from the supervisor."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Unreachable(Exception):
    """The supervisor did not answer (down, restarting, network)."""


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, Unreachable) or (
        isinstance(exc, SupervisorError) and exc.status >= 500)


class SupervisorClient:
    """One agent's session with the supervisor.

    ``head_url`` may list several supervisors, comma-separated (a leader and its standbys,
    ``orchestrator.supervisor.leader``): requests go to one of them; ``probe`` asks every
    one who leads, and ``switch`` moves to it (the agent's lease does, once its supervisor
    has been silent a while: ``agent.lease``).

    ``token`` is the node's own credential (``orchestrator.contracts.auth.node_credential``), as the
    launchers hand it over. Given the job secret instead (agents started by someone else
    that mount the job's Secret), the client derives its node's credential from it and
    ``node_id``. ``ca_file`` (default: ``ORCH_TLS_CA``): the CA bundle an https supervisor's
    certificate is verified against, instead of the system's trust store.
    """

    def __init__(self, head_url: str, token: str, *, node_id: str | None = None,
                 ca_file: str | None = None) -> None:
        self.heads = [h.strip().rstrip("/") for h in head_url.split(",") if h.strip()]
        if not self.heads:
            raise ValueError("no supervisor URL")
        self._head = 0
        if node_id is not None and token and not is_node_credential(token):
            token = node_credential(token, node_id)
        redact(token)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._ca_file = ca_file if ca_file is not None else os.environ.get(TLS_CA)
        self._session: aiohttp.ClientSession | None = None

    @property
    def head_url(self) -> str:
        """The supervisor requests go to now."""
        return self.heads[self._head]

    def rotate(self) -> None:
        """Move to the next supervisor URL (the one in use answered for a deposed leader)."""
        self._head = (self._head + 1) % len(self.heads)

    async def switch(self, url: str) -> None:
        """Send requests to ``url`` from now on. Requests still waiting on the previous one
        (a long-poll, a heartbeat to a host that was cut off) end at once with Unreachable:
        their connections go with the old session."""
        self._head = self.heads.index(url)
        old, self._session = self._session, self._new_session()
        if old is not None:
            await old.close()

    async def probe(self, timeout: float = 1.0) -> list[tuple[str, int]]:
        """``(url, leader epoch)`` of every supervisor URL that answers ``/healthz`` within
        ``timeout`` (each on a fresh connection, all at once)."""
        async def one(url: str) -> tuple[str, int] | None:
            try:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                        ssl=self._ssl(), force_close=True)) as session, session.get(
                        url + "/healthz", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    data = await r.json() if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None
            epoch = data.get("epoch", 0) if isinstance(data, dict) else None
            return (url, epoch) if isinstance(epoch, int) and not isinstance(epoch, bool) \
                else None

        found = await asyncio.gather(*(one(u) for u in self.heads))
        return [f for f in found if f is not None]

    def _ssl(self) -> ssl.SSLContext | bool:
        if not any(h.startswith("https://") for h in self.heads) or not self._ca_file:
            return True  # aiohttp's default: verify against the system's trust store
        return ssl.create_default_context(cafile=self._ca_file)

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers=self._headers,
                                     connector=aiohttp.TCPConnector(ssl=self._ssl()))

    async def __aenter__(self) -> SupervisorClient:
        self._session = self._new_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def url_at_port(self, port: int) -> str:
        """The supervisor's URL with another port (its heartbeat process's): the same
        scheme and host this agent reaches it at."""
        parts = urlsplit(self.head_url)
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        return urlunsplit(parts._replace(netloc=f"{host}:{port}"))

    async def request(self, method: str, path: str, *, json: Any = None,
                      params: dict[str, Any] | None = None, timeout: float = 10.0,
                      base: str | None = None) -> Any:
        """One attempt (at ``base`` instead of the head URL, when given). Raises
        Unreachable or SupervisorError."""
        assert self._session is not None
        try:
            async with self._session.request(
                    method, (base or self.head_url) + path, json=json, params=params,
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    raise SupervisorError(resp.status, text[:500])
                return await resp.json()
        except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError,
                TimeoutError, RuntimeError) as exc:
            # RuntimeError: the session was closed under the request (``switch``).
            raise Unreachable(str(exc) or type(exc).__name__) from None

    async def request_retrying(self, method: str, path: str, *, give_up_after: float,
                               max_wait: float = 2.0, **kwargs: Any) -> Any:
        """Retry transient failures with exponential backoff for up to ``give_up_after`` s."""
        async for attempt in AsyncRetrying(
                retry=retry_if_exception(_transient),
                wait=wait_exponential(multiplier=0.1, max=max_wait),
                stop=stop_after_delay(give_up_after), reraise=True):
            with attempt:
                return await self.request(method, path, **kwargs)
        raise AssertionError("unreachable")  # pragma: no cover - reraise=True
