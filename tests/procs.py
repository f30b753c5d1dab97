"""Processes tests start, found and killed as a whole; stale torch extension build locks.

Every process a test starts inherits ``PYTEST_PROC_TAG`` (set per test by conftest), even
when it runs in a session of its own (agents, ranks, slurmd's tasks) or was orphaned when
its parent died. At the end of a test, timed out or not, every live process carrying that
test's tag is killed, with its process group. A process started with an environment not
derived from ours carries no tag: such a test must kill its own group (``run_group``).

A torch C++ extension build (DeepSpeed's ops) holds ``<build dir>/lock``, created with
O_EXCL and kept open until the build ends. A build killed half-way leaves the file behind
and every later build waits on it forever (torch's FileBaton spins on its existence). No
process has such a lock open, which is how ``stale_build_locks`` tells it from a live build.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TAG_VAR = "PYTEST_PROC_TAG"  # not ORCH_*: conftest and tests/jobs.py strip those


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def tagged(tag: str) -> list[int]:
    """Live processes (not this one) started with ``PYTEST_PROC_TAG=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    return [pid for pid in _pids()
            if pid != me and needle in _environ(pid).split(b"\0")]


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every process carrying ``tag`` and the process groups they lead.

    Never this process's own group: a child started without a session of its own shares it.
    Returns the pids killed (for the test's log)."""
    own_group = os.getpgrp()
    killed = []
    for pid in tagged(tag):
        try:
            group = os.getpgid(pid)
            if group == pid and group != own_group:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def run_group(cmd: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(capture_output=True, text=True)`` in a session of its own, whose
    whole process group is killed when ``timeout`` passes (subprocess.run would kill only
    the child: ``torch.distributed.run`` died and its two ranks ran on for 25 minutes)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def extensions_root(env: dict[str, str] | None = None) -> Path:
    """Where torch builds C++ extensions: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions
    (torch.utils.cpp_extension's rule; the per-Python subdirectory sits below it)."""
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def _open_files() -> set[str]:
    """Every path some process on this machine holds open (those /proc lets us see)."""
    held: set[str] = set()
    for pid in _pids():
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for fd in names:
            try:
                held.add(os.readlink(f"{fds}/{fd}"))
            except OSError:
                pass
    return held


@dataclass(frozen=True)
class BuildLock:
    path: Path
    held: bool  # some live process has it open: a build is under way


def build_locks(root: Path) -> list[BuildLock]:
    """The ``lock`` files of extension builds under ``root``: ``<op>/lock`` when
    TORCH_EXTENSIONS_DIR names the root, ``<py>_<device>/<op>/lock`` below the default one."""
    locks = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    if not locks:
        return []
    held = _open_files()
    return [BuildLock(p, str(p.resolve()) in held) for p in locks]


def clear_stale_build_locks(root: Path) -> list[Path]:
    """Remove every build lock no process holds; returns the ones removed."""
    removed = []
    for lock in build_locks(root):
        if not lock.held:
            lock.path.unlink(missing_ok=True)
            removed.append(lock.path)
    return removed
