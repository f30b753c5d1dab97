"""A real S3 endpoint for tests: moto's server on 127.0.0.1, and a fault-injecting proxy.

``S3Endpoint`` runs ``ThreadedMotoServer`` bound to the loopback interface and creates a
bucket; s3fs reaches it over HTTP through ``AWS_ENDPOINT_URL_S3`` (the standard AWS
variable, so child processes such as ranks inherit it). ``FaultProxy`` sits in front of it
and answers S3 error responses (503 SlowDown, 500 InternalError) to chosen requests, or
holds them, then forwards the rest to moto unchanged.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_ERRORS = {500: ("InternalError", "We encountered an internal error. Please try again."),
           503: ("SlowDown", "Please reduce your request rate.")}
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer",
        "upgrade", "content-length", "expect"}  # the proxy already answered 100-continue


@dataclass
class Rule:
    """Fail (``status``) or hold (``status`` None) requests matching ``match``, ``count`` times
    (None: until removed)."""

    match: Callable[[str, str], bool]
    status: int | None = 503
    count: int | None = 1
    hits: int = 0


@dataclass
class FaultProxy:
    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    log: list[tuple[str, str, int]] = field(default_factory=list)  # method, path, status
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
        self.release.set()

    def count(self, method: str | None = None, status: int | None = None,
              contains: str = "") -> int:
        with self.lock:
            return sum(1 for m, p, s in self.log if (method is None or m == method)
                       and (status is None or s == status) and contains in p)

    def _rule_for(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.match(method, path) and (rule.count is None or rule.hits < rule.count):
                    rule.hits += 1
                    return rule
        return None

    def serve(self, host: str = "127.0.0.1",
              ) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
        """Serve on ``host`` (any free port), in a thread."""
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                rule = proxy._rule_for(self.command, self.path)
                if rule is not None and rule.status is None:
                    proxy.release.wait(120)  # held: the client times out or is killed first
                if rule is not None and rule.status is not None:
                    code, message = _ERRORS[rule.status]
                    data = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                            f"<Message>{message}</Message></Error>").encode()
                    self._reply(rule.status, {"Content-Type": "application/xml"}, data)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                # A HEAD answer has no body but the object's Content-Length: pass it on.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self._reply(resp.status, {k: v for k, v in resp.getheaders()
                                          if k.lower() not in _HOP}, data, length)
                conn.close()

            def _reply(self, status: int, headers: dict[str, str], data: bytes,
                       length: str | None = None) -> None:
                with proxy.lock:
                    proxy.log.append((self.command, self.path, status))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        server = http.server.ThreadingHTTPServer((host, 0), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return server, thread


@dataclass
class S3Endpoint:
    url: str  # what clients use: the proxy in front of moto
    moto_url: str
    bucket: str
    proxy: FaultProxy


@contextmanager
def s3_endpoint(bucket: str = "ckpt") -> Iterator[S3Endpoint]:
    """moto on 127.0.0.1 with a bucket, behind a FaultProxy; yields the endpoint."""
    import s3fs
    from moto.server import ThreadedMotoServer

    # fsspec caches S3 filesystems by their options, not by the endpoint in the environment:
    # one made for an earlier endpoint must not be reused for this one.
    s3fs.S3FileSystem.clear_instance_cache()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        # moto keeps its buckets in this process's memory, across servers: start empty.
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(
            f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=30).read()
        proxy = FaultProxy(port)
        server, thread = proxy.serve()
        import boto3

        boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing",
                     ).create_bucket(Bucket=bucket)
        try:
            yield S3Endpoint(f"http://127.0.0.1:{proxy.port}", f"http://{host}:{port}",
                             bucket, proxy)
        finally:
            proxy.clear()
            server.shutdown()
            server.server_close()
            thread.join(5)
    finally:
        moto.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def aws_env(endpoint: str) -> dict[str, str]:
    """Credentials for moto (any value works) and the endpoint, as the AWS chain reads them."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint}


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
