"""The fault campaign's longer half (minutes each, ``--long``): a cut node back after 30 s,
packet loss between the agents and the supervisor for two minutes at 5 % then 30 %, and the
checkpoint storage failing (a full filesystem, S3 answering 503 and then hanging).

Same bed and rules as ``test_netfaults.py``: real hosts in network namespaces, our trainer on
gloo across them, bit-identical to an uninterrupted run, one results-table row each.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jobs import assert_bit_identical, final_state_dict, states, up, wait_for, write_config
from netbed import bed, identity
from netjobs import (
    BED_TIMEOUTS,
    BED_TRAINER,
    events,
    finish,
    last_step,
    measure,
    node_ranks,
    rank_pids,
    record_result,
    redone,
    ssh_config,
    start_up,
    wait_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.long]

PARAMS = ("app.model.", "app.optim.", "progress.", "data.")
NAMES = ["n1", "n2", "n3"]
# Packet loss runs for two minutes at each rate: a job that trains for about six.
LOSS_TRAINER = {"steps": 360}
LOSS_SLOW_S = 1.0  # seconds added to each of rank 0's steps (chaos.slow_ranks)


def _reference(tmp: Path, dataset: Path, trainer: dict) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = write_config(tmp / "job.yaml", dataset, trainer=trainer)
    result = up(cfg, tmp / "run", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    return final_state_dict(tmp / "run" / "checkpoints" / "t" / f"step-{trainer['steps']:08d}")


def _ssh_bed(tmp_path: Path, b, names: list[str]) -> Path:
    key = identity(tmp_path / "ssh")
    for n in names:
        b.sshd(n, tmp_path, key)
    return key


def _host_of(node_id: str) -> str:
    return NAMES[int(node_id.rsplit("-", 1)[1])]


def test_a_cut_node_back_after_30_s_rejoins_as_a_spare(tmp_path: Path,
                                                       dataset_dir: Path) -> None:
    reference = _reference(tmp_path / "ref", dataset_dir, BED_TRAINER)
    run = tmp_path / "run"
    with bed(["sup", *NAMES]) as b:
        key = _ssh_bed(tmp_path, b, NAMES)
        # Slower steps keep the job running past the node's return.
        cfg = ssh_config(tmp_path / "job.yaml", dataset_dir, b, "sup", NAMES, key,
                         cluster={"nodes": 2, "spares": 1},
                         chaos={"slow_ranks": {0: 0.4}})
        proc = start_up(b, "sup", cfg, run)
        wait_step(run, 15)
        victim = next(n for n, r in node_ranks(run).items() if r == 1)
        host = _host_of(victim)
        pids = rank_pids(run, victim, 1)
        cut = b.cut(host)
        time.sleep(30.0)
        healed = b.heal(host)
        back = wait_for(lambda: next((e for e in events(run, "node_state", node_id=victim,
                                                       state="spare")
                                      if e["ts"] >= healed), None), 60,
                        what="the node to rejoin as a spare")
        assert last_step(run) < BED_TRAINER["steps"], "the job ended before the node was back"
        code = finish(proc, 400, tmp_path / "run.sup.log")
        assert code == 0, (tmp_path / "run.sup.log").read_text()[-4000:]
    m = measure(run, cut, lost_node=victim)
    moves = [e["state"] for e in events(run, "node_state", node_id=victim) if e["ts"] >= cut]
    assert moves[:3] == ["lost", "registered", "spare"], moves
    assert "active" not in moves  # never a member again: the job went on without it
    assert all(victim not in e["nodes"] for e in events(run, "generation_launched")
               if e["generation"] > 1)
    started = [e for e in events(run, "ranks_started", node_id=victim) if e["generation"] > 1]
    assert started == []
    assert not any(pid in [r["pid"] for e in events(run, "ranks_started") for r in e["ranks"]
                           if e["generation"] > 1] for pid in pids)
    assert "lease expired" in (run / "agents" / f"{victim}.log").read_text()
    assert states(run)[-1] == "COMPLETED"
    final = final_state_dict(run / "checkpoints" / "t" / f"step-{BED_TRAINER['steps']:08d}")
    assert_bit_identical(reference, final, PARAMS)
    record_result({"fault": "node cut from everything, back after 30 s",
                   "injected": f"at step {m['step_at_fault']} on node rank 1",
                   "detected_s": m["detected_s"], "recovered_s": m["recovered_s"],
                   "data_lost": f"{m['steps_redone']} steps redone, 0 checkpoints",
                   "bit_exact": True,
                   "notes": f"rejoined as a spare {back['ts'] - healed:.1f} s after the "
                            "network was back; never a member of its old generation"})


def test_packet_loss_between_agents_and_supervisor(tmp_path: Path, dataset_dir: Path) -> None:
    reference = _reference(tmp_path / "ref", dataset_dir, LOSS_TRAINER)
    run = tmp_path / "run"
    with bed(["sup", *NAMES]) as b:
        key = _ssh_bed(tmp_path, b, NAMES)
        cfg = ssh_config(tmp_path / "job.yaml", dataset_dir, b, "sup", NAMES, key,
                         cluster={"nodes": 2, "spares": 1}, trainer=LOSS_TRAINER,
                         chaos={"slow_ranks": {0: LOSS_SLOW_S}},
                         checkpoint={"interval_steps": 20})
        proc = start_up(b, "sup", cfg, run)
        wait_step(run, 5)
        phases = {}
        for percent in (5, 30):
            start = b.loss("sup", NAMES, percent)
            time.sleep(120.0)
            end = b.heal("sup")
            phases[percent] = (start, end)
        code = finish(proc, 900, tmp_path / "run.sup.log")
        assert code == 0, (tmp_path / "run.sup.log").read_text()[-4000:]

    def within(kind: str, percent: int, **match: object) -> list[dict]:
        start, end = phases[percent]
        # An effect may show up to one node_lost_s after the phase ends.
        return [e for e in events(run, kind, **match)
                if start <= e["ts"] <= end + BED_TIMEOUTS["node_lost_s"]]

    lost5 = within("node_state", 5, state="lost")
    assert lost5 == [], lost5  # 5 % loss: no false node loss
    lost30, failures30 = within("node_state", 30, state="lost"), within("failure", 30)
    # 30 %: whatever happened is in the journal, with its reason: every failure has a cause
    # and every node declared lost says how long it was silent.
    assert all(f["cause"] for f in failures30)
    assert all(r.startswith(("silent for", "did not confirm the stop"))
               for r in (e.get("reason") or "" for e in lost30)), lost30
    assert states(run)[-1] == "COMPLETED"
    final = final_state_dict(run / "checkpoints" / "t" / f"step-{LOSS_TRAINER['steps']:08d}")
    assert_bit_identical(reference, final, PARAMS)
    rejected = len(events(run, "message_rejected"))
    for percent in (5, 30):
        start, end = phases[percent]
        lost, failures = within("node_state", percent, state="lost"), within("failure",
                                                                             percent)
        m = measure(run, start, generation=failures[0]["generation"]) if failures else {}
        count, steps_redone = redone(run, start, end + BED_TIMEOUTS["node_lost_s"])
        record_result({"fault": f"{percent} % packet loss between every agent and the "
                                "supervisor, 2 min",
                       "injected": "nftables numgen random drop, both directions",
                       "detected_s": m.get("detected_s"), "recovered_s": m.get("recovered_s"),
                       "data_lost": f"{steps_redone} steps redone" if failures else "none",
                       "bit_exact": True,
                       "notes": f"{len(lost)} node(s) declared lost, {count} restart(s); "
                                f"{rejected} message(s) rejected in the run"})
