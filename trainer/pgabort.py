"""Aborting this process's process groups for an in-job recovery, and leaving them.

A survivor's recover order aborts its groups from the SDK's order thread
(:func:`abort_groups`): a training thread blocked in a collective with a dead peer gets an
error, with no collective of its own. The gloo groups go first (their abort is immediate,
and it ends the save threads' collectives); the group holding the NCCL communicator goes
last, because ``ncclCommAbort`` returns only once NCCL's proxy service thread has seen the
abort flag, and that thread polls its sockets with a 500 ms timeout: about half a second
every time, measured (``bench/recovery/abort_latency.py``).

The abort flag stops the communicator's kernels at once, so the training thread can be
past its blocked host sync long before the abort returns. :func:`leave_groups` with
``overlap`` then forgets the old groups without waiting for their aborts: c10d's world is
cleared as ``destroy_process_group`` clears it, but the groups' ``shutdown`` is skipped
(the abort in flight ends them), and the group objects are kept alive until the next
recovery so none is destroyed while its abort runs. The next generation's groups are made
meanwhile.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

# How long leaving without overlap waits for an abort in flight (NCCL's takes about 0.5 s).
_WAIT_S = 60.0
_LOCK = threading.Condition()
_ABORTED: set[int] = set()  # ids of the process groups this process has aborted
_IN_FLIGHT = 0  # abort_groups calls still aborting
_EPOCH = 0  # the groups' generation in this process: bumped when they are left
# Groups left while their abort ran, kept alive until the next time groups are left.
_LEFT: list[Any] = []
# Per epoch (this one and the one before): each aborted group's "backend:seconds" (an
# NCCL communicator's abort takes about half a second on a Hopper host), and the aborts'
# wall-clock start and end, whichever thread ran them.
_RECORDS: dict[int, dict[str, Any]] = {}


def epoch() -> int:
    """The current groups' epoch (for :func:`record`)."""
    with _LOCK:
        return _EPOCH


def _record(at: int) -> dict[str, Any]:
    return _RECORDS.setdefault(at, {"times": []})


def _holds_nccl(backend: Any) -> bool:
    return "nccl" in str(backend).lower()


def abort_groups(slow_s: float = 0.0, wait: bool = True) -> None:
    """Abort every process group of this process not aborted yet, without a collective: a
    thread blocked in one of their operations gets an error. Safe from any thread (NVRx's
    in-process restart aborts from its monitor thread the same way); the order thread and
    the training thread may both call it, and each group is aborted once, by the first
    caller (two concurrent aborts of one NCCL communicator are undefined); a later caller
    returns at once. Without ``wait`` the groups are claimed now and aborted in a thread of
    their own. ``slow_s``: seconds added before the default group (or a group holding an
    NCCL communicator) is aborted (``chaos.slow_abort_s``: NCCL's abort, on gloo)."""
    import torch.distributed.distributed_c10d as c10d

    global _IN_FLIGHT
    with _LOCK:
        backends = {pg: c10d._world.pg_map.get(pg, ("?",))[0] for pg in list(c10d._world.pg_map)}
        todo = [pg for pg in backends if id(pg) not in _ABORTED]
        if not todo:
            return
        _ABORTED.update(id(pg) for pg in todo)
        world = c10d.GroupMember.WORLD
        # The default group (which holds the NCCL communicator on a GPU) last.
        todo.sort(key=lambda pg: pg is world or _holds_nccl(backends[pg]))
        slow = {id(pg) for pg in todo if pg is world or _holds_nccl(backends[pg])}
        _IN_FLIGHT += 1
        at = _EPOCH
        rec = _record(at)
        rec.setdefault("abort_start", time.time())
        rec["in_flight"] = rec.get("in_flight", 0) + 1
    if wait:
        _abort(todo, backends, slow if slow_s > 0 else set(), slow_s, at)
    else:
        threading.Thread(target=_abort, name="orch-abort-groups", daemon=True,
                         args=(todo, backends, slow if slow_s > 0 else set(), slow_s,
                               at)).start()


def _abort(todo: list[Any], backends: dict[Any, Any], slow: set[int], slow_s: float,
           at: int) -> None:
    """Abort the claimed groups ``todo`` in order (see :func:`abort_groups`); ``at``: their
    epoch."""
    global _IN_FLIGHT
    try:
        for pg in todo:
            t0 = time.perf_counter()
            if id(pg) in slow:
                time.sleep(slow_s)
                slow = set()
            with contextlib.suppress(Exception):  # a backend without abort
                pg.abort()
            with _LOCK:
                _record(at)["times"].append(f"{backends[pg]}:{time.perf_counter() - t0:.3f}")
    finally:
        with _LOCK:
            _IN_FLIGHT -= 1
            rec = _record(at)
            rec["in_flight"] -= 1
            rec["abort_end"] = time.time()
            _LOCK.notify_all()


def aborting() -> bool:
    """Whether an abort of this process's groups is still running (in any thread)."""
    with _LOCK:
        return _IN_FLIGHT > 0


def wait_aborts(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the aborts in flight to end; whether they did."""
    with _LOCK:
        return _LOCK.wait_for(lambda: _IN_FLIGHT == 0, timeout=timeout)


def record(at: int) -> dict[str, Any]:
    """What the aborts of epoch ``at``'s groups did so far: ``group_aborts`` (each group's
    "backend:seconds", in order), ``abort_start`` and ``abort_end`` (wall clock; no end while
    one still runs)."""
    with _LOCK:
        rec = _RECORDS.get(at, {})
        out: dict[str, Any] = {k: v for k, v in rec.items() if k in ("abort_start", "abort_end")}
        if rec.get("in_flight"):
            out.pop("abort_end", None)
            out["aborts_running"] = True
        if rec.get("times"):
            out["group_aborts"] = " ".join(rec["times"])[:256]
        return out


@contextlib.contextmanager
def _shutdown_skipped() -> Iterator[None]:
    """``ProcessGroup.shutdown`` does nothing inside (this thread is the only caller: the
    groups are being left)."""
    from torch.distributed import ProcessGroup

    own = "shutdown" in vars(ProcessGroup)
    raw = vars(ProcessGroup).get("shutdown")
    ProcessGroup.shutdown = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            ProcessGroup.shutdown = raw  # type: ignore[method-assign]
        else:
            delattr(ProcessGroup, "shutdown")


def leave_groups(overlap: bool) -> bool:
    """Destroy this process's (aborted) process groups before the next generation's are
    made; the ids of the aborted ones may be reused by the new ones. With ``overlap`` and
    an abort still running, c10d's world is cleared without shutting the old groups down
    (their abort ends them) and they are kept until the next call. Whether it overlapped."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    global _EPOCH
    with _LOCK:
        busy = _IN_FLIGHT > 0
        old = list(c10d._world.pg_map)
        kept = {id(pg) for pg in _LEFT}
        _ABORTED.difference_update(kept)  # their aborts ended long ago: ids free again
        _LEFT.clear()
    if busy and overlap:
        with _LOCK:
            _LEFT.extend(old)
        with _shutdown_skipped():
            dist.destroy_process_group()
    else:
        # A group's shutdown must not run beside its abort (two teardowns of one NCCL
        # communicator at once are undefined).
        if busy and not wait_aborts(_WAIT_S):
            raise RuntimeError(f"the process groups' abort did not end within {_WAIT_S:.0f} s")
        dist.destroy_process_group()
    with _LOCK:
        _ABORTED.difference_update(id(pg) for pg in old if not (busy and overlap))
        _EPOCH += 1
        for stale in [e for e in _RECORDS if e < _EPOCH - 1]:
            del _RECORDS[stale]
    return busy and overlap
