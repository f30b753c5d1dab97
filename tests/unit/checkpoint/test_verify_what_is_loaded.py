"""What a restore verifies is what it loads, and no checkpoint content runs code,
against real DCP checkpoints of one rank in this process.

- A race: an attacker process watching the step directory with inotify swaps ``.metadata``
  for a pickle the moment the verifier closes it; the load then reads the swapped file.
- A re-signed pickle: a pickle re-signed into ``.metadata`` with the job's key (who holds the key can);
  ``export`` and ``verify`` never run it, and neither does ``--trust-unsigned``.
- A copy that does not load: a memory-tier copy that verifies but does not load is never chosen twice.
In every case the marker the pickle would write never appears, and the restore moves on to
the next candidate, the failing copy uncommitted, the reason reported.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from _checkpoint_files import KEY, TRUST
from fakes import Box

from trainer.checkpoint import layout, signing
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.store import REJECTED, open_store
from trainer.config import CheckpointConfig

JOB = "j"

# The attacker: waits for the verifier to close .metadata, then swaps it (an atomic rename
# of a file prepared beside it) and says so.
WATCHER = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
IN_CLOSE_NOWRITE = 0x10
fd = libc.inotify_init()
assert fd >= 0 and libc.inotify_add_watch(fd, sys.argv[1].encode(), IN_CLOSE_NOWRITE) >= 0
print("ready", flush=True)
while True:
    buf = os.read(fd, 65536)
    at = 0
    while at < len(buf):
        _, mask, _, size = struct.unpack_from("iIII", buf, at)
        name = buf[at + 16:at + 16 + size].rstrip(b"\0").decode()
        at += 16 + size
        if name == ".metadata":
            os.replace(sys.argv[2], os.path.join(sys.argv[1], ".metadata"))
            print("swapped", flush=True)
            sys.exit(0)
"""


def _state(seed: float) -> dict[str, Any]:
    return {"app": Box({"w": torch.full((4, 3), seed), "n": int(seed)})}


def payload(real: bytes, marker: Path) -> bytes:
    """A pickle that writes ``marker``, then gives back the real metadata: a load that
    unpickles it goes on as if nothing happened."""
    class Payload:
        def __reduce__(self):
            return (eval, (f"__import__('pathlib').Path({str(marker)!r}).write_text('ran') "
                           f"and __import__('pickle').loads({real!r})",))
    return pickle.dumps(Payload())


def _checkpointer(root: Path, reports: list[tuple[str, dict]]) -> Checkpointer:
    cfg = CheckpointConfig(url=str(root), async_save=False, stage_ahead=False, keep_last=5)
    store = open_store(cfg, JOB, str(root), trust=TRUST)
    return Checkpointer(cfg, store, rank=0, world_size=1, group=None, meta={},
                        report=lambda name, **data: reports.append((name, data)),
                        log=lambda _m: None)


def _saved(root: Path, steps: tuple[int, ...] = (10, 20)) -> dict[int, Path]:
    reports: list[tuple[str, dict]] = []
    ck = _checkpointer(root, reports)
    for step in steps:
        ck.save(step, _state(float(step)), tokens=step)
        ck.wait()
    ck.close()
    assert [d["step"] for n, d in reports if n == "checkpoint_committed"] == list(steps)
    return {s: root / JOB / layout.step_dir_name(s) for s in steps}


def _resign_metadata(step_dir: Path, data: bytes) -> None:
    """Who holds the job's key puts ``data`` in ``.metadata`` with a valid manifest."""
    (step_dir / ".metadata").write_bytes(data)
    m = json.loads((step_dir / layout.MANIFEST).read_text())
    m["files"][".metadata"] = {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    (step_dir / layout.MANIFEST).write_text(json.dumps(signing.sign(m, KEY)))


def test_a_metadata_swapped_after_verification_is_never_loaded(tmp_path: Path) -> None:
    steps = _saved(tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"
    evil = steps[20].parent / "evil.tmp"
    evil.write_bytes(payload((steps[20] / ".metadata").read_bytes(), marker))
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(steps[20]), str(evil)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "ready"
        reports: list[tuple[str, dict]] = []
        ck = _checkpointer(tmp_path / "ckpt", reports)
        found = ck.choose()  # rank 0 verifies step 20: the watcher swaps .metadata at close
        assert found is not None and found.step == 20
        assert watcher.stdout.readline().strip() == "swapped"
        watcher.wait(10)
        state = _state(0.0)
        manifest = ck.load(state, found)
    finally:
        watcher.kill()
    assert not marker.exists(), "the swapped .metadata ran"
    # The copy that changed is rejected (uncommitted, kept for a look); step 10 is loaded.
    assert manifest is not None and manifest["step"] == 10 and ck.restored.step == 10
    assert torch.equal(state["app"].value["w"], torch.full((4, 3), 10.0))
    assert not (steps[20] / layout.MANIFEST).exists() and (steps[20] / REJECTED).exists()
    (skipped,) = [d for n, d in reports if n == "checkpoint_skipped"]
    assert skipped["step"] == 20 and skipped["stage"] == "load"
    assert "changed since it was verified" in skipped["reason"]
    # The next restart does not pick it again.
    assert _checkpointer(tmp_path / "ckpt", []).choose().step == 10


def test_a_signed_pickle_is_refused_at_restore_export_and_with_trust_unsigned(
        tmp_path: Path) -> None:
    from orchestrator.cli.checkpoints import export_hf, verify_checkpoint

    steps = _saved(tmp_path / "ckpt")
    marker = tmp_path / "PAYLOAD-RAN"
    _resign_metadata(steps[20], payload((steps[20] / ".metadata").read_bytes(), marker))
    key_file = tmp_path / "job.key"
    key_file.write_bytes(KEY)
    # Verified: signed with the job's key, every digest right. Nothing is unpickled.
    assert verify_checkpoint(str(steps[20]), key_file=str(key_file)) == 0
    assert export_hf(str(steps[20]), tmp_path / "hf", "float32", None,
                     key_file=str(key_file)) == 1
    # The same pickle unsigned, accepted by --trust-unsigned: still never unpickled.
    m = json.loads((steps[20] / layout.MANIFEST).read_text())
    m.pop(signing.SIGNATURE)
    (steps[20] / layout.MANIFEST).write_text(json.dumps(m))
    assert export_hf(str(steps[20]), tmp_path / "hf2", "float32", None,
                     key_file=str(key_file), trust_unsigned=True) == 1
    _resign_metadata(steps[20], (steps[20] / ".metadata").read_bytes())
    reports: list[tuple[str, dict]] = []
    ck = _checkpointer(tmp_path / "ckpt", reports)
    manifest = ck.restore(_state(0.0))
    assert not marker.exists(), "a checkpoint's pickle ran"
    assert manifest is not None and manifest["step"] == 10
    (skipped,) = [d for n, d in reports if n == "checkpoint_skipped"]
    assert "not one of DCP's metadata types" in skipped["reason"]


def test_metadata_of_real_saves_passes_the_allow_list(tmp_path: Path) -> None:
    """The allow-list takes what DCP writes: every dtype, nested containers, byte items."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.checkpointer import SafeLoadPlanner
    from trainer.checkpoint.verified_reader import VerifiedReader

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
              torch.uint8, torch.bool, torch.float64, torch.complex64]
    sd = {"t": {str(d): torch.zeros(3, dtype=d) for d in dtypes},
          "x": {"a": [1, 2.5, "s", None, (3, 4)], "b": {"c": True}}}
    url = str(tmp_path / layout.step_dir_name(1))
    dcp.save(sd, checkpoint_id=url)
    manifest = layout.build_manifest(url, key=KEY, step=1)
    out = {"t": {str(d): torch.ones(3, dtype=d) for d in dtypes},
           "x": {"a": [0, 0.0, "", None, (0, 0)], "b": {"c": False}}}
    dcp.load(out, storage_reader=VerifiedReader(url, manifest), planner=SafeLoadPlanner())
    assert all(torch.equal(out["t"][k], sd["t"][k]) for k in sd["t"])
    assert out["x"] == sd["x"]


def test_enum_members_pickled_by_name_load_and_nothing_else_does() -> None:
    """Debian bookworm's Python 3.11.2 (the image's) pickles an enum member as
    ``getattr(cls, name)``: a DCP metadata saved there loads, and that ``getattr`` names only
    an allow-listed enum's member."""
    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING,
        Metadata,
        TensorProperties,
    )

    from trainer.checkpoint.verified_reader import Refused, load_metadata

    class ByName(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _MEM_FORMAT_ENCODING):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    def dumps(obj: Any, pickler: type[pickle.Pickler] = ByName) -> bytes:
        buf = io.BytesIO()
        pickler(buf).dump(obj)
        return buf.getvalue()

    props = TensorProperties(memory_format=torch.channels_last)
    meta = Metadata(state_dict_metadata={}, planner_data={"p": props})
    raw = dumps(meta)
    assert b"getattr" in raw
    loaded = load_metadata(raw)
    assert loaded.planner_data["p"].memory_format == torch.channels_last

    class Abuse(pickle.Pickler):
        def __init__(self, buf: io.BytesIO, target: Any) -> None:
            super().__init__(buf)
            self.target = target

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _MEM_FORMAT_ENCODING):
                return getattr, self.target
            return NotImplemented

    for target in [(Metadata, "__init__"), (_MEM_FORMAT_ENCODING, "__class__"),
                   (_MEM_FORMAT_ENCODING, "mro"), (Path, "home"),
                   (_MEM_FORMAT_ENCODING, 3)]:
        buf = io.BytesIO()
        Abuse(buf, target).dump(meta)
        with pytest.raises(Refused):
            load_metadata(buf.getvalue())


def test_a_memory_copy_that_verifies_but_does_not_load_is_never_chosen_twice(
        tmp_path: Path) -> None:
    from test_memory_tier import KEY as MEMORY_KEY
    from test_memory_tier import state, tier

    from trainer.checkpoint import memory_format as mf
    from trainer.checkpoint.memory_load import objects_digest
    from trainer.checkpoint.memory_slots import digest_of

    marker = tmp_path / "PAYLOAD-RAN"
    t = tier(tmp_path)
    t.save(5, 0, state(1))
    t.wait()
    t.save(10, 0, state(2))
    t.wait()
    # Who holds the key signs a copy whose object tree is a pickle torch's weights-only
    # loader refuses (an UnpicklingError, not a ValueError, before).
    (copy,) = [c for c in t.slots.copies("own", 0) if c.manifest.step == 10]
    buf = t.slots.map("own", 0, copy.slot)
    blob = payload(pickle.dumps({}), marker)
    m = copy.manifest
    objects = mf.Blob(offset=m.objects.offset, nbytes=len(blob))
    buf[objects.offset:objects.offset + len(blob)] = blob
    forged = m.model_copy(update={"objects": objects,
                                  "data_bytes": objects.offset + len(blob),
                                  "objects_digest": objects_digest(blob)})
    forged = forged.model_copy(update={"digest": digest_of(buf, forged)})
    raw = forged.model_dump(mode="json", exclude_none=True)
    raw.pop("signature", None)
    t.slots.commit("own", 0, copy.slot, mf.encode(mf.sign(raw, MEMORY_KEY)))
    plan = t.plan(durable_step=None, max_step=None)
    assert plan.use and plan.step == 10, plan.reason  # it verifies
    with pytest.raises(ValueError, match="does not load"):
        t.load(plan, state(3))
    assert not marker.exists()
    # Uncommitted: the next plan takes the older copy (then the durable tier), never it.
    again = t.plan(durable_step=None, max_step=None)
    assert again.use and again.step == 5
    dst = state(3)
    t.load(again, dst)
    assert torch.equal(dst["model"].value["w"], state(1)["model"].value["w"])


def test_a_memory_object_tree_changed_after_the_plan_is_refused(tmp_path: Path) -> None:
    from test_memory_tier import state, tier

    t = tier(tmp_path)
    t.save(5, 0, state(1))
    t.wait()
    plan = t.plan(durable_step=None, max_step=None)
    assert plan.use
    m = plan.manifest
    tree = io.BytesIO()
    torch.save({"model": {}, "extra": {}, "progress": {}}, tree)
    data = tree.getvalue()[:m.objects.nbytes].ljust(m.objects.nbytes, b"\0")
    plan.data[m.objects.offset:m.objects.offset + m.objects.nbytes] = data
    with pytest.raises(ValueError, match="changed since the copy was verified"):
        t.load(plan, state(3))
    assert t.slots.copies("own", 0) == []
