"""The supervisor's HTTP endpoint: the agents' control API, /metrics, /healthz, /v1/status.

Who may call what (``contracts.auth``): the agents' routes (register, heartbeat, events,
assignment) need a node's own credential, the operator's routes (stop, profile, status) the
job secret; anything else gets 401. A node speaks only for itself and its ranks (``admission``): a message
it may not send gets 403 and a ``message_rejected`` journal event naming it, and changes
nothing. Bodies are parsed straight from bytes into the protocol's strict models: a malformed
request gets a 4xx naming the problem, never a crash of the supervisor. Size, depth, header
time and node count are bounded by the ``api`` config section.
"""

from __future__ import annotations

import dataclasses
import json
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.contracts.auth import Principal, authenticate, bearer_of
from orchestrator.contracts.protocol import (
    EventBatch,
    Heartbeat,
    ProfileRequest,
    RegisterRequest,
    StopRequest,
)
from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.gateway import admission, beatwire
from orchestrator.supervisor.gateway.beatlink import BeatLink
from orchestrator.supervisor.gateway.httpbody import M, error, parse_body, read_body
from orchestrator.supervisor.intake import UnknownNode
from orchestrator.supervisor.profiles import ProfileRefused

if TYPE_CHECKING:
    from orchestrator.config.schema import Config
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.journal.view import JobView
    from orchestrator.supervisor.intake import Intake
    from orchestrator.supervisor.metrics import SupervisorMetrics


@dataclasses.dataclass(frozen=True)
class ApiWiring:
    """What the API serves from, and nothing else of the supervisor (which it never
    imports): the config and job secret, the node intake (the message half of the
    gateway), the run directory and metrics it reads, and four callables."""

    cfg: Config
    token: str
    intake: Intake
    rundir: RunDir
    metrics: SupervisorMetrics
    log: Any
    view: Callable[[], JobView]  # the journal's fold, as of now
    request_stop: Callable[[str, bool], None]  # (reason, checkpoint): the operator's stop
    ledger: Callable[[], Any]  # the goodput books, brought up to date
    order_profile: Callable[[ProfileRequest], Awaitable[Any]]  # a profile order's event


# An agent's long-poll waits at most this long for a new assignment, then asks again.
_POLL_MAX_S = 30.0
# Open requests get this long to finish when the server stops.
_SHUTDOWN_GRACE_S = 2.0
_NODE_ROUTES = frozenset({"/v1/register", "/v1/heartbeat", "/v1/events", "/v1/assignment"})
_LIVE = (NodeState.REGISTERED, NodeState.ACTIVE, NodeState.SPARE)


def bind_host(cfg: Config) -> str:
    """Where to listen: ``metrics.host``, else the address agents must reach."""
    if cfg.metrics.host:
        return cfg.metrics.host
    return "127.0.0.1" if cfg.launcher.kind == "local" else "0.0.0.0"


def server_ssl_context(cfg: Config) -> ssl.SSLContext | None:
    if not cfg.api.tls_cert or not cfg.api.tls_key:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.api.tls_cert, cfg.api.tls_key)
    return ctx


class ApiServer:
    def __init__(self, sup: ApiWiring) -> None:
        self.sup = sup
        self.api = sup.cfg.api
        self.scheme = "https" if self.api.tls_cert else "http"
        self._runner: web.AppRunner | None = None
        self.link: BeatLink | None = None  # the heartbeat process, with api.heartbeat_process
        self._mirrored_launch: tuple[Any, beatwire.Launch | None] = (None, None)
        job = sup.cfg.job.name
        self._doors = {door: sup.metrics.heartbeats.labels(job, door)
                       for door in ("api", "process")}
        self._process_up = sup.metrics.heartbeat_process_up.labels(job)
        app = web.Application(client_max_size=int(self.api.max_body_mb * 2**20),
                              middlewares=[self._guard])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/register", self.register)
        app.router.add_post("/v1/heartbeat", self.heartbeat)
        app.router.add_post("/v1/events", self.events)
        app.router.add_get("/v1/assignment", self.assignment)
        app.router.add_post("/v1/stop", self.stop_job)
        app.router.add_post("/v1/profile", self.profile)
        app.router.add_get("/v1/status", self.status)
        self.app = app

    async def start(self, host: str | None, port: int) -> int:
        # At shutdown, agents' long-polls (up to _POLL_MAX_S) would hold cleanup() that long;
        # every agent has been told to exit by then, so they are cut after a short grace.
        # keepalive_timeout also runs from a connection's start (aiohttp >= 3.10): a socket
        # that never completes a request's headers is closed after header_timeout_s.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     shutdown_timeout=_SHUTDOWN_GRACE_S,
                                     keepalive_timeout=self.api.header_timeout_s)
        await self._runner.setup()
        # A listen backlog for thousands of agents connecting at once (the default, 128,
        # refused connections at 256-2,048 simulated nodes).
        site = web.TCPSite(self._runner, host or bind_host(self.sup.cfg), port,
                           reuse_address=True, ssl_context=server_ssl_context(self.sup.cfg),
                           backlog=4096)
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        if self.api.heartbeat_process:
            self.link = BeatLink(self._front_setup(host), self._take_forwarded,
                                 self._mirror_nodes, self._mirror_launch, self.sup.log,
                                 on_down=lambda: self._process_up.set(0))
            await self.link.start()
            self._process_up.set(1)
        return sockets[0].getsockname()[1] if sockets else port

    async def stop(self) -> None:
        if self.link is not None:
            await self.link.stop()
            self._process_up.set(0)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the heartbeat process (beatlink / beatfront) --------------------------------------
    def _front_setup(self, host: str | None) -> beatwire.Setup:
        cfg = self.sup.cfg
        return beatwire.Setup(
            host=host or bind_host(cfg), port=self.api.heartbeat_port, token=self.sup.token,
            max_body_mb=self.api.max_body_mb, max_json_depth=self.api.max_json_depth,
            header_timeout_s=self.api.header_timeout_s, tls_cert=self.api.tls_cert,
            tls_key=self.api.tls_key, **dataclasses.asdict(self._limits()),
            ppn=cfg.cluster.procs_per_node)

    def _mirror_nodes(self) -> dict[str, int]:
        return {n: rec.assignment.version for n, rec in self.sup.intake.nodes.nodes.items()}

    def _mirror_launch(self) -> beatwire.Launch | None:
        launches = self.sup.view().launches
        if not launches:
            return None
        launch = launches[-1]
        if self._mirrored_launch[0] is not launch:  # parsed once per launch, not per sync
            self._mirrored_launch = (launch, beatwire.Launch(
                generation=launch["generation"], node_ranks=launch.get("nodes", {})))
        return self._mirrored_launch[1]

    def _take_forwarded(self, node: str, raw: bytes) -> tuple[int, bytes]:
        """The heartbeat route's answer to a beat the heartbeat process passed on or asked
        about: parsed again here, checked against the registry, folded in."""
        try:
            hb = parse_body(raw, Heartbeat, self.api.max_json_depth)
            status, body = self.take_heartbeat(node, hb, door="process")
        except web.HTTPException as exc:
            return exc.status, (exc.text or "").encode()
        except UnknownNode:
            status, body = 404, {"error": f"unknown node {node!r}; register first"}
        except Exception as exc:  # as the guard: a bug must not take the control plane down
            self.sup.log.exception("api handler failed", path="/v1/heartbeat (forwarded)")
            status, body = 500, {"error": f"internal error: {type(exc).__name__}"}
        return status, json.dumps(body).encode()

    # -- middleware ------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            who = authenticate(self.sup.token, bearer_of(request.headers.get("Authorization",
                                                                             "")))
            if who is None:
                return error(401, "missing or wrong token")
            wants_node = request.path in _NODE_ROUTES
            if wants_node != (who.kind == "node"):
                return error(403, "this route needs a node's credential" if wants_node
                              else "this route needs the job's operator token")
            request["principal"] = who
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except UnknownNode as exc:
            return error(404, f"unknown node {exc.args[0]!r}; register first")
        except Exception as exc:  # a bug must not take the control plane down
            # No traceback locals (the logging setup renders without them), no request data.
            self.sup.log.exception("api handler failed", path=request.path)
            return error(500, f"internal error: {type(exc).__name__}")

    def _refuse(self, node_id: str, route: str, refusal: admission.Refusal) -> web.Response:
        # Journaled as ``message_rejected`` naming the node (intake bounds how many).
        self.sup.intake.reject(node_id, route, refusal.reason)
        return error(refusal.status, refusal.reason)

    def _limits(self) -> admission.Limits:
        return admission.Limits(world_size=self.sup.cfg.cluster.world_size,
                                max_step_interval_s=self.api.max_step_interval_s,
                                max_nodes=self.api.max_nodes)

    def _known(self, node_id: str) -> admission.KnownNode | None:
        nodes = self.sup.intake.nodes
        rec = nodes.nodes.get(node_id)
        if rec is None:
            return None
        live = rec.state in _LIVE and nodes.judged_silence(rec) <= self.sup.cfg.timeouts.node_lost_s
        return admission.KnownNode(rec.host, rec.addr, live)

    def _slice(self, node_id: str) -> admission.Slice | None:
        """The node's ranks in the newest launched generation, from the journal's launch
        record (so it holds across a supervisor restart, before assignments are re-sent)."""
        launches = self.sup.view().launches
        if not launches:
            return None
        launch = launches[-1]
        node_rank = launch.get("nodes", {}).get(node_id)
        if node_rank is None:
            return admission.Slice(launch["generation"])
        ppn = self.sup.cfg.cluster.procs_per_node
        return admission.Slice(launch["generation"], node_rank * ppn, (node_rank + 1) * ppn)

    def _past(self, node_id: str) -> admission.PastSlice:
        """The node's slice in an older generation, from that generation's launch record."""
        ppn = self.sup.cfg.cluster.procs_per_node

        def then(generation: int) -> admission.Slice | None:
            for launch in reversed(self.sup.view().launches):
                if launch.get("generation") == generation:
                    node_rank = launch.get("nodes", {}).get(node_id)
                    if node_rank is None:
                        return None
                    return admission.Slice(generation, node_rank * ppn, (node_rank + 1) * ppn)
            return None
        return then

    def _registered(self, node_id: str) -> None:
        if node_id not in self.sup.intake.nodes.nodes:
            raise UnknownNode(node_id)

    # -- routes ------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        view = self.sup.view()
        return web.json_response({"ok": True, "state": view.state.value,
                                  "generation": view.generation,
                                  "epoch": self.sup.intake.nodes.epoch})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.sup.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def register(self, request: web.Request) -> web.Response:
        node = _node(request)
        req = await self._parse(request, RegisterRequest)
        refusal = admission.check_register(node, req, self._known(req.node_id),
                                           len(self.sup.intake.nodes.nodes),
                                           self._slice(node), self._limits())
        if refusal is not None:
            return self._refuse(node, "register", refusal)
        resp = self.sup.intake.on_register(req)
        if self.link is not None:
            self.link.poke()  # the node's beats go to the heartbeat process next
            if self.link.port is not None:
                resp = resp.model_copy(update={"heartbeat_port": self.link.port})
        return web.json_response(resp.model_dump(mode="json"))

    async def heartbeat(self, request: web.Request) -> web.Response:
        node = _node(request)
        hb = await self._parse(request, Heartbeat)
        status, body = self.take_heartbeat(node, hb, door="api")
        return web.json_response(body, status=status)

    def take_heartbeat(self, node: str, hb: Heartbeat, door: str) -> tuple[int, dict[str, Any]]:
        """The answer to a parsed heartbeat from ``node``, by whichever door it came in
        (``api``: this server; ``process``: the heartbeat process). Raises UnknownNode (404)
        for a node that is not registered."""
        if hb.node_id == node:
            self._registered(node)
        refusal = admission.check_heartbeat(node, hb, self._slice(node), self._limits(),
                                            self._past(node))
        if refusal is not None:
            self.sup.intake.reject(node, "heartbeat", refusal.reason)
            return refusal.status, {"error": refusal.reason}
        answer = self.sup.intake.on_heartbeat(hb)
        self._doors[door].inc()
        return 200, answer

    async def events(self, request: web.Request) -> web.Response:
        node = _node(request)
        batch = await self._parse(request, EventBatch)
        if batch.node_id == node:
            self._registered(node)
        refusal = admission.check_events(node, batch, self._slice(node), self._limits(),
                                         self._past(node))
        if refusal is not None:
            return self._refuse(node, "events", refusal)
        self.sup.intake.on_events(batch)
        return web.json_response({"accepted": len(batch.events)})

    async def assignment(self, request: web.Request) -> web.Response:
        node = _node(request)
        q = request.query
        node_id = q.get("node_id", "")
        try:
            after = int(q.get("after", "-1"))
            timeout = float(q.get("timeout", str(_POLL_MAX_S)))
        except ValueError:
            return error(400, "after and timeout must be numbers")
        if not node_id:
            return error(400, "node_id is required")
        if not -1 <= after <= 1 << 53 or not 0.0 <= timeout <= 3600.0:
            return error(400, "after or timeout is out of range")
        refusal = admission.check_node_id(node, node_id)
        if refusal is not None:
            return self._refuse(node, "assignment", refusal)
        a = await self.sup.intake.poll_assignment(node_id, after, min(timeout, _POLL_MAX_S))
        if a is not None and self.link is not None:
            self.link.sync_launch()  # its beats of a new generation need not be asked about
        return web.json_response(a.model_dump(mode="json") if a else {})

    async def stop_job(self, request: web.Request) -> web.Response:
        body = await request.read()
        stop = StopRequest() if not body.strip() else await self._parse(request, StopRequest)
        self.sup.request_stop(stop.reason, stop.checkpoint)
        return web.json_response({"stopping": True, "state": self.sup.view().state.value})

    async def profile(self, request: web.Request) -> web.Response:
        req = await self._parse(request, ProfileRequest)
        try:
            event = await self.sup.order_profile(req)
        except ProfileRefused as exc:
            return error(exc.status, exc.message)
        return web.json_response(event.fields())

    async def status(self, request: web.Request) -> web.Response:
        from orchestrator.journal.status import build_status

        return web.json_response(build_status(self.sup.view(), self.sup.rundir,
                                              live_nodes=self.sup.intake.nodes,
                                              ledger=self.sup.ledger()))

    async def _parse(self, request: web.Request, model: type[M]) -> M:
        return parse_body(await read_body(request), model, self.api.max_json_depth)


def _node(request: web.Request) -> str:
    who: Principal = request["principal"]
    assert who.node_id is not None  # the guard let only node credentials through
    return who.node_id
