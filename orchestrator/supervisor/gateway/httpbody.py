"""Reading a request body into a protocol model, and the JSON error answers of the API: shared
by the supervisor's server and its heartbeat process (``beatfront``), so both refuse the same
body with the same status and words."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.client_max_size, actual_size=request.content_length or 0,
            text=json.dumps({"error": "body is larger than api.max_body_mb"}),
            content_type="application/json") from None


def parse_body(raw: bytes, model: type[M], max_json_depth: int) -> M:
    """``raw`` as ``model``, or an HTTP 400 (not JSON, not an object) / 422 (invalid) naming
    the problems."""
    try:
        return model.model_validate_json(raw, context={"max_json_depth": max_json_depth})
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise bad(400, {"error": f"body is not valid JSON: {errors[0]['msg']}"}) from None
        if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
            raise bad(400, {"error": "body must be a JSON object"}) from None
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"[:300]
                    for e in errors][:20]
        raise bad(422, {"error": "invalid request", "problems": problems}) from None


def bad(status: int, body: dict[str, Any]) -> web.HTTPException:
    cls = web.HTTPBadRequest if status == 400 else web.HTTPUnprocessableEntity
    return cls(text=json.dumps(body), content_type="application/json")


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
