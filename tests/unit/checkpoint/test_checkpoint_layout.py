"""Manifests, digests, signatures, verification and retention on a real local filesystem
(containment and tampering: test_checkpoint_tamper.py)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from _checkpoint_files import KEY, TRUST, flip_byte, make_step

from trainer.checkpoint import layout, signing


def test_manifest_lists_every_file_with_size_and_blake3_and_is_signed(tmp_path: Path) -> None:
    files = {"a.distcp": b"x" * 1000, "sub/b.distcp": b"yz", ".metadata": b"m"}
    url = make_step(tmp_path, 3, files, tokens=7)
    m = layout.read_manifest(url)
    assert m["checksum"] == "blake3" and m["step"] == 3 and m["tokens"] == 7
    assert m["format"] == layout.FORMAT
    assert set(m["files"]) == {"a.distcp", "sub/b.distcp", ".metadata"}
    assert m["files"]["a.distcp"]["size"] == 1000
    import blake3

    assert m["files"]["sub/b.distcp"]["blake3"] == blake3.blake3(b"yz").hexdigest()
    assert m["signature"]["key_id"] == signing.key_id(KEY)
    result = layout.verify(url, trust=TRUST)
    assert result.ok and result.signature == signing.SIGNED
    assert layout.verify(url).ok and layout.verify(url).signature == signing.UNCHECKED


def test_signature_outcomes_signed_unsigned_forged(tmp_path: Path) -> None:
    url = make_step(tmp_path, 4)
    manifest = layout.read_manifest(url)
    # A writer without the key changes a file and recomputes its digest: forged.
    (Path(url) / ".metadata").write_bytes(b"evil")
    import blake3

    manifest["files"][".metadata"] = {"size": 4, "blake3": blake3.blake3(b"evil").hexdigest()}
    layout.write_manifest(url, manifest)
    assert layout.verify(url).ok  # integrity alone is satisfied...
    forged = layout.verify(url, trust=TRUST)  # ...the signature is not
    assert not forged.ok and forged.signature == signing.FORGED
    assert "does not match" in forged.problems[0]
    # Signed with another key (another job's, or the forger's own): says which.
    layout.write_manifest(url, signing.sign(manifest, b"another-key-" + b"x" * 20))
    other = layout.verify(url, trust=TRUST)
    assert other.signature == signing.FORGED and "another job's key" in other.problems[0]
    # Unsigned: refused unless trusted.
    del manifest["signature"]
    layout.write_manifest(url, manifest)
    unsigned = layout.verify(url, trust=TRUST)
    assert not unsigned.ok and unsigned.signature == signing.UNSIGNED
    assert "--trust-unsigned" in unsigned.problems[0]
    assert layout.verify(url, trust=signing.Trust(KEY, trust_unsigned=True)).ok
    # No key to check a signed one with.
    layout.write_manifest(url, signing.sign(manifest, KEY))
    assert layout.verify(url, trust=signing.Trust(None)).signature == signing.NO_KEY


def test_a_signed_manifest_must_carry_cryptographic_digests(tmp_path: Path) -> None:
    url = make_step(tmp_path, 2, commit=False)
    weak = layout.build_manifest(url, algorithm="xxh3_64", step=2)
    layout.write_manifest(url, signing.sign(weak, KEY))
    result = layout.verify(url, trust=TRUST)
    assert not result.ok and "no cryptographic digest" in result.problems[0]


def test_a_manifest_moved_to_another_step_directory_fails(tmp_path: Path) -> None:
    url = make_step(tmp_path, 10)
    newer = Path(layout.step_url(str(tmp_path), 90))
    Path(url).rename(newer)  # an old checkpoint replayed as a newer one
    result = layout.verify(str(newer), trust=TRUST)
    assert not result.ok and "records step 10 but sits in step-00000090" in result.problems[0]


@pytest.mark.parametrize("damage, expected", [
    (lambda d: flip_byte(d / "__0_0.distcp"), "__0_0.distcp: blake3"),
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
    layout.write_manifest(url, {"format": layout.FORMAT_1, "step": 2, "files": files})
    assert layout.verify(url).ok
    trusted = signing.Trust(KEY, trust_unsigned=True)
    assert layout.verify(url, trust=trusted).ok  # format 1 is unsigned: trusted on request
    assert not layout.verify(url, trust=TRUST).ok
    flip_byte(Path(url) / "__0_0.distcp")
    assert "crc32" in layout.verify(url, trust=trusted).problems[0]
    files = {k: {"size": v["size"], "md5": "00"} for k, v in files.items()}
    layout.write_manifest(url, {"format": layout.FORMAT_1, "step": 2, "files": files})
    result = layout.verify(url)
    assert not result.ok and "unverifiable" in result.problems[0]


def test_resign_moves_a_checkpoint_to_another_key_after_full_verification(
        tmp_path: Path) -> None:
    new_key = b"new-job-key-" + b"n" * 20
    url = make_step(tmp_path, 6)
    assert not layout.resign(url, new_key, signing.Trust(None)).ok  # old key not given
    assert layout.resign(url, new_key, TRUST).ok
    assert layout.verify(url, trust=signing.Trust(new_key)).ok
    assert not layout.verify(url, trust=TRUST).ok
    legacy = make_step(tmp_path, 7, commit=False)
    layout.write_manifest(legacy, layout.build_manifest(legacy, algorithm="xxh3_64", step=7))
    assert not layout.resign(legacy, new_key, signing.Trust(None)).ok  # unsigned: refused
    assert layout.resign(legacy, new_key, signing.Trust(None, trust_unsigned=True)).ok
    m = layout.read_manifest(legacy)
    assert m["checksum"] == "blake3" and all("blake3" in f for f in m["files"].values())
    assert m["resigned"]["was"] == signing.UNSIGNED and "state_format" not in m
    flip_byte(Path(legacy) / "__0_0.distcp")
    assert not layout.resign(legacy, KEY, signing.Trust(new_key)).ok  # damaged: not signed


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
    found = layout.newest_verified(str(tmp_path), on_skip=lambda i, p: skipped.append(i.step),
                                   trust=TRUST)
    assert found is not None and found[0].step == 20 and skipped == [30]
    assert layout.newest_verified(str(tmp_path), max_step=15, trust=TRUST)[0].step == 10


def test_retention_keeps_last_k_every_nth_and_protected(tmp_path: Path) -> None:
    assert layout.retained([10, 20, 30, 40, 50], 2) == {40, 50}
    assert layout.retained([10, 20, 30, 40, 50], 2, keep_every=20) == {20, 40, 50}
    assert layout.retained([10, 20, 30], 1, protect={10}) == {10, 30}
    for s in (10, 20, 30, 40, 50):
        make_step(tmp_path, s)
    make_step(tmp_path, 15, commit=False)  # debris older than the newest commit
    make_step(tmp_path, 60, commit=False)  # a save in flight: left alone
    assert layout.prune(str(tmp_path), 2, keep_every=20, dry_run=True, trust=TRUST) == \
        [10, 15, 30]
    assert len(layout.list_checkpoints(str(tmp_path))) == 7
    assert layout.prune(str(tmp_path), 2, keep_every=20, trust=TRUST) == [10, 15, 30]
    assert [c.step for c in layout.list_checkpoints(str(tmp_path))] == [20, 40, 50, 60]


def test_prune_counts_only_checkpoints_that_verify(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        make_step(tmp_path, s)
    newest = Path(layout.step_url(str(tmp_path), 30)) / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[:-7])  # the newest one is truncated
    plan = layout.plan_prune(str(tmp_path), 1, trust=TRUST)
    assert plan.keep == [20] and plan.remove == [10] and list(plan.failing) == [30]
    assert "size" in plan.failing[30][0]
    assert layout.prune(str(tmp_path), 1, trust=TRUST) == [10]
    assert [c.step for c in layout.list_checkpoints(str(tmp_path))] == [20, 30]
    # Forged or unsigned ones do not count either; the flag removes failing ones.
    make_step(tmp_path, 40, key=b"forger-key-" + b"f" * 21)
    assert layout.plan_prune(str(tmp_path), 1, trust=TRUST).keep == [20]
    assert layout.prune(str(tmp_path), 1, trust=TRUST, remove_failing=True) == [30, 40]
    assert [c.step for c in layout.list_checkpoints(str(tmp_path))] == [20]


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
