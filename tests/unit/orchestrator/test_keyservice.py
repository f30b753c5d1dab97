"""The node agent's key service (``agent.keyservice``): whom it answers and what it signs,
for any request a rank may send; and the agent's own process closed to its user.

The service runs over the agent's real local socket in tests/integration/test_rank_secrets.py;
here its rules, against every request shape hypothesis makes (KEY_FUZZ_EXAMPLES, 200)."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.agent.keyservice import KeyService, descends
from orchestrator.worker.keyclient import KeyReply
from trainer.checkpoint import signing

KEY = b"agent-test-key-" + b"k" * 17
ENV = {"ORCH_CHECKPOINT_KEY": KEY.decode()}
ME = os.getpid()
# This process is rank 0 and rank 1 of the running generation (one pid: the tests ask as
# either); rank 2 is a process that is not this one.
SERVICE = KeyService(lambda: ({0: ME, 1: ME, 2: 1}, ENV), environ={})


def _ask(**req: object) -> KeyReply:
    return SERVICE.answer({"t": "key", **req}, ME)


def test_it_signs_rank_0s_manifest_and_each_ranks_own_memory_copies_only() -> None:
    manifest = {"format": "orchestrator-checkpoint/2", "step": 3, "files": {}}
    reply = _ask(op="sign", rank=0, manifest=manifest)
    assert reply.ok and signing.check({**manifest, "signature": reply.signature}, KEY)[0] \
        == signing.SIGNED
    assert "rank 0's" in (_ask(op="sign", rank=1, manifest=manifest).error or "")
    assert _ask(op="sign", rank=1, scope="memory", manifest={"rank": 1, "step": 3}).ok
    assert "its own" in (_ask(op="sign", rank=1, scope="memory",
                              manifest={"rank": 0}).error or "")
    # A check says whether, never what: a forged signature is FORGED, the key never leaves.
    forged = {**manifest, "signature": {"hmac_sha256": "0" * 64, "key_id": "x"}}
    reply = _ask(op="check", rank=1, manifest=forged)
    assert reply.ok and reply.outcome == signing.FORGED
    assert _ask(op="id", rank=1).key_id == signing.key_id(KEY)
    assert KEY.decode() not in repr([_ask(op=op, rank=0, manifest=manifest)
                                     for op in ("sign", "check", "id")])


def test_it_answers_only_the_ranks_own_process() -> None:
    assert "not rank 2" in (_ask(op="id", rank=2).error or "")
    assert "does not run here" in (_ask(op="id", rank=7).error or "")
    assert not SERVICE.answer({"t": "key", "op": "id", "rank": 0}, None).ok
    idle = KeyService(lambda: None, environ={})
    assert "no generation" in (idle.answer({"t": "key", "op": "id", "rank": 0}, ME).error
                               or "")
    keyless = KeyService(lambda: ({0: ME}, {}), environ={})
    assert "names no checkpoint signing key" in (
        keyless.answer({"t": "key", "op": "id", "rank": 0}, ME).error or "")
    # A child of the rank (a data loader worker, a wrapper's python) speaks for it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert descends(child.pid, ME) and not descends(ME, child.pid)
    finally:
        child.kill()
        child.wait()


_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) |
                     st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)


@settings(max_examples=int(os.environ.get("KEY_FUZZ_EXAMPLES", "200")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(req=st.one_of(
    st.fixed_dictionaries({"t": st.sampled_from(["key", "beat", 1]),
                           "op": st.one_of(st.sampled_from(["sign", "check", "id", "x"]),
                                           _json),
                           "rank": st.one_of(st.integers(-2, 4), _json)},
                          optional={"scope": st.one_of(st.sampled_from(["manifest",
                                                                        "memory"]), _json),
                                    "manifest": _json, "extra": _json}),
    st.dictionaries(st.text(max_size=6), _json, max_size=4)))
def test_any_request_gets_a_reply_and_only_rank_0_a_manifest_signature(req: dict) -> None:
    reply = SERVICE.answer(req, ME)
    assert isinstance(reply, KeyReply)
    if reply.signature is not None:
        scope = req.get("scope", "manifest")
        assert req["rank"] == 0 if scope == "manifest" else req["manifest"]["rank"] == \
            req["rank"]


def test_the_agent_makes_itself_undumpable() -> None:
    """PR_SET_DUMPABLE 0: /proc/<agent>/environ and mem, and ptrace, closed to its user's
    other processes (its ranks)."""
    code = ("import ctypes; from orchestrator.agent.keyservice import make_undumpable; "
            "assert make_undumpable(); print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr
