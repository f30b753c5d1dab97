"""Identity and admission: a node's credential names it, and it may speak only for itself and
the ranks of its current assignment (the known forgeries, as pure checks)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts.auth import (
    Principal,
    authenticate,
    bearer_of,
    is_node_credential,
    node_credential,
)
from orchestrator.contracts.protocol import EventBatch, Heartbeat, RegisterRequest
from orchestrator.supervisor.gateway.admission import (
    KnownNode,
    Limits,
    Slice,
    check_events,
    check_heartbeat,
    check_register,
)

SECRET = "s3cret-job-token-for-tests"
LIMITS = Limits(world_size=4, max_step_interval_s=3600.0, max_nodes=3)
# local-1 runs ranks 2 and 3 of generation 5 (the newest launched); a spare runs none.
RUNNING = Slice(generation=5, lo=2, hi=4)
SPARE = Slice(generation=5)


def test_a_credential_authenticates_its_node_only() -> None:
    cred = node_credential(SECRET, "local-1")
    assert is_node_credential(cred)
    assert authenticate(SECRET, cred) == Principal("node", "local-1")
    assert authenticate(SECRET, SECRET) == Principal("operator")
    assert authenticate("another-secret", cred) is None
    forged = cred.replace("local-1", "local-2")  # same MAC, another node's id
    assert authenticate(SECRET, forged) is None
    assert authenticate(SECRET, cred[:-1] + ("0" if cred[-1] != "0" else "1")) is None
    assert authenticate(SECRET, "") is None
    assert authenticate(SECRET, "\udcff" + SECRET) is None  # undecodable header bytes
    assert authenticate("", "") is None
    assert bearer_of(f"Bearer {cred}") == cred and bearer_of(f"bearer  {cred} ") == cred
    assert bearer_of(f"Basic {cred}") == "" and bearer_of("") == ""


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec=None), max_size=200))
def test_no_random_bearer_authenticates(bearer: str) -> None:
    assert authenticate(SECRET, bearer) is None


def _hb(node: str, generation: int | None, *ranks: int, interval: float | None = None) -> Heartbeat:
    return Heartbeat(node_id=node, generation=generation,
                     ranks=[{"rank": r, "local_rank": 0, "step_interval_max": interval}
                            for r in ranks])


def test_heartbeats_only_for_the_nodes_own_ranks() -> None:
    assert check_heartbeat("local-1", _hb("local-1", 5, 2, 3), RUNNING, LIMITS) is None
    assert check_heartbeat("local-1", _hb("local-1", 5), RUNNING, LIMITS) is None
    # Another node's rank in the current generation, or a rank outside the world (5000).
    for ranks in ((0,), (2, 1), (5000,), (4,)):
        refusal = check_heartbeat("local-1", _hb("local-1", 5, *ranks), RUNNING, LIMITS)
        assert refusal is not None and refusal.status == 403, ranks
    # Speaking as another node.
    refusal = check_heartbeat("local-1", _hb("local-0", 5, 0), RUNNING, LIMITS)
    assert refusal is not None and "as node 'local-0'" in refusal.reason
    # A generation not launched yet: no heartbeat, exit or event can be sent ahead for it.
    assert check_heartbeat("local-1", _hb("local-1", 6, 2), RUNNING, LIMITS) is not None
    assert check_heartbeat("local-1", _hb("local-1", 0, 0), None, LIMITS) is not None
    # An older generation's straggler is harmless (intake ignores it) and not a forgery.
    assert check_heartbeat("local-1", _hb("local-1", 4, 0), RUNNING, LIMITS) is None
    # A spare has no ranks in the current generation; an idle node reports none at all.
    assert check_heartbeat("spare-0", _hb("spare-0", 5, 0), SPARE, LIMITS) is not None
    assert check_heartbeat("spare-0", _hb("spare-0", None), SPARE, LIMITS) is None
    assert check_heartbeat("spare-0", _hb("spare-0", None, 0), SPARE, LIMITS) is not None


def test_step_records_are_rank_0s_and_late_ones_only_from_its_holder_then() -> None:
    records = [{"step": 17, "loss": 1.5}]
    # local-0 holds ranks 0-1 of generation 5; in generation 4 it held 0-1 as well, while
    # local-1 held 2-3 (so rank 0's records were never local-1's to send).
    holder = Slice(generation=5, lo=0, hi=2)
    then = {4: Slice(4, 0, 2)}.get
    then_1 = {4: Slice(4, 2, 4)}.get
    beat = Heartbeat(node_id="local-0", generation=5, records=records)
    assert check_heartbeat("local-0", beat, holder, LIMITS) is None
    refusal = check_heartbeat("local-1", beat.model_copy(update={"node_id": "local-1"}),
                              RUNNING, LIMITS)
    assert refusal is not None and "rank 0's" in refusal.reason
    # A beat sent just before the node heard of generation 5 (an in-place recovery keeps
    # rank 0 beating through the launch): late, not forged; intake folds it nowhere.
    late = beat.model_copy(update={"generation": 4})
    assert check_heartbeat("local-0", late, holder, LIMITS, then) is None
    # ...but only from the node that held rank 0 then, and only for a launched generation.
    for past in (then_1, {}.get):
        refusal = check_heartbeat("local-0", late, holder, LIMITS, past)
        assert refusal is not None and "generation 4" in refusal.reason
    ahead = beat.model_copy(update={"generation": 6})
    assert check_heartbeat("local-0", ahead, holder, LIMITS, then) is not None
    assert check_heartbeat("local-0", late, None, LIMITS, then) is not None


@settings(max_examples=300, deadline=None)
@given(sent=st.integers(0, 8), current=st.integers(1, 8),
       holders=st.dictionaries(st.integers(1, 8), st.sampled_from([(0, 2), (2, 4), (0, 0)])))
def test_records_pass_only_from_the_holder_of_rank_0_then(sent: int, current: int,
                                                         holders: dict) -> None:
    """Any generation a beat's records name, any launch history: accepted exactly when the
    node held rank 0 in that generation, and it is the current one or an older one."""
    slices = {g: Slice(g, lo, hi) for g, (lo, hi) in holders.items() if g <= current}
    now = slices.get(current, Slice(current))
    beat = Heartbeat(node_id="local-0", generation=sent, records=[{"step": 3}])
    refusal = check_heartbeat("local-0", beat, now, LIMITS, slices.get)
    held = sent in slices and slices[sent].lo <= 0 < slices[sent].hi
    assert (refusal is None) == (held and sent <= current), (sent, current, slices)


def test_calibration_is_bounded() -> None:
    ok = _hb("local-1", 5, 2, interval=3600.0)
    assert check_heartbeat("local-1", ok, RUNNING, LIMITS) is None
    big = _hb("local-1", 5, 2, interval=3600.5)
    refusal = check_heartbeat("local-1", big, RUNNING, LIMITS)
    assert refusal is not None and "max_step_interval_s" in refusal.reason


def _events(node: str, *events: dict) -> EventBatch:
    return EventBatch.model_validate({"node_id": node, "events": list(events)})


def _exit(rank: int, generation: int = 5, code: int = 0) -> dict:
    return {"type": "rank_exit", "generation": generation, "rank": rank, "exit_code": code,
            "ts": time.time()}


def test_exits_only_for_the_nodes_own_ranks() -> None:
    assert check_events("local-1", _events("local-1", _exit(2), _exit(3)), RUNNING,
                        LIMITS) is None
    # The known attacks: an exit of a rank on another node; clean exits of ranks 1000/1001.
    for batch in (_events("local-1", _exit(0, code=1)),
                  _events("local-1", _exit(1000), _exit(1001)),
                  _events("local-1", _exit(2), _exit(1))):
        refusal = check_events("local-1", batch, RUNNING, LIMITS)
        assert refusal is not None and refusal.status == 403
    started = {"type": "ranks_started", "generation": 5, "ts": 1.0,
               "ranks": [{"rank": 0, "local_rank": 0}]}
    assert check_events("local-1", _events("local-1", started), RUNNING, LIMITS) is not None
    worker = {"type": "worker", "generation": 5, "rank": 0, "name": "checkpoint_committed",
              "data": {"step": 10}, "ts": 1.0}
    assert check_events("local-1", _events("local-1", worker), RUNNING, LIMITS) is not None
    # A checkpoint commit is rank 0's to report, even from its own rank 2.
    worker["rank"] = 2
    assert check_events("local-1", _events("local-1", worker), RUNNING, LIMITS) is not None
    note = {**worker, "name": "eval_done", "data": {"acc": 0.5}}
    assert check_events("local-1", _events("local-1", note), RUNNING, LIMITS) is None
    # A replacement rank of an in-job recovery reports its own start-up breakdown.
    startup = {**worker, "name": "startup", "data": {"process_start": 1.0, "first_step_done": 9.0}}
    assert check_events("local-1", _events("local-1", startup), RUNNING, LIMITS) is None
    stopped = {"type": "ranks_stopped", "generation": 5, "ts": 1.0}
    assert check_events("local-1", _events("local-1", stopped), RUNNING, LIMITS) is None
    assert check_events("local-1", _events("local-0", stopped), RUNNING, LIMITS) is not None
    # A spare (or a node before any launch) cannot report an exit of a running rank.
    assert check_events("spare-0", _events("spare-0", _exit(2, code=1)), SPARE,
                        LIMITS) is not None
    assert check_events("local-1", _events("local-1", _exit(2, code=1)), None,
                        LIMITS) is not None


def test_a_late_worker_event_passes_only_from_the_nodes_own_rank_then() -> None:
    """A survivor of an in-place recovery reports an event of the generation it was in
    just as the next one launches (the quickstart's job: a generation-1 event of node
    local-0, rank 0, refused as forged and its whole batch dropped): late, not forged."""
    then = {4: Slice(generation=4, lo=0, hi=1)}.get  # local-0 held rank 0 in generation 4
    current = Slice(generation=5, lo=0, hi=1)
    late = {"type": "worker", "generation": 4, "rank": 0, "name": "chaos",
            "data": {"id": "kill-0", "rank": 0, "step": 3, "signal": "SIGKILL"}, "ts": 1.0}
    committed = {**late, "name": "checkpoint_committed", "data": {"step": 10}}
    for event in (late, committed):
        assert check_events("local-0", _events("local-0", event), current, LIMITS,
                            then) is None
        # Not from a rank the node did not hold then, nor for a generation never launched,
        # nor without the node's slice of that generation.
        other_rank = {**event, "rank": 1,
                      "data": {**event["data"], **({"rank": 1} if event is late else {})}}
        assert check_events("local-0", _events("local-0", other_rank), current, LIMITS,
                            then) is not None
        assert check_events("local-0", _events("local-0", {**event, "generation": 3}),
                            current, LIMITS, then) is not None
        assert check_events("local-0", _events("local-0", event), current, LIMITS) \
            is not None
    # Rank 0's names stay rank 0's in an older generation too.
    other = {4: Slice(generation=4, lo=1, hi=2)}.get
    assert check_events("local-1", _events("local-1", {**committed, "rank": 1}), current,
                        LIMITS, other) is not None


def test_health_results_only_for_the_node_itself() -> None:
    def report(node: str) -> dict:
        return {"type": "health", "nonce": "n", "stage": "node", "sent_ts": 1.0,
                "results": [{"node_id": node, "check": "disk", "ok": False,
                             "severity": "fatal", "message": "full", "duration_s": 0.1,
                             "level": "quick"}]}
    assert check_events("local-1", _events("local-1", report("local-1")), RUNNING,
                        LIMITS) is None
    assert check_events("local-1", _events("local-1", report("local-0")), RUNNING,
                        LIMITS) is not None


def _reg(node: str, addr: str = "10.0.0.2", host: str = "h2") -> RegisterRequest:
    return RegisterRequest(node_id=node, host=host, addr=addr, procs=1, agent_pid=1)


def test_registration_names_itself_keeps_a_live_address_and_a_node_limit() -> None:
    live = KnownNode(host="h2", addr="10.0.0.2", live=True)
    lost = KnownNode(host="h2", addr="10.0.0.2", live=False)
    assert check_register("local-1", _reg("local-1"), None, 0, None, LIMITS) is None
    assert check_register("local-1", _reg("local-0"), None, 0, None, LIMITS).status == 403
    assert check_register("local-1", _reg("local-1"), live, 2, RUNNING, LIMITS) is None
    moved = check_register("local-1", _reg("local-1", addr="6.6.6.6"), live, 2, RUNNING,
                           LIMITS)
    assert moved is not None and moved.status == 409
    assert check_register("local-1", _reg("local-1", addr="6.6.6.6"), lost, 2, RUNNING,
                          LIMITS) is None
    full = check_register("local-9", _reg("local-9"), None, 3, RUNNING, LIMITS)
    assert full is not None and "max_nodes" in full.reason
    assert check_register("local-1", _reg("local-1"), live, 3, RUNNING, LIMITS) is None


@pytest.mark.parametrize("rank", [0, 1, 4, 1000])
def test_a_registration_may_not_claim_foreign_ranks(rank: int) -> None:
    req = RegisterRequest(node_id="local-1", host="h2", addr="10.0.0.2", procs=1,
                          agent_pid=1, generation=5,
                          ranks=[{"rank": rank, "local_rank": 0}])
    known = KnownNode(host="h2", addr="10.0.0.2", live=True)
    assert check_register("local-1", req, known, 2, RUNNING, LIMITS) is not None
    # Its own ranks, re-registering after a supervisor restart, are accepted.
    own = RegisterRequest(node_id="local-1", host="h2", addr="10.0.0.2", procs=1, agent_pid=1,
                          generation=5, ranks=[{"rank": 2, "local_rank": 0},
                                               {"rank": 3, "local_rank": 1}])
    assert check_register("local-1", own, known, 2, RUNNING, LIMITS) is None
