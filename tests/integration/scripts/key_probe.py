"""A rank that looks for the checkpoint signing key (tests/integration/test_rank_secrets.py):
in its environment, in its agent's /proc entries, and by asking its agent to sign what is
not its to sign. Writes what it found to $ORCH_RUN_DIR/probe-<rank>.json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import orchestrator.worker as ow
from orchestrator.worker.keyclient import AgentSigner, KeyUnavailable

worker = ow.init()
rank = int(os.environ["RANK"])
sock = os.environ["ORCH_AGENT_SOCKET"]
found: dict[str, object] = {"rank": rank, "env": sorted(os.environ)}


def meet(name: str) -> None:
    """Mark this rank at ``name`` and wait (bounded) for the other rank there: the other
    rank must be running while this one tries to pass for it, or the agent refuses it
    for another reason (no such rank here)."""
    run = Path(os.environ["ORCH_RUN_DIR"])
    (run / f"{name}-{rank}").touch()
    deadline = time.monotonic() + 60
    while not (run / f"{name}-{1 - rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def attempt(name: str, call) -> None:  # noqa: ANN001
    try:
        found[name] = {"ok": call()}
    except KeyUnavailable as exc:
        found[name] = {"refused": str(exc)}


me = AgentSigner(sock, rank)
attempt("key_id", lambda: me.key_id)
manifest = {"format": "orchestrator-checkpoint/2", "step": 7, "files": {}}
attempt("sign_manifest", lambda: me.signature(manifest, "manifest"))
attempt("sign_own_memory", lambda: me.signature({"rank": rank, "step": 7}, "memory"))
attempt("sign_other_memory", lambda: me.signature({"rank": 1 - rank, "step": 7}, "memory"))
meet("started")
attempt("as_other_rank", lambda: AgentSigner(sock, 1 - rank).key_id)
meet("probed")
attempt("as_rank_9", lambda: AgentSigner(sock, 9).key_id)
agent = os.getppid()
for name in ("environ", "mem", "cmdline"):
    try:
        Path(f"/proc/{agent}/{name}").read_bytes()[:16]
        found[f"agent_{name}"] = "read"
    except OSError as exc:
        found[f"agent_{name}"] = type(exc).__name__
Path(os.environ["ORCH_RUN_DIR"], f"probe-{rank}.json").write_text(json.dumps(found))
worker.step_done(1, loss=1.0)
ow.shutdown()
