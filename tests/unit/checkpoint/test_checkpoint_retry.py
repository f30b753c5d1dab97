"""Transient vs permanent storage errors, and the retry policy built on tenacity."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from trainer.checkpoint.retry import is_transient, retrying


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def s3fs_style(code: str, status: int, err: int) -> OSError:
    """What s3fs raises: an OSError whose cause is botocore's ClientError."""
    exc = OSError(err, "translated")
    exc.__cause__ = client_error(code, status)
    return exc


@pytest.mark.parametrize("exc", [
    client_error("SlowDown", 503), client_error("InternalError", 500),
    client_error("Whatever", 502), client_error("TooManyRequests", 429),
    s3fs_style("SlowDown", 503, errno.EBUSY), s3fs_style("ServiceUnavailable", 503, errno.EIO),
    EndpointConnectionError(endpoint_url="http://x"), ConnectionResetError(),
    TimeoutError(), OSError(errno.ETIMEDOUT, "timed out"),
])
def test_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    client_error("AccessDenied", 403), client_error("NoSuchBucket", 404),
    s3fs_style("AccessDenied", 403, errno.EACCES), PermissionError("no"),
    FileNotFoundError("gone"), OSError(errno.ENOSPC, "full"), ValueError("bug"),
])
def test_permanent(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_retries_transient_errors_then_succeeds() -> None:
    calls, told = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise s3fs_style("SlowDown", 503, errno.EBUSY)
        return "done"

    call = retrying(5, 0.001, 0.002, on_retry=lambda a, e, s: told.append((a, type(e))))
    assert call(flaky) == "done"
    assert len(calls) == 3 and told == [(1, OSError), (2, OSError)]


def test_gives_up_after_the_attempts_and_raises_the_last_error() -> None:
    calls = []

    def always() -> None:
        calls.append(1)
        raise client_error("InternalError", 500)

    with pytest.raises(ClientError):
        retrying(4, 0.001, 0.001)(always)
    assert len(calls) == 4


def test_permanent_errors_fail_at_once() -> None:
    calls = []

    def denied() -> None:
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(ClientError):
        retrying(8, 0.001, 0.001)(denied)
    assert len(calls) == 1
