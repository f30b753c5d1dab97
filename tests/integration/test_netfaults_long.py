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
        lost, failures = within("node_state", percent, state="lost"), within("failure",
                                                                             percent)
        m = measure(run, phases[percent][0]) if failures else {}
        record_result({"fault": f"{percent} % packet loss between every agent and the "
                                "supervisor, 2 min",
                       "injected": "nftables numgen random drop, both directions",
                       "detected_s": m.get("detected_s"), "recovered_s": m.get("recovered_s"),
                       "data_lost": f"{m['steps_redone']} steps redone" if failures
                       else "none",
                       "bit_exact": True,
                       "notes": f"{len(lost)} node(s) declared lost, {len(failures)} "
                                f"restart(s); {rejected} message(s) rejected in the run"})


STORAGE_TRAINER = {"steps": 200}
MOTO_PORT = 5000


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A small tmpfs: the checkpoints' local tier, to be filled up."""
    import subprocess

    mount = tmp_path / "fast"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path) -> Path:
    """Take every free byte of ``mount`` (saves there then fail with ENOSPC)."""
    import os

    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_full_checkpoint_disk_and_s3_failing_for_a_minute(tmp_path: Path, dataset_dir: Path,
                                                          tmpfs: Path) -> None:
    import sys

    from netjobs import API_PORT, BED_ENV, start_agent
    from s3 import FaultProxy, Rule, aws_env

    reference = _reference(tmp_path / "ref", dataset_dir, STORAGE_TRAINER)
    run = tmp_path / "run"
    secret = "storage-test-secret-" + "s" * 24
    with bed(["sup", "svc", "n1", "n2"]) as b:
        b.popen("svc", ["moto_server", "-H", "127.0.0.1", "-p", str(MOTO_PORT)],
                log=tmp_path / "moto.log")
        b.run("svc", [sys.executable, "-c", (
            "import time,boto3\n"
            "for _ in range(100):\n"
            "    try:\n"
            f"        boto3.client('s3', endpoint_url='http://127.0.0.1:{MOTO_PORT}',"
            "region_name='us-east-1', aws_access_key_id='t', aws_secret_access_key='t')"
            ".create_bucket(Bucket='ckpt'); break\n"
            "    except Exception: time.sleep(0.2)\n")])
        proxy = FaultProxy(MOTO_PORT)
        server, _ = b.inside("svc", lambda: proxy.serve(b["svc"].addr))
        endpoint = f"http://{b['svc'].addr}:{proxy.port}"
        head = f"http://{b['sup'].addr}:{API_PORT}"
        cfg = write_config(
            tmp_path / "job.yaml", dataset_dir, job={"env": dict(BED_ENV)},
            trainer=STORAGE_TRAINER, timeouts=BED_TIMEOUTS,
            launcher={"kind": "kubernetes", "python": sys.executable},
            metrics={"host": b["sup"].addr, "port": API_PORT},
            checkpoint={"url": "s3://ckpt/jobs", "local_url": str(tmpfs), "interval_steps": 10,
                        "endpoint_url": endpoint, "max_save_failures": 50,
                        "upload_attempts": 3, "upload_backoff_s": 0.5,
                        "upload_backoff_max_s": 2.0},
            chaos={"slow_ranks": {0: 0.35}, "kill": [{"step": 180, "rank": 1}]})
        creds = aws_env(endpoint)
        proc = start_up(b, "sup", cfg, run, extra_env={"ORCH_TOKEN": secret, **creds})
        for n in ("n1", "n2"):
            start_agent(b, n, [head], run, secret, extra_env=creds)
        wait_step(run, 25)
        # The local tier's filesystem fills up for 20 s.
        full = time.time()
        filler = _fill(tmpfs)
        time.sleep(20.0)
        filler.unlink()
        freed = time.time()
        # S3 answers 503 SlowDown to everything for 40 s, then holds every request for 20 s.
        rule = proxy.add(Rule(lambda m, p: True, status=503, count=None))
        s3_down = time.time()
        time.sleep(40.0)
        proxy.rules.remove(rule)
        proxy.release.clear()
        proxy.add(Rule(lambda m, p: True, status=None, count=None))
        time.sleep(20.0)
        proxy.clear()
        s3_back = time.time()
        code = finish(proc, 600, tmp_path / "run.sup.log")
        server.shutdown()
        assert code == 0, (tmp_path / "run.sup.log").read_text()[-4000:]
    failed_saves = [e for e in events(run, "checkpoint_failed") if full <= e["ts"] <= freed + 5]
    assert failed_saves, "no save failed on the full filesystem"
    assert all("No space left" in e.get("error", "") or "ENOSPC" in e.get("error", "")
               or "space" in e.get("error", "").lower() for e in failed_saves)
    upload_failed = [e for e in events(run, "checkpoint_upload_failed")
                     if s3_down <= e["ts"] <= s3_back + 30]
    assert upload_failed, "no upload failed while S3 answered 503"
    resumed = [e for e in events(run, "checkpoint_committed", tier="remote")
               if e["ts"] > s3_back]
    assert resumed, "uploads did not resume after S3 came back"
    assert any(e["step"] == STORAGE_TRAINER["steps"] for e in events(
        run, "checkpoint_committed", tier="remote"))  # the final checkpoint reached S3
    # The restart (the chaos kill at step 180) restored a checkpoint that verified.
    loaded = [e for e in events(run, "resumed") if e.get("generation") == 2]
    assert loaded and loaded[0]["step"] % 10 == 0
    assert all(s["cause"] == "worker_exit" for s in events(run, "failure"))
    assert states(run)[-1] == "COMPLETED"
    final = final_state_dict(tmpfs / "t" / f"step-{STORAGE_TRAINER['steps']:08d}")
    assert_bit_identical(reference, final, PARAMS)
    record_result({"fault": "checkpoint filesystem full 20 s; S3 503 for 40 s, then hanging "
                            "20 s",
                   "injected": "filler file on a 24 MiB tmpfs; a fault proxy before moto",
                   "detected_s": round(failed_saves[0]["ts"] - full, 2),
                   "recovered_s": round(resumed[0]["ts"] - s3_back, 2),
                   "data_lost": f"{len(failed_saves)} save(s) failed, "
                                f"{len(upload_failed)} upload(s) given up; 0 steps",
                   "bit_exact": True,
                   "notes": "training went on; no partial checkpoint committed or loaded; "
                            "uploads resumed once S3 answered"})



def test_split_brain_a_node_cut_from_the_supervisor_only_has_its_checkpoints_fenced(
        tmp_path: Path, dataset_dir: Path) -> None:
    """Node rank 0 loses the supervisor but not its peers nor the shared filesystem: its rank
    0 trains on with its peer and commits checkpoints the supervisor never hears of, until
    the supervisor declares the node lost and stops the peer. The next generation resumes
    from the newest checkpoint the supervisor knew; the ones committed after the cut are
    fenced (skipped with the reason), never loaded."""
    reference = _reference(tmp_path / "ref", dataset_dir, BED_TRAINER)
    run = tmp_path / "run"
    with bed(["sup", *NAMES]) as b:
        key = _ssh_bed(tmp_path, b, NAMES)
        cfg = ssh_config(tmp_path / "job.yaml", dataset_dir, b, "sup", NAMES, key,
                         cluster={"nodes": 2, "spares": 1},
                         chaos={"slow_ranks": {0: 0.2}})
        proc = start_up(b, "sup", cfg, run)
        wait_step(run, 12)
        victim = next(n for n, r in node_ranks(run).items() if r == 0)
        cut = b.partition(_host_of(victim), ["sup"])
        code = finish(proc, 400, tmp_path / "run.sup.log")
        assert code == 0, (tmp_path / "run.sup.log").read_text()[-4000:]
    m = measure(run, cut, lost_node=victim)
    assert m["cause"] == "node_lost"
    resumed = next(e for e in events(run, "resumed") if e.get("generation") == 2)
    fenced = [e for e in events(run, "checkpoint_skipped") if e.get("generation") == 2
              and str(e.get("reason", "")).startswith("fenced: written by generation 1")]
    assert fenced, "no checkpoint of the cut-off generation was found and refused"
    assert all(e["step"] > resumed["step"] for e in fenced)
    known = [e["step"] for e in events(run, "checkpoint_committed", generation=1)]
    assert resumed["step"] == max(known)  # the newest the supervisor knew, not the newest
    assert states(run)[-1] == "COMPLETED"
    final = final_state_dict(run / "checkpoints" / "t" / f"step-{BED_TRAINER['steps']:08d}")
    assert_bit_identical(reference, final, PARAMS)
    record_result({"fault": "split brain: node rank 0 cut from the supervisor only",
                   "injected": f"at step {m['step_at_fault']} (nftables drop to the head)",
                   "detected_s": m["detected_s"], "recovered_s": m["recovered_s"],
                   "data_lost": f"{m['steps_redone']} steps redone; "
                                f"{len(fenced)} fenced checkpoint(s) never loaded",
                   "bit_exact": True,
                   "notes": f"checkpoint(s) {sorted(e['step'] for e in fenced)} committed "
                            f"after the cut were refused: "
                            f"{fenced[0]['reason'][:120]}"})
