"""The load generator's HTTP client: keep-alive connections, requests built as bytes.

aiohttp's client spent ~0.4 ms of CPU per request here (session, connector, timeout and
response objects): at 2,048 beats a second that was 90 % of a core, so the generator, not
the supervisor, set the latencies it reported. A simulated agent holds one ``Conn`` per
kind of request (beats, long-polls, events, registrations), each one socket reused for
every request, so a request costs a ``json.dumps``, one ``write`` and the parse of a
status line and a ``Content-Length``. The headers (the node's credential included) are
built once per connection.

A simulated agent holds its connections in a ``Pool``, as the real agent's one
``aiohttp.ClientSession`` does: a request takes the connection released last, else opens one.
Its beats (1 a second) keep that connection open, so a node's events reuse it; one
connection per kind of request left the events' socket idle between launches, the server
closed it at its keep-alive timeout (15 s), and every relaunch reconnected all 2,048 nodes
at once, which a real agent does not.

It speaks only what the supervisor's aiohttp server answers: HTTP/1.1 with a
``Content-Length`` body (no chunked encoding; a response without a length is an error).
A connection the server closed while idle (its keep-alive timeout) is reopened and the
request sent once more, only when nothing of the answer had arrived.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlencode, urlsplit


class HttpError(OSError):
    """The connection failed or the answer was not one this client reads."""


class _Proto(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.closed = False
        self.got_any = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_any = True
        self.buf += data
        self._try_parse()

    def _try_parse(self) -> None:
        if self.waiter is None or self.waiter.done():
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        try:
            status = int(head[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            self.waiter.set_exception(HttpError(f"bad status line {head[0][:80]!r}"))
            return
        length, close = None, False
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value.strip())
            elif name == "connection" and value.strip().lower() == "close":
                close = True
            elif name == "transfer-encoding":
                self.waiter.set_exception(HttpError("chunked answers are not read here"))
                return
        if length is None:
            self.waiter.set_exception(HttpError("an answer without Content-Length"))
            return
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        self.waiter.set_result((status, body, close))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection lost: {exc!r}"))


class Conn:
    """One keep-alive connection to ``url`` speaking for ``token``; one request at a time."""

    opened = 0  # connections opened by every Conn of this process (the supervisor's accepts)

    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._headers = (f"Host: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
                         "Connection: keep-alive\r\n").encode()
        self._proto: _Proto | None = None
        self._lock = asyncio.Lock()

    async def _open(self) -> _Proto:
        if self._proto is None or self._proto.closed:
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(_Proto, self.host, self.port)
            Conn.opened += 1
            self._proto = proto
        return self._proto

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None

    async def request(self, method: str, path: str, timeout: float, *,
                      json_body: Any = None, params: dict[str, Any] | None = None,
                      raw: bool = False) -> tuple[int, Any]:
        """(status, parsed JSON body; text for a status >= 400 or with ``raw``). Raises
        ``HttpError`` or ``TimeoutError``; the connection is then dropped (an answer may still be coming)."""
        target = path + ("?" + urlencode(params) if params else "")
        body = b"" if json_body is None else json.dumps(json_body, separators=(",", ":"),
                                                        allow_nan=False).encode()
        head = f"{method} {target} HTTP/1.1\r\n".encode() + self._headers
        if json_body is not None:
            head += b"Content-Type: application/json\r\n"
        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    status, body_bytes = await self._send(data, retry=True)
            except TimeoutError:
                self.close()
                raise
            except OSError as exc:
                self.close()
                raise HttpError(str(exc)) from exc
        if status >= 400 or raw:
            return status, body_bytes.decode("utf-8", "replace")
        return status, json.loads(body_bytes) if body_bytes else None

    async def _send(self, data: bytes, retry: bool) -> tuple[int, bytes]:
        proto = await self._open()
        loop = asyncio.get_running_loop()
        proto.waiter = loop.create_future()
        proto.got_any = False
        assert proto.transport is not None
        proto.transport.write(data)
        try:
            status, body, close = await proto.waiter
        except HttpError:
            if retry and not proto.got_any:  # closed while idle: the request never ran
                self.close()
                return await self._send(data, retry=False)
            raise
        finally:
            proto.waiter = None
        if close:
            self.close()
        return status, body


class Pool:
    """The connections of one agent, used as aiohttp's connector uses them: the idle one
    released last, else a new one (kept, and reopened if the server closed it)."""

    def __init__(self, url: str, token: str) -> None:
        self._url, self._token = url, token
        self._idle: list[Conn] = []
        self._all: list[Conn] = []

    @property
    def size(self) -> int:
        return len(self._all)

    async def request(self, method: str, path: str, timeout: float,
                      **kwargs: Any) -> tuple[int, Any]:
        if self._idle:
            conn = self._idle.pop()
        else:
            conn = Conn(self._url, self._token)
            self._all.append(conn)
        try:
            return await conn.request(method, path, timeout, **kwargs)
        finally:
            self._idle.append(conn)

    def close(self) -> None:
        for conn in self._all:
            conn.close()
