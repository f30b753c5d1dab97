"""The heartbeat process: serves the agents' heartbeats on the supervisor's second core.

At 2,048 nodes x 8 ranks, one heartbeat a second per node, HTTP alone (aiohttp's parsing and
answering, about 0.3 ms a beat) held the supervisor's event loop 60-90 % of the time, and every
other thing on that loop (registrations, stops, the journal) waited behind it. With
``api.heartbeat_process``, the supervisor starts this process (``beatlink``), and agents send
their heartbeats to its port (``RegisterResponse.heartbeat_port``):

- it authenticates the node (the same node credential), reads and parses the body with the
  protocol's model (the same 400 / 413 / 422 answers as the supervisor);
- a beat its mirror says is fine (a registered node, speaking for itself and its ranks) is
  answered at once and passed on in a batch; the supervisor parses and checks it again and
  folds it in, so what the supervisor uses it parsed itself;
- any other beat (an unknown node, a rank outside the node's slice) is asked of the
  supervisor, whose answer (404, 403 and its ``message_rejected``...) is passed back: a mirror
  that lags costs a round trip, never a wrong refusal.

The process holds no state of its own beyond the mirror, writes nothing, and exits when the
supervisor's end of the socket closes. Should it die, agents fall back to the supervisor's
port (``orchestrator.agent``).

    python -m orchestrator.supervisor.gateway.beatfront --fd N   (started by ``beatlink`` only)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import socket
import ssl
import sys

from aiohttp import web

from orchestrator.contracts.auth import authenticate, bearer_of
from orchestrator.logs import configure_logging, get_logger
from orchestrator.contracts.protocol import Heartbeat
from orchestrator.supervisor.gateway import admission, beatwire
from orchestrator.supervisor.gateway.httpbody import error, parse_body, read_body

# The supervisor's answer to an asked beat comes within this, or the agent gets a 504.
ASK_TIMEOUT_S = 10.0
# Beats waiting to be written to a supervisor that does not read: past this, beats get 503.
_MAX_BACKLOG_BYTES = 256 * 2**20


class Front:
    def __init__(self, setup: beatwire.Setup, writer: asyncio.StreamWriter) -> None:
        self.setup = setup
        self.writer = writer
        self.limits = admission.Limits(world_size=setup.world_size,
                                       max_step_interval_s=setup.max_step_interval_s,
                                       max_nodes=setup.max_nodes)
        self.nodes: dict[str, int] = {}  # registered node -> its assignment version
        self.launch: beatwire.Launch | None = None
        self._pending: list[tuple[str, bytes]] = []
        self._asks: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._ids = itertools.count(1)
        self.log = get_logger("orchestrator.beatfront")

    # -- from the supervisor -------------------------------------------------------------
    def on_mirror(self, m: beatwire.Mirror) -> None:
        self.nodes.update(m.nodes)
        if m.launch is not None:
            self.launch = m.launch

    def on_reply(self, request_id: int, status: int, body: bytes) -> None:
        fut = self._asks.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_result((status, body))

    # -- to the supervisor ---------------------------------------------------------------
    def _slice(self, node: str) -> admission.Slice | None:
        if self.launch is None:
            return None
        node_rank = self.launch.node_ranks.get(node)
        if node_rank is None:
            return admission.Slice(self.launch.generation)
        ppn = self.setup.ppn
        return admission.Slice(self.launch.generation, node_rank * ppn, (node_rank + 1) * ppn)

    def _pass_on(self, node: str, raw: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((node, raw))

    def _flush(self) -> None:
        beats, self._pending = self._pending, []
        if self.writer.is_closing():
            return
        # Frames of at most one body's bound (the supervisor reads no larger).
        batch: list[tuple[str, bytes]] = []
        size, bound = 0, beatwire.frame_bound(self.setup.max_body_mb)
        for node, raw in beats:
            if batch and size + len(raw) + 256 > bound:
                self.writer.write(beatwire.beats_frame(batch))
                batch, size = [], 0
            batch.append((node, raw))
            size += len(raw) + 256
        if batch:
            self.writer.write(beatwire.beats_frame(batch))

    async def _ask(self, node: str, raw: bytes) -> web.Response:
        request_id = next(self._ids)
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._asks[request_id] = fut
        self.writer.write(beatwire.ask_frame(request_id, node, raw))
        try:
            status, body = await asyncio.wait_for(fut, ASK_TIMEOUT_S)
        except TimeoutError:
            self._asks.pop(request_id, None)
            return error(504, "the supervisor did not answer in time")
        return web.Response(status=status, body=body, content_type="application/json")

    # -- the route -----------------------------------------------------------------------
    async def heartbeat(self, request: web.Request) -> web.Response:
        who = authenticate(self.setup.token, bearer_of(request.headers.get("Authorization", "")))
        if who is None:
            return error(401, "missing or wrong token")
        if who.kind != "node" or who.node_id is None:
            return error(403, "this route needs a node's credential")
        node = who.node_id
        raw = await read_body(request)
        hb = parse_body(raw, Heartbeat, self.setup.max_json_depth)
        transport = self.writer.transport
        if transport.get_write_buffer_size() > _MAX_BACKLOG_BYTES:
            return error(503, "the supervisor is not taking heartbeats; retry")
        version = self.nodes.get(node)
        if version is not None and admission.check_heartbeat(
                node, hb, self._slice(node), self.limits) is None:
            self._pass_on(node, raw)
            return web.json_response({"assignment_version": version})
        return await self._ask(node, raw)


async def _read_setup(reader: asyncio.StreamReader) -> beatwire.Setup:
    kind, payload = await beatwire.read_frame(reader, 1 << 20)
    if kind != beatwire.SETUP:
        raise beatwire.BadFrame(f"expected the setup frame, got {kind!r}")
    return beatwire.Setup.model_validate_json(payload)


async def serve(sock: socket.socket) -> int:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    setup = await _read_setup(reader)
    configure_logging(None, component="beatfront", level=setup.log_level)
    front = Front(setup, writer)
    app = web.Application(client_max_size=int(setup.max_body_mb * 2**20))
    app.router.add_post("/v1/heartbeat", front.heartbeat)
    runner = web.AppRunner(app, access_log=None, handle_signals=False,
                           keepalive_timeout=setup.header_timeout_s, shutdown_timeout=1.0)
    await runner.setup()
    tls = None
    if setup.tls_cert and setup.tls_key:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(setup.tls_cert, setup.tls_key)
    site = web.TCPSite(runner, setup.host, setup.port, reuse_address=True, ssl_context=tls,
                       backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    writer.write(beatwire.model_frame(beatwire.READY, beatwire.Ready(port=bound)))
    front.log.info("heartbeat process listening", port=bound)
    limit = beatwire.frame_bound(setup.max_body_mb)
    try:
        while True:
            try:
                kind, payload = await beatwire.read_frame(reader, limit)
            except asyncio.IncompleteReadError:
                return 0  # the supervisor closed its end: it is done, or gone
            if kind == beatwire.MIRROR:
                front.on_mirror(beatwire.Mirror.model_validate_json(payload))
            elif kind == beatwire.REPLY:
                front.on_reply(*beatwire.parse_reply(payload))
            else:
                raise beatwire.BadFrame(f"unexpected frame {kind!r} from the supervisor")
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True,
                    help="the socket the supervisor handed over")
    a = ap.parse_args(argv)
    # An operator's Ctrl-C reaches the whole process group: the supervisor shuts down in
    # order and closes the socket, which ends this process after the agents are told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asyncio.run(serve(socket.socket(fileno=a.fd)))


if __name__ == "__main__":
    sys.exit(main())
