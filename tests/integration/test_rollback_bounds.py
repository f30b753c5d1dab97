"""One heartbeat crashed the supervisor, and ``up --resume`` crashed the same way,
and one beat of 100,000 records added 23 MiB to ``steps.jsonl`` (a flood):
against a real supervisor whose two nodes are this test (``livesup``), with the stability
rules as shipped (a non-finite loss rolls back).

The exact record: ``{"step": LAST+1, "loss": NaN, "batch": 9007199254740992}``. From the node
that holds no rank 0 it is refused (403, ``message_rejected``) through both ports; from rank
0's node it plans a rollback whose skip window would end past the largest batch a journal
event holds: the rollback is carried out without that window, and a killed supervisor comes
back with ``up --resume``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import wait_for
from livesup import Live, start

RATE = 200  # api.max_step_records_per_s here: a burst of 5 s is 1,000 records


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> Iterator[Live]:
    sup = start(tmp_path_factory.mktemp("rollback"), dataset_dir,
                api={"max_step_records_per_s": RATE})
    try:
        yield sup
    finally:
        sup.stop()


def test_a_flood_of_records_is_bounded(live: Live) -> None:
    t0 = time.monotonic()
    for beat in range(8):
        records = [{"step": 1 + beat * 1000 + i, "loss": 2.0, "grad_norm": 1.0,
                    "batch": beat * 1000 + i} for i in range(1000)]
        code, body = live.beat(live.rank0, records, beat_port=beat % 2 == 1)
        assert code == 200, body
    elapsed = time.monotonic() - t0
    time.sleep(1.0)  # the heartbeat process's beats are folded after their answer
    taken = live.step_lines()
    assert 1000 <= taken <= 1000 + RATE * (elapsed + 1.0) + 1000, (taken, elapsed)
    wait_for(lambda: any(e["kind"] == "message_rejected" and "max_step_records_per_s" in
                         e["reason"] for e in live.journal()), 30, what="the refusal")


def test_the_record_that_crashed_the_supervisor(live: Live) -> None:
    last = max((r["step"] for r in live.steps()), default=0)
    record = {"step": last + 1, "loss": math.nan, "batch": 9007199254740992}
    for port in (False, True):
        code, body = live.beat(live.other, [record], beat_port=port)
        assert code == 403, body
        assert live.healthz() == 200
    assert not [e for e in live.journal() if e["kind"] == "stability"]
    # From rank 0's node it is rank 0's record: the rollback is planned, then carried out
    # once the nodes confirm the stop, with no skip window (it would end past 2**53).
    code, body = live.beat(live.rank0, [record])
    assert code == 200, body
    live.confirm_stops()
    rollback = wait_for(lambda: next((e for e in live.journal() if e["kind"] == "rollback"),
                                     None), 60, what="the rollback")
    assert rollback["skip_window"] is None and rollback["onset_batch"] == 9007199254740992
    assert live.healthz() == 200
    fired = [e for e in live.journal() if e["kind"] == "stability"]
    assert [(e["event"], e["step"], e["batch"]) for e in fired] == \
        [("nonfinite", last + 1, 9007199254740992)]
    live.kill_and_resume()
    assert live.status()["state"] in ("RECOVERING", "HEALTH_CHECK", "LAUNCHING")
