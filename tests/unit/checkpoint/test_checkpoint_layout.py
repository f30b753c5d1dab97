"""Manifests, checksums, verification and retention on a real local filesystem."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from _checkpoint_files import flip_byte, make_step

from trainer.checkpoint import layout


def test_manifest_lists_every_file_with_size_and_xxh3(tmp_path: Path) -> None:
    files = {"a.distcp": b"x" * 1000, "sub/b.distcp": b"yz", ".metadata": b"m"}
    url = make_step(tmp_path, 3, files, tokens=7)
    m = layout.read_manifest(url)
    assert m["checksum"] == "xxh3_64" and m["step"] == 3 and m["tokens"] == 7
    assert set(m["files"]) == {"a.distcp", "sub/b.distcp", ".metadata"}
    assert m["files"]["a.distcp"]["size"] == 1000
    import xxhash

    assert m["files"]["sub/b.distcp"]["xxh3_64"] == xxhash.xxh3_64(b"yz").hexdigest()
    assert layout.verify(url).ok


@pytest.mark.parametrize("damage, expected", [
    (lambda d: flip_byte(d / "__0_0.distcp"), "__0_0.distcp: xxh3_64"),
    (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-5]),
     "__0_0.distcp: size"),
    (lambda d: (d / ".metadata").unlink(), ".metadata: missing"),
    (lambda d: (d / "manifest.json").write_text("{not json"),
     "manifest.json: missing or unreadable"),
])
def test_damage_is_found_and_named(tmp_path: Path, damage, expected: str) -> None:
    url = make_step(tmp_path, 5)
    damage(Path(url))
    result = layout.verify(url)
    assert not result.ok
    assert any(p.startswith(expected) for p in result.problems), result.problems


def test_size_only_verification_misses_a_flip_that_checksums_catch(tmp_path: Path) -> None:
    url = make_step(tmp_path, 5)
    flip_byte(Path(url) / "__0_0.distcp")
    assert layout.verify(url, checksums=False).ok
    assert not layout.verify(url).ok


def test_legacy_crc32_manifest_verifies_and_unknown_checksum_is_unverifiable(
        tmp_path: Path) -> None:
    url = make_step(tmp_path, 2, commit=False)
    files = {}
    for p in sorted(Path(url).iterdir()):
        files[p.name] = {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
    layout.write_manifest(url, {"format": layout.FORMAT, "step": 2, "files": files})
    assert layout.verify(url).ok
    flip_byte(Path(url) / "__0_0.distcp")
    assert "crc32" in layout.verify(url).problems[0]
    files = {k: {"size": v["size"], "md5": "00"} for k, v in files.items()}
    layout.write_manifest(url, {"format": layout.FORMAT, "step": 2, "files": files})
    result = layout.verify(url)
    assert not result.ok and "unverifiable" in result.problems[0]


def test_files_the_save_wrote_must_be_visible(tmp_path: Path) -> None:
    url = make_step(tmp_path, 4, commit=False)
    with pytest.raises(FileNotFoundError, match="__1_0.distcp.*shared by all ranks"):
        layout.build_manifest(url, {"__0_0.distcp", "__1_0.distcp", ".metadata"})
    assert layout.build_manifest(url, {"__0_0.distcp", ".metadata"})["files"]


def test_newest_verified_skips_corrupt_and_uncommitted(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        make_step(tmp_path, s)
    make_step(tmp_path, 40, commit=False)
    flip_byte(Path(layout.step_url(str(tmp_path), 30)) / "__0_0.distcp")
    skipped = []
    found = layout.newest_verified(str(tmp_path), on_skip=lambda i, p: skipped.append(i.step))
    assert found is not None and found[0].step == 20 and skipped == [30]
    assert layout.newest_verified(str(tmp_path), max_step=15)[0].step == 10


def test_retention_keeps_last_k_every_nth_and_protected(tmp_path: Path) -> None:
    assert layout.retained([10, 20, 30, 40, 50], 2) == {40, 50}
    assert layout.retained([10, 20, 30, 40, 50], 2, keep_every=20) == {20, 40, 50}
    assert layout.retained([10, 20, 30], 1, protect={10}) == {10, 30}
    for s in (10, 20, 30, 40, 50):
        make_step(tmp_path, s)
    make_step(tmp_path, 15, commit=False)  # debris older than the newest commit
    make_step(tmp_path, 60, commit=False)  # a save in flight: left alone
    assert layout.prune(str(tmp_path), 2, keep_every=20, dry_run=True) == [10, 15, 30]
    assert len(layout.list_checkpoints(str(tmp_path))) == 7
    assert layout.prune(str(tmp_path), 2, keep_every=20) == [10, 15, 30]
    assert [c.step for c in layout.list_checkpoints(str(tmp_path))] == [20, 40, 50, 60]


def test_remove_deletes_the_manifest_first(tmp_path: Path, monkeypatch) -> None:
    url = make_step(tmp_path, 7)
    fs, path = layout.filesystem(url)
    order = []
    real_rm = fs.rm
    monkeypatch.setattr(fs, "rm", lambda p, recursive=False: (
        order.append(p), real_rm(p, recursive=recursive)))
    layout.remove(url)
    assert order[0].endswith("manifest.json") and not Path(url).exists()


def test_manifest_is_written_atomically(tmp_path: Path) -> None:
    url = make_step(tmp_path, 1)
    assert not list(Path(url).glob("*.tmp"))
    assert json.loads((Path(url) / "manifest.json").read_text())["format"] == layout.FORMAT
