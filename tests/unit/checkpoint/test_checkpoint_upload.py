"""The uploader between two local directories (the S3 transport itself is exercised against
moto in tests/integration/test_checkpoints_s3.py): commit order, retention per tier,
superseded steps, a local copy that rotted before its upload."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from _checkpoint_files import flip_byte, make_step

from trainer.checkpoint import layout
from trainer.checkpoint.store import LOCAL, REMOTE, Tier
from trainer.checkpoint.upload import Uploader


def uploader(tmp_path: Path, events: list, **kw: Any) -> tuple[Path, Path, Uploader]:
    local, remote = tmp_path / "local", tmp_path / "remote"
    local.mkdir()
    remote.mkdir()
    args = {"keep_last": 2, "keep_every": None, "attempts": 2, "backoff_s": 0.01,
            "backoff_max_s": 0.01, **kw}
    up = Uploader(Tier.at(str(local), LOCAL), Tier.at(str(remote), REMOTE),
                  report=lambda name, **d: events.append((name, d)), log=lambda m: None, **args)
    return local, remote, up


def test_manifest_is_copied_last_and_the_remote_copy_verifies(tmp_path: Path,
                                                             monkeypatch) -> None:
    events: list = []
    local, remote, up = uploader(tmp_path, events)
    make_step(local, 10)
    order: list[str] = []
    real_put, real_write = up.remote.fs.put_file, layout.write_manifest
    monkeypatch.setattr(up.remote.fs, "put_file",
                        lambda src, dst, **kw: (order.append(Path(dst).name),
                                                real_put(src, dst, **kw)))
    monkeypatch.setattr(layout, "write_manifest",
                        lambda url, m, fs=None: (order.append("manifest.json"),
                                                 real_write(url, m, fs)))
    up.submit(10)
    assert up.wait(30)
    assert order[-1] == "manifest.json" and set(order[:-1]) == {"__0_0.distcp", ".metadata"}
    assert layout.verify(str(remote / "step-00000010")).ok
    committed = [d for n, d in events if n == "checkpoint_committed"]
    assert committed[0]["tier"] == REMOTE and committed[0]["via"] == "upload"
    assert committed[0]["retries"] == 0
    up.close()


def test_remote_retention_keeps_last_m_and_every_nth_forever(tmp_path: Path) -> None:
    events: list = []
    local, remote, up = uploader(tmp_path, events, keep_last=1, keep_every=20)
    for step in (10, 20, 30, 40, 50):
        make_step(local, step)
        up.submit(step)
        assert up.wait(30)
    kept = [c.step for c in layout.list_checkpoints(str(remote)) if c.committed]
    assert kept == [20, 40, 50]
    pruned = [d for n, d in events if n == "checkpoint_pruned"]
    assert all(d["tier"] == REMOTE for d in pruned)
    assert sorted(s for d in pruned for s in d["steps"]) == [10, 30]
    up.close()


def test_queued_steps_are_superseded_unless_kept_forever(tmp_path: Path, monkeypatch) -> None:
    events: list = []
    local, remote, up = uploader(tmp_path, events, keep_every=20)
    for step in (10, 20, 30, 40):
        make_step(local, step)
    gate = threading.Event()
    real = up._upload
    monkeypatch.setattr(up, "_upload", lambda step: (gate.wait(30), real(step)))
    up.submit(10)
    deadline = time.monotonic() + 30
    while up._in_flight != 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    for step in (20, 30, 40):  # saves go on while step 10 uploads
        up.submit(step)
    assert up.pending == {10, 20, 30, 40}  # protected from local pruning meanwhile
    gate.set()
    assert up.wait(30)
    done = [d["step"] for n, d in events if n == "checkpoint_committed"]
    skipped = [d["step"] for n, d in events if n == "checkpoint_upload_skipped"]
    assert done == [10, 20, 40] and skipped == [30]  # 20 is a multiple of keep_every
    assert up.pending == set()
    up.close()


def test_a_local_copy_that_rotted_is_not_uploaded(tmp_path: Path) -> None:
    events: list = []
    local, remote, up = uploader(tmp_path, events)
    make_step(local, 10)
    flip_byte(local / "step-00000010" / "__0_0.distcp")
    up.submit(10)
    assert up.wait(30)
    failed = [d for n, d in events if n == "checkpoint_upload_failed"]
    assert "local copy fails verification" in failed[0]["error"]
    assert layout.list_checkpoints(str(remote)) == []
    up.close()
