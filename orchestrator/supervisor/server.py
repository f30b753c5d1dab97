"""The supervisor's HTTP endpoint: the agents' control API, /metrics, /healthz, /v1/status.

Every /v1 route needs the job's token (``Authorization: Bearer ...``); a request without it
gets 401 and changes nothing. Bodies are validated by the protocol's pydantic models: a
malformed request gets a 4xx naming the problem, never a crash of the supervisor.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from orchestrator.protocol import EventBatch, Heartbeat, RegisterRequest
from orchestrator.supervisor.intake import UnknownNode

if TYPE_CHECKING:
    from orchestrator.jobview import JobView
    from orchestrator.rundir import RunDir
    from orchestrator.supervisor.bookkeeper import BookKeeper
    from orchestrator.supervisor.intake import Intake
    from orchestrator.supervisor.metrics import SupervisorMetrics


class SupervisorApi(Protocol):
    """What the API serves from: the supervisor, seen only through these (no import of it,
    so the server and the supervisor form no cycle)."""

    token: str
    intake: Intake
    rundir: RunDir
    books: BookKeeper
    metrics: SupervisorMetrics
    log: Any

    @property
    def view(self) -> JobView: ...

    def request_stop(self, reason: str = "operator") -> None: ...

# An agent's long-poll waits at most this long for a new assignment, then asks again.
_POLL_MAX_S = 30.0
# Open requests get this long to finish when the server stops.
_SHUTDOWN_GRACE_S = 2.0
# Bodies beyond this are refused (a heartbeat of 100k records is ~10 MB).
_MAX_BODY = 32 * 2**20


class ApiServer:
    def __init__(self, sup: SupervisorApi) -> None:
        self.sup = sup
        self._runner: web.AppRunner | None = None
        app = web.Application(client_max_size=_MAX_BODY, middlewares=[self._guard])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/register", self.register)
        app.router.add_post("/v1/heartbeat", self.heartbeat)
        app.router.add_post("/v1/events", self.events)
        app.router.add_get("/v1/assignment", self.assignment)
        app.router.add_post("/v1/stop", self.stop_job)
        app.router.add_get("/v1/status", self.status)
        self.app = app

    async def start(self, host: str, port: int) -> int:
        # At shutdown, agents' long-polls (up to _POLL_MAX_S) would hold cleanup() that long;
        # every agent has been told to exit by then, so they are cut after a short grace.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     shutdown_timeout=_SHUTDOWN_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        return sockets[0].getsockname()[1] if sockets else port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- middleware ------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode(), self.sup.token.encode()):
                return _error(401, "missing or wrong token")
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except UnknownNode as exc:
            return _error(404, f"unknown node {exc.args[0]!r}; register first")
        except Exception as exc:  # a bug must not take the control plane down
            self.sup.log.exception("api handler failed", path=request.path)
            return _error(500, f"internal error: {type(exc).__name__}")

    # -- routes ------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "state": self.sup.view.state.value})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.sup.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def register(self, request: web.Request) -> web.Response:
        req = await _parse(request, RegisterRequest)
        resp = self.sup.intake.on_register(req)
        return web.json_response(resp.model_dump(mode="json"))

    async def heartbeat(self, request: web.Request) -> web.Response:
        hb = await _parse(request, Heartbeat)
        return web.json_response(self.sup.intake.on_heartbeat(hb))

    async def events(self, request: web.Request) -> web.Response:
        batch = await _parse(request, EventBatch)
        self.sup.intake.on_events(batch)
        return web.json_response({"accepted": len(batch.events)})

    async def assignment(self, request: web.Request) -> web.Response:
        q = request.query
        node_id = q.get("node_id", "")
        try:
            after = int(q.get("after", "-1"))
            timeout = min(float(q.get("timeout", str(_POLL_MAX_S))), _POLL_MAX_S)
        except ValueError:
            return _error(400, "after and timeout must be numbers")
        if not node_id:
            return _error(400, "node_id is required")
        a = await self.sup.intake.poll_assignment(node_id, after, max(0.0, timeout))
        return web.json_response(a.model_dump(mode="json") if a else {})

    async def stop_job(self, request: web.Request) -> web.Response:
        reason = "operator"
        if request.can_read_body:
            try:
                body = await request.json()
                reason = str(body.get("reason", reason))[:200]
            except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
                return _error(400, "body must be a JSON object")
        self.sup.request_stop(reason)
        return web.json_response({"stopping": True, "state": self.sup.view.state.value})

    async def status(self, request: web.Request) -> web.Response:
        from orchestrator.status import build_status

        return web.json_response(build_status(self.sup.view, self.sup.rundir,
                                              live_nodes=self.sup.intake.nodes,
                                              ledger=self.sup.books.refresh()))


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.read()
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body is not valid JSON"}),
                                 content_type="application/json") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}),
                                 content_type="application/json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                    for e in exc.errors(include_url=False)][:20]
        raise web.HTTPUnprocessableEntity(
            text=json.dumps({"error": "invalid request", "problems": problems}),
            content_type="application/json") from None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
