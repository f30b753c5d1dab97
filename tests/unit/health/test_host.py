"""Host and storage checks against real directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.health import host
from orchestrator.health.context import SharedFsProbe

MEMINFO = """MemTotal:       2113364948 kB
MemFree:        1950104820 kB
MemAvailable:   2071023864 kB
Buffers:          204944 kB
"""


def test_disk_passes_on_writable_dirs_and_reports_free_space(make_ctx, tmp_path: Path) -> None:
    out = host.check_disk(make_ctx(["host.disk"]))
    assert out.ok and out.details["scratch_free_gib"] > 0 and out.details["checkpoint_free_gib"] > 0
    assert (tmp_path / "scratch" / "local-0").is_dir()  # created, probe file removed
    assert list((tmp_path / "scratch" / "local-0").iterdir()) == []


def test_disk_below_the_floor_is_a_full_disk(make_ctx) -> None:
    out = host.check_disk(make_ctx(["host.disk"], floors={"disk_gib": 99999}))
    assert not out.ok and "GiB free, floor 99999 GiB" in out.message
    assert out.message.count("dir") == 2  # checkpoint and scratch both named


def test_an_unwritable_scratch_dir_fails(make_ctx, tmp_path: Path) -> None:
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "local-1").write_text("a file where the directory should be")
    out = host.check_disk(make_ctx(["host.disk"], node_id="local-1"))
    assert not out.ok and out.message.startswith("scratch dir ") and "not writable" in out.message
    assert host.check_disk(make_ctx(["host.disk"], node_id="local-0")).ok


def test_memory_against_the_floor(make_ctx) -> None:
    assert host.available_memory_gib(MEMINFO) == 2071023864 / 1024**2
    assert host.check_memory(make_ctx(["host.memory"])).ok
    low = host.check_memory(make_ctx(["host.memory"], floors={"memory_gib": 99999}))
    assert not low.ok and "floor 99999 GiB" in low.message


def test_storage_round_trip_local_and_fsspec(make_ctx, tmp_path: Path) -> None:
    ctx = make_ctx(["storage.checkpoint"])
    out = host.check_storage(ctx)
    assert out.ok and out.details["write_mib_s"] > 0
    assert list((tmp_path / "ckpt" / ".health").iterdir()) == []  # the probe is removed
    ctx.checkpoint_root = "memory://ckpt"
    assert host.check_storage(ctx).ok
    (tmp_path / "blocked").write_text("x")
    ctx.checkpoint_root = str(tmp_path / "blocked" / "ckpt")
    bad = host.check_storage(ctx)
    assert not bad.ok and "is not writable and readable" in bad.message


def test_shared_fs_node_half(make_ctx, tmp_path: Path) -> None:
    ctx = make_ctx(["host.shared_fs"])
    assert host.check_shared_fs(ctx).skipped
    shared = tmp_path / "shared"
    shared.mkdir()
    ctx.shared_fs = SharedFsProbe(path=str(shared / "n.head"), content="n0nce",
                                  write_path=str(shared / "n.local-0"))
    missing = host.check_shared_fs(ctx)
    assert not missing.ok and "not on a filesystem shared with the head" in missing.message
    (shared / "n.head").write_text("other")
    assert "a different filesystem is mounted there" in host.check_shared_fs(ctx).message
    (shared / "n.head").write_text("n0nce")
    assert host.check_shared_fs(ctx).ok
    assert (shared / "n.local-0").read_text() == "n0nce local-0"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch):
    """A moto S3 server with one bucket, ``ckpt``; fsspec finds it via AWS_ENDPOINT_URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host_, port = server.get_host_and_port()
    for key, value in {"AWS_ENDPOINT_URL": f"http://{host_}:{port}", "AWS_ACCESS_KEY_ID": "k",
                       "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    import boto3
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    boto3.client("s3").create_bucket(Bucket="ckpt")
    yield
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_storage_round_trip_on_s3(make_ctx, s3) -> None:
    ctx = make_ctx(["storage.checkpoint"])
    ctx.checkpoint_root = "s3://ckpt/llama"
    out = host.check_storage(ctx)
    assert out.ok and out.message.startswith("s3://ckpt/llama: wrote and read back 1 MiB")
    ctx.checkpoint_root = "s3://no-such-bucket/llama"
    missing = host.check_storage(ctx)
    assert not missing.ok and "bucket does not exist" in missing.message
