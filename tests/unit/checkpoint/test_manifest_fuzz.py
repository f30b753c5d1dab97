"""A key-less writer of the checkpoint root plants manifests: deep JSON, a
huge integer, bytes that are not UTF-8, fields of the wrong type. The layout reader raised
instead of skipping such a step, rank 0 crash-looped on it, and ``checkpoints list / verify /
prune`` printed tracebacks, locally and on S3. Now each is a step that fails verification,
named; the good ones still verify and prune never removes one.

``MANIFEST_FUZZ_EXAMPLES`` manifests are fuzzed per run (300 by default), through the layout,
the store's restore choice, the CLI's three commands, and the memory tier's manifest parser.
"""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from _checkpoint_files import KEY, TRUST, make_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli import checkpoints as cli
from trainer.checkpoint import layout
from trainer.checkpoint import memory_format as mf
from trainer.checkpoint.store import CheckpointStore, Tier

EXAMPLES = int(os.environ.get("MANIFEST_FUZZ_EXAMPLES", "300"))
PLANTED = 99_999_999  # the newest step: what a restore tries first

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 80), 1 << 80), st.floats(),
                    st.text(max_size=12))
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) |
                     st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)
_field = st.sampled_from(["format", "step", "files", "signature", "created", "tokens",
                          "world_size", "model", "checksum", "x"])


def _shaped(good: dict) -> st.SearchStrategy[bytes]:
    """A real manifest with fields replaced, dropped, or files entries broken."""
    def mutate(changes: list[tuple[str, object]], drop: list[str], entry: object) -> bytes:
        m = json.loads(json.dumps(good))
        for key, value in changes:
            m[key] = value
        for key in drop:
            m.pop(key, None)
        if isinstance(m.get("files"), dict) and m["files"]:
            m["files"][next(iter(m["files"]))] = entry
        return json.dumps(m, allow_nan=True).encode()
    return st.builds(mutate, st.lists(st.tuples(_field, _json), max_size=3),
                     st.lists(_field, max_size=2), _json)


_SPECIAL = [b"[" * 100_000 + b"]" * 100_000, b'{"step": ' + b"9" * 5000 + b"}",
            b'{"format": "orchestrator-checkpoint/2", "step": 1e400, "files": {}}',
            b"\xff\xfe\x00garbage", b"", b"null", b'{"files": {"a": {"size": NaN}}}',
            b'{"format": "orchestrator-checkpoint/2", "files": {"../x": {"size": 1}}}']


def _damaged(good: dict) -> st.SearchStrategy[bytes]:
    raw = json.dumps(good).encode()
    return st.one_of(_shaped(good), _shaped(good), st.sampled_from(_SPECIAL),
                     st.binary(max_size=200),
                     st.integers(0, len(raw)).map(lambda n: raw[:n]),
                     _json.map(lambda v: json.dumps(v, allow_nan=True).encode()))


def _quiet(fn, *args, **kwargs) -> int:  # noqa: ANN001
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    job = tmp_path / "ckpt" / "j"
    for step in (10, 20):
        make_step(job, step)
    (tmp_path / "job.key").write_bytes(KEY)
    monkeypatch.setattr(cli, "out", cli.Console(file=io.StringIO()))
    monkeypatch.setattr(cli, "err", cli.Console(file=io.StringIO()))
    return job


def test_planted_manifests_never_raise_and_good_checkpoints_survive(root: Path) -> None:
    good = json.loads((root / layout.step_dir_name(10) / layout.MANIFEST).read_text())
    planted = Path(make_step(root, PLANTED, files={"__0_0.distcp": b"x" * 64, ".metadata": b"m"},
                             commit=False))
    key_file = str(root.parent.parent / "job.key")
    tried = {"n": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=_damaged(good))
    def one(data: bytes) -> None:
        tried["n"] += 1
        (planted / layout.MANIFEST).write_bytes(data)
        infos = layout.list_checkpoints(str(root))
        assert [c.step for c in infos] == [10, 20, PLANTED]
        result = layout.verify(str(planted), trust=TRUST)
        assert not result.ok and result.problems
        # Rank 0's restore choice passes over it to step 20, naming why.
        skipped: list = []
        store = CheckpointStore(Tier.at(str(root)), trust=TRUST)
        choice = store.select(on_skip=lambda t, i, p: skipped.append((i.step, p)),
                              log=lambda _m: None)
        assert choice is not None and choice.step == 20
        assert skipped and skipped[0][0] == PLANTED
        plan = layout.plan_prune(str(root), keep_last=1, trust=TRUST)
        assert PLANTED in plan.failing and 20 in plan.keep
        assert _quiet(cli.list_checkpoints, [str(root)], False, True,
                      key_file=key_file) == 1
        assert _quiet(cli.verify_checkpoint, str(planted), key_file=key_file) == 1
        assert _quiet(cli.prune_checkpoints, str(root), 1, None, True,
                      key_file=key_file) == 1
        # The memory tier's reader takes any bytes as well: parsed, or one ValueError.
        try:
            mf.parse_manifest(data)
        except ValueError:
            pass

    one()
    assert tried["n"] >= EXAMPLES
    assert layout.verify(layout.step_url(str(root), 20), trust=TRUST).ok


def test_planted_manifests_on_s3_are_skipped_by_list_verify_and_prune(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from s3 import aws_env, s3_endpoint

    with s3_endpoint() as ep:
        for k, v in aws_env(ep.url).items():
            monkeypatch.setenv(k, v)
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        local = tmp_path / "local" / "j"
        make_step(local, 10)
        url = f"s3://{ep.bucket}/ckpt/j"
        fs.put(str(local / layout.step_dir_name(10)), f"{url}/{layout.step_dir_name(10)}",
               recursive=True)
        (tmp_path / "job.key").write_bytes(KEY)
        monkeypatch.setattr(cli, "out", cli.Console(file=io.StringIO()))
        monkeypatch.setattr(cli, "err", cli.Console(file=io.StringIO()))
        key_file = str(tmp_path / "job.key")
        for data in _SPECIAL[:3]:  # 100,000 nested [, 5,000 digits, not UTF-8
            fs.pipe_file(f"{url}/{layout.step_dir_name(PLANTED)}/{layout.MANIFEST}", data)
            fs.invalidate_cache()
            assert _quiet(cli.list_checkpoints, [url], False, True, key_file=key_file) == 1
            assert _quiet(cli.verify_checkpoint, f"{url}/{layout.step_dir_name(PLANTED)}",
                          key_file=key_file) == 1
            assert _quiet(cli.prune_checkpoints, url, 1, None, True, key_file=key_file) == 1
            result = layout.verify(f"{url}/{layout.step_dir_name(10)}", trust=TRUST)
            assert result.ok, result.problems
