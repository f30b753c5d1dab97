"""A writer with access to the checkpoint storage but not the job's key, against real jobs
(supervisor, agents, two gloo ranks with FSDP2): every committed checkpoint but the oldest
is tampered with a different way. Nothing outside the roots is read, written or deleted (a
canary directory), the code in a forged ``.metadata`` never runs, prune keeps the good one,
and the restart falls back to it and still resumes bit-exactly."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import xxhash
from jobs import assert_bit_identical, env, final_state_dict, journal, up, write_config

from trainer.checkpoint import layout, signing

pytestmark = pytest.mark.slow

JOB, STEPS = "t", 70
STATE = ("app.model.", "app.optim.", "progress.", "data.", "schedule.")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, env=env(), timeout=300)


def payload(real: bytes, marker: Path) -> bytes:
    """A ``.metadata`` that runs a command (writes ``marker``), then returns the real
    metadata, so a load that unpickles it goes on as if nothing happened."""
    class Payload:
        def __reduce__(self):
            return (eval, (f"__import__('pathlib').Path({str(marker)!r}).write_text('ran') "
                           f"and __import__('pickle').loads({real!r})",))
    return pickle.dumps(Payload())


def redigest(step_dir: Path, rel: str, unsigned_xxh3: bool = False) -> None:
    """Recompute the manifest entry of a changed file, as the forger can: with BLAKE3 and
    the old signature kept, or the whole manifest rewritten as format 1 (unsigned XXH3)."""
    m = json.loads((step_dir / layout.MANIFEST).read_text())
    if unsigned_xxh3:
        m.pop(signing.SIGNATURE)
        m["format"], m["checksum"] = layout.FORMAT_1, "xxh3_64"
        m["files"] = {r: {"size": (step_dir / r).stat().st_size,
                          "xxh3_64": xxhash.xxh3_64((step_dir / r).read_bytes()).hexdigest()}
                      for r in m["files"]}
    else:
        data = (step_dir / rel).read_bytes()
        m["files"][rel] = {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    (step_dir / layout.MANIFEST).write_text(json.dumps(m))


def snapshot(d: Path) -> dict[str, tuple[int, float, float, bytes]]:
    """Every file under ``d``: mode, atime, mtime and contents (read without moving atime:
    O_NOATIME as root, else the atime is put back)."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            data = p.read_bytes()
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            data = b""
        out[str(p.relative_to(d))] = (st.st_mode, st.st_atime_ns, st.st_mtime_ns, data)
    return out


def test_tampered_checkpoints_never_load_and_the_restart_resumes_the_good_one_exactly(
        tmp_path: Path, dataset_dir: Path) -> None:
    key = signing.write_key_file(tmp_path / "job.key")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": STEPS},
                       checkpoint={"url": str(tmp_path / "ckpt"), "keep_last": 7},
                       job={"env": {signing.KEY_FILE_ENV: str(key)}})
    first = up(cfg, tmp_path / "run-1")
    assert first.returncode == 0, first.stdout[-4000:]
    root = tmp_path / "ckpt" / JOB
    steps = {s: root / layout.step_dir_name(s) for s in range(10, STEPS + 1, 10)}
    assert sorted(c.step for c in layout.list_checkpoints(str(root))) == sorted(steps)
    reference = final_state_dict(steps[STEPS])

    marker = tmp_path / "PAYLOAD-RAN"
    proof = tmp_path / "proof"
    real = (steps[60] / ".metadata").read_bytes()
    assert type(pickle.loads(payload(real, proof))) is type(pickle.loads(real))
    assert proof.exists()  # the payload is real: unpickling it runs the command

    canary = tmp_path / "canary"
    shutil.copytree(steps[20], canary / "step-copy")  # a good checkpoint, outside the root
    shutil.copy(steps[40] / "__1_0.distcp", canary / "__1_0.distcp")
    for p in canary.rglob("*"):
        os.utime(p, (1_000_000, 1_000_000))

    # 70: truncated (the newest). 60: code in .metadata, its BLAKE3 recomputed, signature
    # kept. 50: the same payload behind a manifest rewritten as unsigned XXH3 (format 1).
    (steps[70] / "__0_0.distcp").write_bytes((steps[70] / "__0_0.distcp").read_bytes()[:-100])
    for s in (60, 50):
        (steps[s] / ".metadata").write_bytes(payload((steps[s] / ".metadata").read_bytes(),
                                                     marker))
    redigest(steps[60], ".metadata")
    redigest(steps[50], ".metadata", unsigned_xxh3=True)
    # 40: a file swapped for a link to identical bytes outside (digest and signature hold).
    (steps[40] / "__1_0.distcp").unlink()
    (steps[40] / "__1_0.distcp").symlink_to(canary / "__1_0.distcp")
    # 30: a file swapped for a device (/dev/zero; a FIFO when not root): reading either
    # would hang or never end.
    (steps[30] / "__0_0.distcp").unlink()
    try:
        os.mknod(steps[30] / "__0_0.distcp", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        os.mkfifo(steps[30] / "__0_0.distcp")
    # 20: the step directory swapped for a link to a good copy outside the root.
    shutil.rmtree(steps[20])
    steps[20].symlink_to(canary / "step-copy")
    before = snapshot(canary)

    k = ("--key-file", str(key))
    listed = cli("checkpoints", "list", str(root), "--checksums", "--json", *k)
    assert listed.returncode == 1
    rows = {r["step"]: r for r in json.loads(listed.stdout)}
    assert [s for s in sorted(rows) if rows[s]["verified"]] == [10]
    assert rows[60]["signature"] == signing.FORGED and rows[50]["signature"] == signing.UNSIGNED
    newest = cli("checkpoints", "verify", str(root), *k)
    assert newest.returncode == 1 and "__0_0.distcp: size" in newest.stderr
    forged = cli("checkpoints", "verify", str(steps[60]), *k)
    assert forged.returncode == 1 and "forged" in forged.stderr
    # Prune with the newest truncated: the good one is kept, the failing ones reported.
    dry = cli("checkpoints", "prune", str(root), "--keep-last", "1", "--dry-run", *k)
    assert dry.returncode == 1 and "would remove 0" in dry.stdout, dry.stdout + dry.stderr
    assert "would keep steps 10" in dry.stdout
    assert all(f"failing step {s}" in dry.stderr for s in (20, 30, 40, 50, 60, 70))
    done = cli("checkpoints", "prune", str(root), "--keep-last", "1", *k)
    assert done.returncode == 1 and "removed 0" in done.stdout
    assert sorted(c.step for c in layout.list_checkpoints(str(root))) == sorted(steps)

    second = up(cfg, tmp_path / "run-2")
    assert second.returncode == 0, second.stdout[-4000:]
    events = journal(tmp_path / "run-2")
    skipped = {e["step"]: e for e in events if e["kind"] == "checkpoint_skipped"}
    assert sorted(skipped) == [20, 30, 40, 50, 60, 70]
    assert "size" in skipped[70]["reason"]
    assert skipped[60]["signature"] == signing.FORGED and "does not match" in \
        skipped[60]["reason"]
    assert skipped[50]["signature"] == signing.UNSIGNED
    assert "__1_0.distcp: a symbolic link" in skipped[40]["reason"]
    assert "__0_0.distcp: a " in skipped[30]["reason"] and "not opened" in \
        skipped[30]["reason"]
    assert "step directory is a symbolic link" in skipped[20]["reason"]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [10]

    assert not marker.exists()  # the payload never ran, on any rank
    assert snapshot(canary) == before  # nothing outside the root read, changed or removed
    assert not steps[20].is_symlink()  # the re-save replaced the link, not its target
    n = assert_bit_identical(reference, final_state_dict(steps[STEPS]), STATE)
    assert n > 30
