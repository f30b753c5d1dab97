"""Is a run's supervisor alive? Its pid (``supervisor.json``, ``supervisor.pid``) and its API.

The CLI asks before it acts: ``up --resume`` refuses to start a second supervisor (and never
touches a live one's pid file), ``status`` and ``down`` say when none is running and print
the command that resumes the job.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from orchestrator.contracts.rundir import RunDir

# /healthz answers in milliseconds on a live supervisor; a busy one still answers within this.
_HEALTHZ_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Liveness:
    """What the run directory and the API say about the supervisor."""

    pid: int | None
    pid_alive: bool
    api_url: str | None
    api_ok: bool

    @property
    def running(self) -> bool:
        return self.api_ok or self.pid_alive

    def describe(self) -> str:
        if self.api_ok:
            return f"running (pid {self.pid}, {self.api_url})"
        if self.pid_alive:
            return f"process {self.pid} alive but its API does not answer ({self.api_url})"
        pid = f"pid {self.pid} gone" if self.pid else "no pid recorded"
        api = f"API at {self.api_url} silent" if self.api_url else "no API address recorded"
        return f"not running ({pid}, {api})"


def resume_command(run: RunDir) -> str:
    return f"orchestrator up --resume {run.root} --detach"


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (and is not a zombie we could reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _is_orchestrator(pid: int) -> bool:
    """A recycled pid belongs to some other program: ask its command line (Linux)."""
    if not os.path.isdir("/proc"):
        return True  # no /proc to ask: trust the pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"orchestrator" in f.read(65536)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc to ask: trust the pid


def _pid_of(run: RunDir, info: dict[str, Any] | None) -> int | None:
    candidates: list[Any] = [(info or {}).get("pid")]
    try:
        candidates.append(int(run.pid_file.read_text().strip()))
    except (OSError, ValueError):
        pass
    for pid in candidates:
        if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**22:
            return pid
    return None


def api_urls(info: dict[str, Any] | None) -> list[str]:
    """Where the supervisor's API may answer: loopback at its port, then its advertised URL."""
    if not info:
        return []
    urls = []
    port = info.get("port")
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
        urls.append(f"http://127.0.0.1:{port}")
    url = info.get("url")
    if isinstance(url, str) and url.startswith(("http://", "https://")) and len(url) < 300:
        urls.append(url.rstrip("/"))
    return list(dict.fromkeys(urls))


def api_ssl_context(run: RunDir) -> ssl.SSLContext | None:
    """For a supervisor serving TLS (``api.tls_ca`` in the run's config): a context that
    trusts that CA; None for plain HTTP or when the config cannot be read."""
    try:
        import yaml

        cfg = yaml.safe_load(run.config.read_text())
        ca = (cfg.get("api") or {}).get("tls_ca") if isinstance(cfg, dict) else None
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    return ssl.create_default_context(cafile=ca) if isinstance(ca, str) and ca else None


def healthz(url: str, timeout: float = _HEALTHZ_TIMEOUT_S,
            context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout,
                                    context=context if url.startswith("https") else None) \
                as resp:
            body = json.loads(resp.read(65536))
    except (urllib.error.URLError, OSError, ValueError, RecursionError):
        return False
    return isinstance(body, dict) and body.get("ok") is True


def supervisor_info(run: RunDir) -> dict[str, Any] | None:
    """``supervisor.json`` when it holds a JSON object (a torn or foreign file reads as None)."""
    info = run.read_supervisor_info()
    return info if isinstance(info, dict) else None


def check(run: RunDir) -> Liveness:
    info = supervisor_info(run)
    pid = _pid_of(run, info)
    alive = (pid is not None and pid != os.getpid() and pid_alive(pid)
             and _is_orchestrator(pid))
    urls = api_urls(info)
    context = api_ssl_context(run)
    ok_url = next((u for u in urls if healthz(u, context=context)), None)
    return Liveness(pid, alive, ok_url or (urls[0] if urls else None), ok_url is not None)
