"""The step stream is a typed contract, and generations are fenced (a flood, forged
values, a stale generation, escaped text), against a real supervisor whose two nodes are
this test (``livesup``): the node holding rank 0 and the other one send heartbeats through
the API's port and through the heartbeat process's.

The fuzz: ``STEP_FUZZ_EXAMPLES`` heartbeats carrying step records (2,000 a CI run; 20,000
with ``STEP_FUZZ_LONG=1``), typed and garbled, from either node, for the current generation
or another, through either port. After it: no 5xx, no dropped connection; ``steps.jsonl``
holds exactly the records of the beats the supervisor accepted, all the rank 0 node's for
the current generation; nothing another node sent or another generation's records changed
any state (no step, no stability event, no transition); then the supervisor is killed and
``up --resume`` brings it back on the same run directory.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jobs import env, wait_for
from livesup import Live, start

CI_EXAMPLES = 2_000
LONG_EXAMPLES = int(os.environ.get("STEP_FUZZ_EXAMPLES", "20000"))
OK = {200, 400, 403, 413, 422}
FOREIGN_STEP = 1 << 52  # the steps another node's records carry: none may ever be taken


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> Iterator[Live]:
    # The stability rules only record: a NaN from the rank 0 node must not roll the
    # generation back in the middle of the fuzz (the rollback is test_rollback_bounds's).
    sup = start(tmp_path_factory.mktemp("records"), dataset_dir,
                stability={"loss": {"nonfinite": {"action": "record"}}})
    sup.counter = 1  # type: ignore[attr-defined]  # the rank 0 node's next step
    sup.accepted = []  # type: ignore[attr-defined]  # steps of the accepted beats' records
    sup.foreign = 0  # type: ignore[attr-defined]
    try:
        yield sup
    finally:
        sup.stop()


# -- the fuzz ------------------------------------------------------------------------------
# Hypothesis draws the shape of each beat and a seed; the records are built from the seed
# (drawing dozens of optional fields through hypothesis cost 35 ms a beat on the CI host).
_NUMBERS = [math.nan, math.inf, -math.inf, 1e308, -0.0, 0.0, 2**53, 2**53 + 1, 2**62,
            2**63, 10**30, -1, 1e-300, 3.5]
_JUNK = [None, True, "12", "nan", "", [1], {"x": 1}, "\x1b[2J", "k" * 300, 10**40]
_FIELDS = ["loss", "grad_norm", "param_norm", "lr", "tokens", "batch", "step_time",
           "data_s", "ckpt_block_s", "mem_block_s", "skipped", "ts"]
_EXTRA = ["acc", "tag", "x y", "\x1b[2J", "k" * 70, "generation", "0bad"]


def _value(rng: random.Random, field: str, typed: bool) -> Any:
    if not typed:
        return rng.choice(_NUMBERS + _JUNK)
    if field == "loss":
        return rng.choice([rng.uniform(0, 10), math.nan, math.inf, -math.inf])
    if field in ("tokens", "batch"):
        return rng.randrange(0, 1 << 40)
    if field == "skipped":
        return rng.random() < 0.5
    if field == "ts":
        return rng.uniform(1e9, 2e9)
    return rng.uniform(0, 10)


def _record(rng: random.Random, typed: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"loss": _value(rng, "loss", True)}
    for name in rng.sample(_FIELDS, rng.randrange(0, 5)):
        rec[name] = _value(rng, name, typed or rng.random() < 0.7)
    if rng.random() < 0.3:
        key = rng.choice(_EXTRA)
        rec[key] = _value(rng, key, typed) if key in ("acc", "tag") and typed else \
            rng.choice(_NUMBERS + _JUNK)
    return rec


_step_kind = st.sampled_from(["next"] * 6 + ["repeat", "string", "float", "huge"])


def _fuzz(live: Live, examples: int) -> None:
    t0 = time.monotonic()
    sent = {"n": 0}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rank0=st.sampled_from([True, True, True, False]), port=st.booleans(),
           gen=st.sampled_from([0, 0, 0, 0, -1, 1, None]), typed=st.booleans(),
           kinds=st.lists(_step_kind, min_size=1, max_size=4),
           seed=st.integers(0, 1 << 32), garbage=st.booleans())
    # The first beat (step 1) carrying step 1 twice: the second is a resent record.
    @example(rank0=True, port=True, gen=0, typed=False, kinds=["next", "repeat"], seed=430,
             garbage=False)
    def one(rank0: bool, port: bool, gen: int | None, typed: bool, kinds: list[str],
            seed: int, garbage: bool) -> None:
        rng = random.Random(seed)
        node = live.rank0 if rank0 else live.other
        generation = None if gen is None else live.generation + gen
        body = []
        steps = []
        for kind in kinds:
            if not rank0:
                live.foreign += 1
                step: Any = FOREIGN_STEP + live.foreign
            elif kind == "next":
                step = live.counter + len(steps)
            elif kind == "repeat":
                step = max(1, live.counter - 1)
            else:
                step = {"string": "12", "float": 12.5, "huge": 10 ** 40}[kind]
            steps.append(step)
            body.append({"step": step, **_record(rng, typed), "src": "r0" if rank0 else "x"})
        if garbage and not rank0:
            raw = json.dumps({"node_id": node, "generation": generation,
                              "records": body}).encode()[:-rng.randrange(1, 20)]
            code, _ = live.send(node, "/v1/heartbeat", raw + rng.randbytes(8),
                                beat_port=port)
        else:
            code, _ = live.beat(node, body, generation=generation, beat_port=port)
        sent["n"] += 1
        assert code in OK, (code, seed, body)
        if not rank0 or generation != live.generation:
            assert code != 200, ("a record a node may not send was accepted", seed, body)
        if code == 200:
            # Every record taken that is a whole step past the last one taken: a repeated
            # step is dropped as a resent beat's, also one repeated within this beat (at
            # the first step, "repeat" draws the step "next" just drew).
            last = live.counter - 1
            for s in steps:
                if isinstance(s, int) and s > last:
                    live.accepted.append(s)
                    last = s
            live.counter = last + 1
            if port:
                # An agent beats through one port at a time: the heartbeat process's
                # beats are folded after its answer, so the next one through the other
                # port waits for them (or it would overtake them).
                _settled_steps(live, interval=0.005)

    one()
    print(f"step-record fuzz: {sent['n']} heartbeats in {time.monotonic() - t0:.1f} s, "
          f"{len(live.accepted)} records accepted")
    assert sent["n"] >= examples


def _settled_steps(live: Live, interval: float = 0.2) -> list[dict[str, Any]]:
    """``steps.jsonl`` once the beats the heartbeat process passed on are folded in."""
    wait_for(lambda: live.step_lines() >= len(live.accepted), 60, interval=interval,
             what="the accepted records in steps.jsonl")
    return live.steps()


def _check_nothing_foreign(live: Live) -> None:
    lines = _settled_steps(live)
    assert [r["step"] for r in lines] == live.accepted
    assert all(r["src"] == "r0" and r["generation"] == live.generation for r in lines)
    journal = live.journal()
    for e in journal:
        if e["kind"] in ("stability", "first_step", "progress"):
            assert e["step"] < FOREIGN_STEP, e
        assert e["kind"] not in ("failure", "rollback"), e
    assert [e["to"] for e in journal if e["kind"] == "transition"][-1] == "RUNNING"


def test_fuzzed_step_records_through_both_ports(live: Live) -> None:
    _fuzz(live, CI_EXAMPLES)
    _check_nothing_foreign(live)
    assert len(live.accepted) >= 100 and live.healthz() == 200


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STEP_FUZZ_LONG"),
                    reason="the long fuzz run: set STEP_FUZZ_LONG=1 (20,000 heartbeats)")
def test_fuzzed_step_records_long(live: Live) -> None:
    _fuzz(live, LONG_EXAMPLES)
    _check_nothing_foreign(live)


# -- the known attacks ---------------------------------------------------------------------
def test_another_nodes_records_change_nothing_and_the_detectors_still_fire(live: Live) -> None:
    """One NaN record from the node without rank 0 forced a divergence stop; one at
    step 2**53 - 10 froze the detectors; one beat of 100,000 records added 23 MiB."""
    before = len(_settled_steps(live))
    for port in (False, True):
        code, body = live.beat(live.other, [{"step": live.counter, "loss": math.nan,
                                             "batch": 100}], beat_port=port)
        assert code == 403 and "rank 0's" in body["error"], body
        code, body = live.beat(live.other, [{"step": 2**53 - 10, "loss": 1.0}],
                               beat_port=port)
        assert code == 403, body
    huge = [{"step": live.counter + i, "loss": 1.0} for i in range(100_000)]
    for node in (live.rank0, live.other):
        assert live.beat(node, huge)[0] == 422
    assert len(live.steps()) == before
    rejected = [e for e in live.journal() if e["kind"] == "message_rejected"]
    assert any(e["node_id"] == live.other and "rank 0's" in e["reason"] for e in rejected)
    # The rank 0 node's own NaN, at its next step, still fires the nonfinite rule.
    step = live.counter
    assert live.beat(live.rank0, [{"step": step, "loss": math.nan, "src": "r0"}])[0] == 200
    live.accepted.append(step)
    live.counter += 1
    wait_for(lambda: any(e["kind"] == "stability" and e["event"] == "nonfinite"
                         and e["step"] == step for e in live.journal()), 30,
             what="the nonfinite rule to fire")


def test_record_values_that_crashed_every_start_are_refused_or_skipped(
        live: Live) -> None:
    """A string tokens or step_time, a 4,000-digit integer reached steps.jsonl,
    the metrics fold raised, and every later start replayed it unguarded; a journal line
    100k deep or holding a 5,000-digit integer did the same to ``up --resume``."""
    before = len(_settled_steps(live))
    bodies = [{"tokens": "12"}, {"step_time": "0.5"}, {"tokens": 10 ** 4000},
              {"batch": 2**53 + 1}]
    for extra in bodies:
        for port in (False, True):
            raw = json.dumps({"node_id": live.rank0, "generation": live.generation,
                              "records": [{"step": live.counter, "loss": 1.0, **extra}]})
            code, _ = live.send(live.rank0, "/v1/heartbeat", raw.encode(), beat_port=port)
            assert code in (400, 422), extra
    assert len(live.steps()) == before
    # What an attacker (or a torn write) leaves in the run directory.
    with open(live.run / "steps.jsonl", "a") as f:
        f.write(json.dumps({"step": 10**6, "tokens": "12", "generation": live.generation})
                + "\n")
        f.write('{"step": 1000001, "step_time": "x", "generation": 1}\n')
        f.write('{"step": 1000002, "tokens": ' + "9" * 4000 + ', "generation": 1}\n')
        f.write("[" * 100_000 + "\n")
        f.write('{"step": 1000003, "loss": 1.0, "generation": 1, "torn": tr')
    with open(live.run / "events.jsonl", "a") as f:
        f.write("\n" + "[" * 100_000 + "]" * 100_000 + "\n")
        f.write('{"seq": ' + "9" * 5000 + ', "ts": 1.0, "kind": "progress"}\n')
        f.write('{"seq": 999999, "ts": 1.0, "kind": "no_such_kind", "x": 1}\n')
    live.kill_and_resume()
    st_ = _status_json(live.run)
    assert st_["state"] == "RUNNING"
    code, _ = live._operator("GET", "/metrics")
    assert code == 200
    # The resumed supervisor keeps taking the rank 0 node's records once it registers again.
    for node in (live.rank0, live.other):
        live.register(node)
    step = live.counter
    assert live.beat(live.rank0, [{"step": step, "loss": 1.0, "src": "r0"}])[0] == 200
    live.accepted.append(step)
    live.counter += 1


def test_an_older_generation_speaks_for_no_rank(live: Live) -> None:
    """Node n0, as rank 1 of generation 0, journaled ``checkpoint_committed`` at
    step 777700 with a forged path; status showed it and later generations resumed from it."""
    def committed(node: str, generation: int, rank: int) -> dict[str, Any]:
        return {"node_id": node, "events": [{
            "type": "worker", "generation": generation, "rank": rank,
            "name": "checkpoint_committed", "ts": time.time(),
            "data": {"step": 777700, "path": "/forged/step-00777700"}}]}

    for node in (live.rank0, live.other):
        for generation, rank in ((live.generation - 1, 1), (live.generation - 1, 0),
                                 (live.generation + 1, 0)):
            code, body = live.send(node, "/v1/events", committed(node, generation, rank))
            assert code == 403, (node, generation, rank, body)
    # In the current generation, a commit is rank 0's to report, not its peer's.
    code, body = live.send(live.other, "/v1/events", committed(live.other, live.generation, 1))
    assert code == 403 and "rank 0's" in body["error"], body
    # And a rank start or a worker note of another generation is fenced too.
    code, _ = live.send(live.rank0, "/v1/events", {"node_id": live.rank0, "events": [{
        "type": "ranks_started", "generation": live.generation - 1, "ts": time.time(),
        "ranks": [{"rank": 0, "local_rank": 0}]}]})
    assert code == 403
    time.sleep(0.5)  # the journal's group commit
    assert not [e for e in live.journal() if e["kind"] == "checkpoint_committed"]
    assert all(c["step"] != 777700 for c in _status_json(live.run)["checkpoints"])


def test_a_nodes_text_reaches_the_terminal_escaped(live: Live) -> None:
    """Escape codes in a rank exit's ``error`` came out raw in ``orchestrator
    status``; rich markup in those cells was interpreted. (Last: it fails the generation.)"""
    rank = 1  # the other node's
    error = "\x1b[2J\x1b[31mboom [blink]x[/blink] [link=http://evil]y[/link]"
    code, body = live.send(live.other, "/v1/events", {"node_id": live.other, "events": [{
        "type": "rank_exit", "generation": live.generation, "rank": rank, "exit_code": 1,
        "ts": time.time(), "error": error, "log_tail": ["\x1b]0;title\x07 [bold]tail[/bold]"]}]})
    assert code == 200, body
    live.confirm_stops()
    wait_for(lambda: any(e["kind"] == "failure" for e in live.journal()), 30,
             what="the failure")
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(live.run)],
                         capture_output=True, text=True, env={**env(), "COLUMNS": "400"},
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "\\x1b[2J" in out.stdout and "[blink]x[/blink]" in out.stdout


def _status_json(run: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run), "--json"],
                         capture_output=True, text=True, env=env(), timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)
