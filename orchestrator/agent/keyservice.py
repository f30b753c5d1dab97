"""The node agent's side of the checkpoint signing key: it signs and checks for its ranks.

The protocol and why are ``orchestrator.worker.keyclient``'s. Here:

- the key comes from what the supervisor and the operator give the generation
  (``ORCH_CHECKPOINT_KEY_FILE`` in the assignment's environment, or ``ORCH_CHECKPOINT_KEY`` /
  ``..._FILE`` in the agent's own), read once per source; the ranks' environment never has
  either (``rank_env``, ``contracts.env.without_secrets``);
- a request is answered only for the process that is (or descends from) the rank it names,
  a live rank of the running generation: the peer pid of the connection (``SO_PEERCRED``);
- a durable manifest is signed for rank 0 only (it commits checkpoints); a memory-tier
  manifest only when it names the asking rank; a check says whether a signature is the
  key's, never what the key is;
- ``make_undumpable`` closes ``/proc/<agent>/{environ,mem}`` and ptrace to processes of the
  same user (``PR_SET_DUMPABLE`` 0), where the key sits in memory.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from orchestrator.contracts import env as ec
from orchestrator.worker.keyclient import KeyReply, KeyRequest
from trainer.checkpoint import signing

_PR_SET_DUMPABLE = 4
# A rank's own children (a DataLoader worker, a wrapper script's python) may ask too: the
# peer's parents are followed this far up.
_MAX_ANCESTRY = 8


def make_undumpable() -> bool:
    """This process's memory and /proc entries closed to its user's other processes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def descends(pid: int, ancestor: int) -> bool:
    for _ in range(_MAX_ANCESTRY):
        if pid == ancestor:
            return True
        parent = _parent(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


class KeyService:
    """Answers ``KeyRequest`` lines of the agent's ranks (see the module).

    ``ranks`` gives the running generation's ``(rank -> pid of a live rank)`` and the
    assignment's environment; ``environ`` is the agent's own."""

    def __init__(self, ranks: Callable[[], tuple[dict[int, int], Mapping[str, str]] | None],
                 environ: Mapping[str, str] | None = None) -> None:
        self._ranks = ranks
        self._environ = os.environ if environ is None else environ
        self._keys: dict[tuple[str, str], bytes] = {}

    def _key(self, assignment_env: Mapping[str, str]) -> bytes:
        merged = {**self._environ, **assignment_env}
        env = {name: merged[name] for name in (ec.CHECKPOINT_KEY, ec.CHECKPOINT_KEY_FILE)
               if merged.get(name)}
        if not env:
            raise signing.SigningKeyError("this generation names no checkpoint signing key")
        source = (ec.CHECKPOINT_KEY, "") if ec.CHECKPOINT_KEY in env else \
            (ec.CHECKPOINT_KEY_FILE, env[ec.CHECKPOINT_KEY_FILE])
        if source not in self._keys:
            key, _ = signing.load_key(None, environ=env)
            if key is None:
                raise signing.SigningKeyError("no checkpoint signing key")
            self._keys[source] = key
        return self._keys[source]

    def answer(self, raw: dict[str, Any], pid: int | None) -> KeyReply:
        try:
            req = KeyRequest.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            return _refused(f"not a key request: {'.'.join(map(str, err['loc']))}: "
                            f"{err['msg']}")
        running = self._ranks()
        if running is None:
            return _refused("no generation runs here")
        pids, env = running
        rank_pid = pids.get(req.rank)
        if rank_pid is None:
            return _refused(f"rank {req.rank} does not run here")
        if pid is None or not descends(pid, rank_pid):
            return _refused(f"the asking process is not rank {req.rank}")
        try:
            key = self._key(env)
        except signing.SigningKeyError as exc:
            return _refused(str(exc))
        if req.op == "id":
            return KeyReply(ok=True, key_id=signing.key_id(key))
        if req.op == "check":
            outcome, message = signing.check(req.manifest, key)
            return KeyReply(ok=True, outcome=outcome, message=message[:1000])
        if req.scope == "manifest" and req.rank != 0:
            return _refused("a checkpoint's manifest is rank 0's to commit")
        if req.scope == "memory" and req.manifest.get("rank") != req.rank:
            return _refused(f"rank {req.rank} may sign only its own memory copies")
        try:
            signed = signing.sign(req.manifest, key)
        except (TypeError, ValueError) as exc:  # not canonical JSON (a NaN, say)
            return _refused(f"the manifest cannot be signed: {exc}"[:1000])
        return KeyReply(ok=True, signature=signed[signing.SIGNATURE])


def _refused(why: str) -> KeyReply:
    return KeyReply(ok=False, error=why[:1000])
