"""Host and storage checks: free disk and memory, the shared filesystem, the checkpoint root.

Each function takes the node's ``NodeContext`` and returns an ``Outcome``; they run in the
check process (``orchestrator.health.child``), where a hung mount costs only the timeout.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from orchestrator.contracts.rundir import is_remote
from orchestrator.health.base import Outcome, failed, passed, skipped
from orchestrator.health.context import NodeContext

GIB = 1024**3
# Enough to exercise a real write and read of a checkpoint store, small enough for s3.
_PROBE_BYTES = 1 << 20


def is_local(url: str) -> bool:
    """A plain path or file:// URL (checked with os calls); anything else goes by fsspec."""
    return not is_remote(url)


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://")).expanduser()


def scratch_dir(ctx: NodeContext) -> Path:
    return Path(ctx.scratch_dir).expanduser() if ctx.scratch_dir else Path(tempfile.gettempdir())


def probe_dir(path: Path) -> tuple[float | None, str | None]:
    """(free GiB, problem) of a directory: created if missing, then written to and read."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".orchestrator-health-{os.getpid()}"
        probe.write_bytes(b"health")
        ok = probe.read_bytes() == b"health"
        probe.unlink()
        if not ok:
            return None, f"{path} returned different bytes than were written"
        return shutil.disk_usage(path).free / GIB, None
    except OSError as exc:
        return None, f"{path} is not writable: {exc.strerror or exc}"


def check_disk(ctx: NodeContext) -> Outcome:
    """Free space on the checkpoint directory (when local) and the scratch directory."""
    dirs = {"scratch": scratch_dir(ctx)}
    if ctx.checkpoint_root and is_local(ctx.checkpoint_root):
        dirs["checkpoint"] = local_path(ctx.checkpoint_root)
    floor = ctx.floors.disk_gib
    problems, free = [], {}
    for role, path in dirs.items():
        gib, problem = probe_dir(path)
        if problem:
            problems.append(f"{role} dir {problem}")
            continue
        assert gib is not None
        free[f"{role}_free_gib"] = round(gib, 2)
        if gib < floor:
            problems.append(f"{role} dir {path}: {gib:.2f} GiB free, floor {floor:g} GiB")
    if problems:
        return failed("; ".join(problems), **free)
    return passed(", ".join(f"{k.split('_')[0]} {v:.1f} GiB free" for k, v in free.items()),
                  **free)


def available_memory_gib(meminfo: str | None = None) -> float:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    raise ValueError("no MemAvailable line in /proc/meminfo")


def check_memory(ctx: NodeContext) -> Outcome:
    gib = available_memory_gib()
    floor = ctx.floors.memory_gib
    if gib < floor:
        return failed(f"{gib:.2f} GiB available, floor {floor:g} GiB", available_gib=round(gib, 2))
    return passed(f"{gib:.1f} GiB available", available_gib=round(gib, 2))


def check_shared_fs(ctx: NodeContext) -> Outcome:
    """Read the head's nonce file under the checkpoint root, write this node's own.

    The head then reads every node's file (``coordinator``): together they show one
    filesystem that all nodes see the same way, which a multi-node local checkpoint needs
    (every rank writes its shard, rank 0 commits the manifest, a restart reads them all).
    """
    probe = ctx.shared_fs
    if probe is None:
        return skipped(f"not applicable: {ctx.shared_fs_note or 'no probe from the head'}")
    path = Path(probe.path)
    try:
        seen = path.read_text()
    except FileNotFoundError:
        return failed(f"does not see the head's file {path}: the checkpoint root is not on a "
                      "filesystem shared with the head")
    except OSError as exc:
        return failed(f"cannot read {path}: {exc.strerror or exc}")
    if seen != probe.content:
        return failed(f"{path} holds {seen[:40]!r}, not the head's {probe.content!r}: a "
                      "different filesystem is mounted there")
    try:
        Path(probe.write_path).write_text(f"{probe.content} {ctx.node_id}")
    except OSError as exc:
        return failed(f"cannot write {probe.write_path}: {exc.strerror or exc}")
    return passed(f"sees the head's file under {path.parent}")


def check_modules(ctx: NodeContext) -> Outcome:
    """The optional modules the job needs import here (looked up, not imported)."""
    from orchestrator.extras import MissingExtra, installed

    if not ctx.modules:
        return skipped("the job needs no optional module")
    missing = [str(MissingExtra(m, why)) for m, why in ctx.modules.items() if not installed(m)]
    if missing:
        return failed("; ".join(missing), missing=sorted(m for m in ctx.modules
                                                         if not installed(m)))
    return passed(f"installed: {', '.join(sorted(ctx.modules))}")


def check_storage(ctx: NodeContext) -> Outcome:
    """Write 1 MiB under the checkpoint root (path or fsspec URL), read it back, delete it."""
    import fsspec

    from orchestrator.extras import MissingExtra, module_for_url, require_for_url

    root = ctx.checkpoint_root
    if not root:
        return skipped("no checkpoint root configured")
    try:
        require_for_url(root, f"the checkpoint root {root}")
    except MissingExtra as exc:
        return failed(str(exc), missing=[module_for_url(root)])
    fs, base = fsspec.core.url_to_fs(root)
    target = f"{base.rstrip('/')}/.health/{ctx.nonce}-{ctx.node_id}.probe"
    data = os.urandom(_PROBE_BYTES)
    try:
        if is_local(root):  # object stores have no directories (and s3fs would make a bucket)
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        t0 = time.perf_counter()
        fs.pipe_file(target, data)
        t1 = time.perf_counter()
        back = fs.cat_file(target)
        t2 = time.perf_counter()
        fs.rm_file(target)
    except (OSError, ValueError) as exc:
        return failed(f"{root} is not writable and readable: {type(exc).__name__}: {exc}")
    if back != data:
        return failed(f"{root} returned {len(back)} different bytes for the {len(data)} written")
    mib = _PROBE_BYTES / 2**20
    write_mbps, read_mbps = mib / max(t1 - t0, 1e-9), mib / max(t2 - t1, 1e-9)
    return passed(f"{root}: wrote and read back 1 MiB ({write_mbps:.0f} / {read_mbps:.0f} MiB/s)",
                  write_mib_s=round(write_mbps, 1), read_mib_s=round(read_mbps, 1))
