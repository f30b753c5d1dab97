"""Which storage errors are worth retrying, and the tenacity policy that retries them.

Transient: throttling (503 SlowDown, 429), server errors (5xx), timeouts and dropped
connections. Everything else (access denied, no such bucket, disk full, a bug) is permanent
and fails at once, so a misconfiguration is reported in seconds, not after minutes of backoff.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")

_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled",
                    "TooManyRequests", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "OperationAborted"}
# What s3fs turns those codes into (EBUSY: SlowDown; EREMOTEIO: InternalError; ...).
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNREFUSED, errno.ECONNABORTED, errno.EAGAIN, errno.EPIPE}
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError",
                    "ReadTimeoutError", "ProxyConnectionError", "ClientConnectorError",
                    "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
                    "ResponseStreamingError", "IncompleteReadError"}


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def is_transient(exc: BaseException) -> bool:
    """True when retrying ``exc`` may succeed (throttling, 5xx, timeouts, lost connections)."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            code = (response.get("Error") or {}).get("Code", "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
            return code in _TRANSIENT_CODES or status >= 500 or status == 429
        if type(e).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(e, (TimeoutError, ConnectionError)):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def describe(exc: BaseException) -> str:
    """A one-line error without credentials: the exception type and message only."""
    return f"{type(exc).__name__}: {exc}"[:500]


def retrying(attempts: int, initial_s: float, max_s: float,
             on_retry: Callable[[int, BaseException, float], None] | None = None,
             ) -> Callable[[Callable[[], T]], T]:
    """``call(fn)`` runs ``fn`` with up to ``attempts`` tries, exponential backoff with jitter
    from ``initial_s`` up to ``max_s``, retrying only transient errors; ``on_retry(attempt,
    error, sleep_s)`` is told before each sleep. The last error is raised as it was."""

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            exc = state.outcome.exception()
            if exc is not None:
                on_retry(state.attempt_number, exc, state.next_action.sleep
                         if state.next_action else 0.0)

    policy = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=initial_s, max=max_s)
        + tenacity.wait_random(0, initial_s),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep, reraise=True)

    def call(fn: Callable[[], T]) -> T:
        return policy.copy()(fn)  # a copy per call: the uploader and a restore may overlap

    return call


def no_retry(fn: Callable[[], Any]) -> Any:
    return fn()
