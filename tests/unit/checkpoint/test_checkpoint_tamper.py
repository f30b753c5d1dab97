"""A writer with access to the checkpoint storage but not the key: manifests naming files
outside their step directory, links, devices, FIFOs. Nothing outside the roots is read,
written or deleted (a canary directory beside them), and nothing hangs."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import blake3
import pytest
from _checkpoint_files import KEY, TRUST, make_step

from trainer.checkpoint import layout, signing
from trainer.checkpoint.store import LOCAL, REMOTE, CheckpointStore, Tier


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """Files outside every root that nothing may read, change or delete."""
    d = tmp_path / "canary"
    d.mkdir()
    (d / "secret").write_bytes(b"top secret")
    (d / layout.MANIFEST).write_text('{"not": "yours"}')
    os.utime(d / "secret", (1_000_000, 1_000_000))  # an atime read would move
    return d


def canary_intact(d: Path) -> bool:
    """Nothing in ``d`` was deleted, added, changed, or read (its atime is where the fixture
    put it; this check's own read puts it back)."""
    untouched = (d / "secret").stat().st_atime == 1_000_000
    same = (sorted(p.name for p in d.iterdir()) == [layout.MANIFEST, "secret"]
            and (d / "secret").read_bytes() == b"top secret"
            and (d / layout.MANIFEST).read_text() == '{"not": "yours"}')
    os.utime(d / "secret", (1_000_000, 1_000_000))
    return untouched and same


def add_entry(url: str, rel: str, data: bytes) -> None:
    """Name ``rel`` in the manifest with the size and digest of ``data``, re-signed with the
    key (the strongest forger: only containment can stop it)."""
    m = layout.read_manifest(url)
    m["files"][rel] = {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    layout.write_manifest(url, signing.sign(m, KEY))


@pytest.mark.parametrize("entry", ["../../canary/secret", "/etc/hostname", "a/../../x",
                                   "./.metadata", "sub//x", "a\\..\\b", ""])
def test_entries_outside_the_step_directory_fail_unopened(tmp_path: Path, canary: Path,
                                                          entry: str) -> None:
    url = make_step(tmp_path / "ckpt", 10)
    target = b"top secret" if "secret" in entry else b"x"
    if entry == "/etc/hostname" and os.path.exists(entry):
        target = Path(entry).read_bytes()
    add_entry(url, entry, target)
    result = layout.verify(url, trust=TRUST)
    assert not result.ok
    assert any(layout._show(entry) in p and "not opened" in p for p in result.problems)
    assert canary_intact(canary)
    assert "top secret" not in " ".join(result.problems)


def test_a_symlinked_file_and_a_symlinked_step_directory_are_not_followed(
        tmp_path: Path, canary: Path) -> None:
    root = tmp_path / "ckpt"
    url = make_step(root, 10)
    (Path(url) / "stolen").symlink_to(canary / "secret")
    add_entry(url, "stolen", b"top secret")
    result = layout.verify(url, trust=TRUST)
    assert not result.ok and result.problems == [
        f"stolen: a symbolic link to {canary / 'secret'}, not a regular file (not opened)"]
    # A symlinked directory on the way to an entry.
    (Path(url) / "sub").symlink_to(canary)
    add_entry(url, "sub/secret", b"top secret")
    assert any("sub/secret: sub is a symbolic link" in p
               for p in layout.verify(url, trust=TRUST).problems)
    # A step directory that is itself a link, to a copy of a good checkpoint elsewhere.
    elsewhere = make_step(tmp_path / "elsewhere", 20)
    link = root / "step-00000020"
    link.symlink_to(elsewhere)
    infos = {c.step: c for c in layout.list_checkpoints(str(root))}
    assert infos[20].committed and "symbolic link" in infos[20].problem
    result = layout.verify(str(link), trust=TRUST)
    assert not result.ok and "step directory is a symbolic link" in result.problems[0]
    assert canary_intact(canary)


def test_prune_and_remove_never_follow_a_symlinked_step_directory(tmp_path: Path,
                                                                   canary: Path) -> None:
    root = tmp_path / "ckpt"
    for s in (10, 20, 30):
        make_step(root, s)
    (root / "step-00000005").symlink_to(canary)  # holds a manifest.json
    plan = layout.plan_prune(str(root), 1, trust=TRUST)
    assert 5 in plan.failing and plan.keep == [30] and plan.remove == [10, 20]
    layout.execute_prune(plan)
    assert canary_intact(canary) and (root / "step-00000005").is_symlink()
    assert layout.prune(str(root), 1, trust=TRUST, remove_failing=True) == [5]
    assert not (root / "step-00000005").exists() and canary_intact(canary)
    (root / "step-00000006").symlink_to(canary)
    layout.remove(str(root / "step-00000006"))  # the link goes, never what it points to
    assert not os.path.lexists(root / "step-00000006") and canary_intact(canary)


def test_a_manifest_that_is_a_link_is_not_read(tmp_path: Path, canary: Path) -> None:
    url = make_step(tmp_path / "ckpt", 10)
    os.unlink(Path(url) / layout.MANIFEST)
    (Path(url) / layout.MANIFEST).symlink_to(canary / layout.MANIFEST)
    result = layout.verify(url, trust=TRUST)
    assert not result.ok and "manifest.json: a symbolic link" in result.problems[0]
    assert layout.read_manifest(url) is None and canary_intact(canary)


def test_a_fifo_or_a_device_fails_without_hanging(tmp_path: Path) -> None:
    url = make_step(tmp_path / "ckpt", 10)
    os.mkfifo(Path(url) / "pipe")
    add_entry(url, "pipe", b"")
    devices = []
    try:
        os.mknod(Path(url) / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        add_entry(url, "zero", b"")
        devices.append("zero")
    except PermissionError:
        pass  # not root: the FIFO shows the same path
    result = layout.verify(url, trust=TRUST)  # opening a FIFO would block: never opened
    assert not result.ok
    assert any(p.startswith("pipe: a FIFO") for p in result.problems)
    for d in devices:
        assert any(p.startswith(f"{d}: a character device") for p in result.problems)


def test_a_save_holding_a_link_is_never_committed(tmp_path: Path, canary: Path) -> None:
    url = make_step(tmp_path / "ckpt", 10, commit=False)
    (Path(url) / "x").symlink_to(canary / "secret")
    with pytest.raises(layout.Unsafe, match="x: a symbolic link"):
        layout.build_manifest(url, key=KEY, step=10)
    assert canary_intact(canary)


def test_a_fetch_never_writes_outside_the_local_tier(tmp_path: Path, canary: Path) -> None:
    local, remote = tmp_path / "local" / "job", tmp_path / "remote" / "job"
    local.mkdir(parents=True)
    remote.mkdir(parents=True)
    store = CheckpointStore(Tier.at(str(local), LOCAL), Tier.at(str(remote), REMOTE),
                            trust=TRUST)
    make_step(local, 10)
    url = make_step(remote, 20)
    # The remote manifest names a traversal that lands in the canary, and an absolute path.
    for name in ("../../../canary/planted", str(canary / "planted2")):
        add_entry(url, name, b"payload")
    skipped = []
    choice = store.select(on_skip=lambda t, i, p: skipped.append((t, i.step, p)),
                          log=lambda m: None)
    assert choice is not None and choice.step == 10  # the newest good one
    assert [(t, s) for t, s, _ in skipped] == [(REMOTE, 20)]
    assert any("not opened" in p for p in skipped[0][2])
    assert canary_intact(canary) and not (local / "step-00000020").exists()


def test_a_forged_remote_manifest_is_refused_before_anything_is_fetched(
        tmp_path: Path, monkeypatch) -> None:
    local, remote = tmp_path / "local" / "job", tmp_path / "remote" / "job"
    local.mkdir(parents=True)
    remote.mkdir(parents=True)
    store = CheckpointStore(Tier.at(str(local), LOCAL), Tier.at(str(remote), REMOTE),
                            trust=TRUST)
    make_step(remote, 20, key=b"forger-key-" + b"f" * 21)
    opened = []
    real = layout.StepReader.open
    monkeypatch.setattr(layout.StepReader, "open",
                        lambda self, rel: (opened.append(rel), real(self, rel))[1])
    assert store.select(log=lambda m: None) is None
    assert opened == [] and not (local / "step-00000020").exists()
    assert store.refused[0].signature == signing.FORGED


def test_the_generated_key_is_private_and_stable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    monkeypatch.delenv(signing.KEY_FILE_ENV, raising=False)
    path = signing.ensure_job_key(tmp_path / "run")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert signing.ensure_job_key(tmp_path / "run") == path
    key = signing.read_key_file(path)
    assert len(key) == 64 and signing.read_key_file(path) == key
    env = signing.generation_env(tmp_path / "run", {}, {})
    assert env == {signing.KEY_FILE_ENV: str(path)}
    # The operator's key wins; a key itself never enters the (journaled) assignment.
    assert signing.generation_env(tmp_path / "run", {}, {signing.KEY_ENV: "s" * 32}) == {}
    assert signing.generation_env(tmp_path / "run", {signing.KEY_FILE_ENV: "/k"}, {}) == {}
    # A direct run: beside the checkpoint root, created by the writer.
    key2, source = signing.load_key(str(tmp_path / "direct" / "checkpoints"), create=True)
    assert source == str(tmp_path / "direct" / signing.KEY_FILE_NAME) and len(key2) == 64
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(path))
    assert signing.load_key(str(tmp_path / "direct" / "checkpoints"))[0] == key
    monkeypatch.setenv(signing.KEY_ENV, "short")
    with pytest.raises(signing.SigningKeyError, match="at least 16"):
        signing.load_key(None)
    assert hashlib.sha256(key).hexdigest()[:16] != signing.key_id(key)  # domain-separated
