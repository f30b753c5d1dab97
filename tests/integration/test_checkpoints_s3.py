"""The S3 tier against a real S3 endpoint over HTTP: moto's server on 127.0.0.1, with a
fault-injecting proxy in front (tests/s3.py). These run a real model's DCP checkpoints
through the real checkpointer in this process (one gloo rank); the full-job tests live in
test_checkpoints_jobs.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from s3 import Rule, S3Endpoint, aws_env, s3_endpoint, wait_until

from trainer.checkpoint import layout
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.retry import retrying
from trainer.checkpoint.store import LOCAL, REMOTE, open_store
from trainer.checkpoint.upload import Uploader
from trainer.config import CheckpointConfig
from trainer.model import build_model
from trainer.presets import PRESETS
from trainer.state import ModelOptimState, Progress


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Endpoint]:
    with s3_endpoint() as ep:
        for k, v in aws_env(ep.url).items():
            monkeypatch.setenv(k, v)
        yield ep


@pytest.fixture(autouse=True)
def job_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The job's signing key, as the supervisor hands it to rank 0 (never ~/.config)."""
    from trainer.checkpoint import signing

    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    path = signing.write_key_file(tmp_path / "job.key")
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(path))
    return path


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, name: str, **data: Any) -> None:
        self.items.append((name, data))

    def named(self, name: str, **match: Any) -> list[dict[str, Any]]:
        return [d for n, d in self.items if n == name
                and all(d.get(k) == v for k, v in match.items())]


class Trainee:
    """A tiny model + AdamW whose state changes every step, checkpointed through tiers."""

    def __init__(self, cfg: CheckpointConfig, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = build_model(PRESETS["tiny"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.progress = Progress()
        self.state = {"app": ModelOptimState(self.model, self.opt), "progress": self.progress}
        self.events = Events()
        self.logs: list[str] = []
        retry = retrying(cfg.upload_attempts, cfg.upload_backoff_s, cfg.upload_backoff_max_s)
        self.store = open_store(cfg, "job", cfg.url, retry)
        uploader = None
        if self.store.remote is not None:
            uploader = Uploader(self.store.primary, self.store.remote,
                                keep_last=cfg.keep_last_remote or cfg.keep_last,
                                keep_every=cfg.keep_every, attempts=cfg.upload_attempts,
                                backoff_s=cfg.upload_backoff_s,
                                backoff_max_s=cfg.upload_backoff_max_s, report=self.events,
                                log=self.logs.append)
        self.ckpt = Checkpointer(cfg, self.store, rank=0, world_size=1, group=None,
                                 meta={"job": "job"}, report=self.events, log=self.logs.append,
                                 uploader=uploader)

    def step(self) -> None:
        tokens = torch.randint(0, 264, (2, 16))
        loss = torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1),
                                                 tokens.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.progress.step += 1

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def tiered(tmp_path: Path, s3: S3Endpoint, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(url=f"s3://{s3.bucket}/ckpt", local_url=str(tmp_path / "local"),
                            upload_backoff_s=0.05, upload_backoff_max_s=0.2, **kw)


def test_upload_survives_throttling_and_training_never_waits_for_it(
        tmp_path: Path, s3: S3Endpoint, pg: None) -> None:
    t = Trainee(tiered(tmp_path, s3, keep_last=2))
    uploader = t.ckpt.uploader
    # The upload of step 1 hangs on its first PUT until released...
    hold = s3.proxy.add(Rule(lambda m, p: m == "PUT" and "step-00000001/" in p, status=None))
    t.step()
    t.ckpt.save(1, t.state, 100)
    t.ckpt.wait()
    wait_until(lambda: hold.hits, 30, "the upload of step 1 to reach S3")
    # ...while training goes on: two more steps commit locally, the upload still in flight.
    blocked = []
    for step in (2, 3):
        t.step()
        blocked.append(t.ckpt.save(step, t.state, 100 * step))
        t.ckpt.wait()
    assert [e["step"] for e in t.events.named("checkpoint_committed", tier=LOCAL)] == [1, 2, 3]
    assert uploader.pending == {1, 2, 3}
    assert layout.read_manifest(t.store.remote.step_url(1), t.store.remote.fs) is None
    assert max(blocked) < 5.0
    # Then S3 throttles: 4 PUTs answer 503 SlowDown and 2 answer 500 InternalError.
    s3.proxy.add(Rule(lambda m, p: m in ("PUT", "POST"), status=503, count=4))
    s3.proxy.add(Rule(lambda m, p: m in ("PUT", "POST"), status=500, count=2))
    s3.proxy.release.set()
    assert uploader.wait(timeout=120)
    remote = t.events.named("checkpoint_committed", tier=REMOTE)
    assert [e["step"] for e in remote] == [1, 3]  # 2 was superseded by 3 while queued
    assert t.events.named("checkpoint_upload_skipped", step=2)
    assert s3.proxy.count(status=503) == 4 and s3.proxy.count(status=500) == 2
    retries = t.events.named("checkpoint_upload_retry")
    assert retries and all("SlowDown" in r["error"] or "reduce your request rate" in r["error"]
                           or "internal error" in r["error"].lower() for r in retries)
    assert sum(e["retries"] for e in remote) == len(retries)
    for step in (1, 3):
        assert layout.verify(t.store.remote.step_url(step), fs=t.store.remote.fs).ok
    assert t.events.named("checkpoint_upload_failed") == []
    t.ckpt.close()


def test_spent_retries_leave_the_remote_copy_uncommitted(tmp_path: Path, s3: S3Endpoint,
                                                         pg: None) -> None:
    t = Trainee(tiered(tmp_path, s3, upload_attempts=2))
    s3.proxy.add(Rule(lambda m, p: m == "PUT" and "manifest.json" in p, status=503, count=None))
    t.step()
    t.ckpt.save(1, t.state, 1)
    t.ckpt.finish()
    t.ckpt.close()
    failed = t.events.named("checkpoint_upload_failed", step=1)
    assert failed and "reduce your request rate" in failed[0]["error"]
    assert failed[0]["retries"] == 1  # upload_attempts=2: one retry, then it gives up
    remote = layout.list_checkpoints(t.store.remote.root, t.store.remote.fs)
    assert [(c.step, c.committed) for c in remote] == [(1, False)]
    assert layout.verify(t.store.primary.step_url(1)).ok


def test_resume_from_s3_alone_restores_every_tensor_exactly(tmp_path: Path, s3: S3Endpoint,
                                                            pg: None) -> None:
    cfg = tiered(tmp_path, s3)
    a = Trainee(cfg, seed=0)
    for _ in range(3):
        a.step()
    a.ckpt.save(3, a.state, 300)
    a.ckpt.finish()  # the end of training: the last save committed and uploaded
    a.ckpt.close()
    saved = a.params()
    saved_opt = {k: v.clone() for k, v in a.opt.state[next(iter(a.model.parameters()))].items()}
    import shutil

    shutil.rmtree(tmp_path / "local")  # the node is gone; only S3 has the checkpoint
    b = Trainee(cfg, seed=1)
    assert not torch.equal(b.params()["output.weight"], saved["output.weight"])
    manifest = b.ckpt.restore(b.state)
    assert manifest["step"] == 3 and b.progress.step == 3
    assert b.ckpt.restored.fetched_from == f"s3://{s3.bucket}/ckpt/job/step-00000003"
    assert b.ckpt.restored.tier == LOCAL and layout.verify(b.ckpt.restored.url).ok
    for k, v in saved.items():
        assert torch.equal(b.params()[k], v), k
    restored_opt = b.opt.state[next(iter(b.model.parameters()))]
    for k, v in saved_opt.items():
        assert torch.equal(restored_opt[k], v), k
    b.ckpt.close()


def test_a_corrupt_remote_newest_is_skipped_for_the_previous_one(tmp_path: Path,
                                                                 s3: S3Endpoint, pg: None) -> None:
    cfg = tiered(tmp_path, s3, keep_last=3)
    a = Trainee(cfg)
    for step in (1, 2):
        a.step()
        a.ckpt.save(step, a.state, step)
        a.ckpt.wait()
        a.ckpt.uploader.wait(60)
    a.ckpt.close()
    import shutil

    shutil.rmtree(tmp_path / "local")
    fs = a.store.remote.fs
    victim = f"{s3.bucket}/ckpt/job/step-00000002/__0_0.distcp"
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0x40
    fs.pipe_file(victim, bytes(data))
    b = Trainee(cfg)
    assert b.ckpt.restore(b.state)["step"] == 1
    skipped = b.events.named("checkpoint_skipped")
    assert [(e["step"], e["tier"]) for e in skipped] == [(2, REMOTE)]
    assert skipped[0]["problems"][0].startswith("__0_0.distcp: blake3")
    assert not (tmp_path / "local" / "job" / "step-00000002").exists()
    b.ckpt.close()


def test_single_s3_tier_saves_with_dcp_fsspec_and_restores(tmp_path: Path, s3: S3Endpoint,
                                                            pg: None) -> None:
    cfg = CheckpointConfig(url=f"s3://{s3.bucket}/direct", keep_last=1)
    a = Trainee(cfg)
    assert a.store.primary.name == REMOTE and a.ckpt.uploader is None
    for step in (1, 2):
        a.step()
        a.ckpt.save(step, a.state, step)
        a.ckpt.wait()
    a.ckpt.close()
    assert [e["tier"] for e in a.events.named("checkpoint_committed")] == [REMOTE, REMOTE]
    assert a.events.named("checkpoint_pruned", tier=REMOTE)[0]["steps"] == [1]
    saved = a.params()
    b = Trainee(cfg, seed=3)
    assert b.ckpt.restore(b.state)["step"] == 2
    assert b.ckpt.restored.url == f"s3://{s3.bucket}/direct/job/step-00000002"
    assert all(torch.equal(b.params()[k], v) for k, v in saved.items())
    b.ckpt.close()


_UPLOAD_ONE = textwrap.dedent("""
    import sys, time
    from trainer.checkpoint.store import Tier
    from trainer.checkpoint.upload import Uploader
    local, remote = Tier.at(sys.argv[1], "local"), Tier.at(sys.argv[2], "remote")
    up = Uploader(local, remote, keep_last=3, keep_every=None, attempts=3, backoff_s=0.05,
                  backoff_max_s=0.1, report=lambda *a, **k: None, log=print)
    up.submit(int(sys.argv[3]))
    up.wait()
    print("upload finished", flush=True)
""")


def test_killed_mid_upload_leaves_remote_uncommitted_and_resume_uses_local(
        tmp_path: Path, s3: S3Endpoint, pg: None) -> None:
    cfg = tiered(tmp_path, s3)
    a = Trainee(cfg)
    a.step()
    a.ckpt.save(7, a.state, 7)
    a.ckpt.wait()
    a.ckpt.uploader.wait(60)  # step 7 is on S3, committed
    a.step()
    a.ckpt.uploader = None  # step 8: commit locally only; the subprocess uploads it
    a.ckpt.save(8, a.state, 8)
    a.ckpt.close()
    saved = a.params()
    files = sorted(layout.read_manifest(a.store.primary.step_url(8))["files"])
    # The uploader process is killed while its PUT of the second file is in flight.
    second = files[1]
    hold = s3.proxy.add(Rule(lambda m, p: m == "PUT" and p.endswith("/step-00000008/" + second),
                             status=None))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _UPLOAD_ONE, a.store.primary.root,
                             a.store.remote.root, "8"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: hold.hits or proc.poll() is not None, 60, "the held PUT")
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    s3.proxy.clear()
    remote = {c.step: c.committed for c in
              layout.list_checkpoints(a.store.remote.root, a.store.remote.fs)}
    assert remote == {7: True, 8: False}
    assert a.store.remote.fs.exists(f"{s3.bucket}/ckpt/job/step-00000008/{files[0]}")
    # A restart takes the newest committed copy: the local step 8, not the torn remote one.
    b = Trainee(cfg, seed=5)
    assert b.ckpt.restore(b.state)["step"] == 8
    assert b.ckpt.restored.tier == LOCAL and b.ckpt.restored.fetched_from is None
    assert all(torch.equal(b.params()[k], v) for k, v in saved.items())
    # and it repairs the remote tier: step 8 is uploaded again and committed there.
    assert b.ckpt.uploader.wait(60)
    assert [e["step"] for e in b.events.named("checkpoint_committed", tier=REMOTE)] == [8]
    assert layout.verify(b.store.remote.step_url(8), fs=b.store.remote.fs).ok
    b.ckpt.close()


def test_token_shards_read_from_s3_equal_the_local_ones(s3: S3Endpoint, dataset_dir: Path) -> None:
    import fsspec

    from trainer.data.dataset import TokenShards

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(str(dataset_dir), f"{s3.bucket}/data/stdlib", recursive=True)
    remote = TokenShards(f"s3://{s3.bucket}/data/stdlib")
    local = TokenShards(dataset_dir)
    assert remote.total_tokens == local.total_tokens > 100_000
    for start in (0, 12345, remote.total_tokens - 1000):
        assert (remote.read(start, 1000) == local.read(start, 1000)).all()
    # Read over HTTP from S3: the index, then range reads of the shards.
    assert s3.proxy.count("GET", contains="/data/stdlib/index.json") >= 1
    assert s3.proxy.count("GET", 206, contains="/data/stdlib/shard-00000.bin") >= 1


def test_a_remote_manifest_naming_paths_outside_its_step_is_refused(
        tmp_path: Path, s3: S3Endpoint, pg: None, job_key: Path) -> None:
    """Traversal and absolute entries in an S3 manifest, signed with the job's key itself
    (only containment can stop them): the fetch reads and writes nothing outside the step's
    prefix and the local tier, and the restart falls back to the previous checkpoint."""
    import json
    import shutil

    import blake3

    from trainer.checkpoint import signing

    cfg = tiered(tmp_path, s3, keep_last=3)
    a = Trainee(cfg)
    for step in (1, 2):
        a.step()
        a.ckpt.save(step, a.state, step)
        a.ckpt.wait()
        a.ckpt.uploader.wait(60)
    a.ckpt.close()
    shutil.rmtree(tmp_path / "local")
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("x")
    fs = a.store.remote.fs
    fs.pipe_file(f"{s3.bucket}/ckpt/planted", b"payload")  # outside the step's prefix
    mkey = f"{s3.bucket}/ckpt/job/step-00000002/manifest.json"
    m = json.loads(fs.cat_file(mkey))
    digest = {"size": 7, "blake3": blake3.blake3(b"payload").hexdigest()}
    for name in ("../../planted", str(canary / "planted"), "a/../../../../planted"):
        m["files"][name] = digest
    fs.pipe_file(mkey, json.dumps(signing.sign(m, signing.read_key_file(job_key))).encode())

    b = Trainee(cfg)
    assert b.ckpt.restore(b.state)["step"] == 1
    skipped = b.events.named("checkpoint_skipped")
    assert [(e["step"], e["tier"]) for e in skipped] == [(2, REMOTE)]
    assert all("not opened" in p for p in skipped[0]["problems"])
    assert "not opened" in skipped[0]["reason"]
    assert [p.name for p in canary.iterdir()] == ["keep"]
    assert not list(tmp_path.rglob("planted*"))
    assert not (tmp_path / "local" / "job" / "step-00000002").exists()
    b.ckpt.close()


def test_a_wrong_key_stops_the_job_instead_of_starting_over(
        tmp_path: Path, pg: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints signed with another key (or unsigned) and nothing else to resume: the
    restore raises naming the keys, rather than training from scratch over them. With the
    old key, or unsigned ones trusted, it resumes."""
    from trainer.checkpoint import signing
    from trainer.checkpoint.save_errors import CheckpointTrustError

    cfg = CheckpointConfig(url=str(tmp_path / "ckpt"), keep_last=3)
    a = Trainee(cfg)
    a.step()
    a.ckpt.save(1, a.state, 1)
    a.ckpt.wait()
    a.ckpt.close()
    old = os.environ[signing.KEY_FILE_ENV]
    monkeypatch.setenv(signing.KEY_FILE_ENV,
                       str(signing.write_key_file(tmp_path / "another.key")))
    b = Trainee(cfg)
    with pytest.raises(CheckpointTrustError, match="refused for their signature.*another"):
        b.ckpt.restore(b.state)
    assert [e["signature"] for e in b.events.named("checkpoint_skipped")] == [signing.FORGED]
    b.ckpt.close()
    monkeypatch.setenv(signing.KEY_FILE_ENV, old)
    c = Trainee(cfg)
    assert c.ckpt.restore(c.state)["step"] == 1
    c.ckpt.close()
    # The same checkpoint unsigned (an import, an older version): refused, then trusted.
    step = tmp_path / "ckpt" / "job" / "step-00000001"
    m = layout.read_manifest(str(step))
    layout.write_manifest(str(step), {k: v for k, v in m.items() if k != "signature"})
    e = Trainee(cfg)
    with pytest.raises(CheckpointTrustError, match="unsigned"):
        e.ckpt.restore(e.state)
    e.ckpt.close()
    d = Trainee(cfg.model_copy(update={"trust_unsigned": True}))
    assert d.ckpt.restore(d.state)["step"] == 1
    d.ckpt.close()
