"""The checkpoint config section, the journal's tiers, the save-failure wording, and the
``orchestrator checkpoints`` / ``export`` commands on local directories."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from _checkpoint_files import KEY, flip_byte, make_step, write_default_key
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.config.loader import ConfigError, validate_data
from orchestrator.journal.view import JobView


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate_data(data, "test.yaml")
    return {p.path: p.message for p in err.value.problems}


def test_tiering_config_validates_and_names_fields() -> None:
    cfg = validate_data({"checkpoint": {"url": "s3://b/ckpt", "local_url": "/nvme/ckpt",
                                        "keep_last": 2, "keep_last_remote": 5,
                                        "keep_every": 1000,
                                        "endpoint_url": "http://minio:9000"}}, "t")
    assert cfg.checkpoint.local_url == "/nvme/ckpt" and cfg.checkpoint.keep_last_remote == 5
    assert problems({"checkpoint": {"local_url": "/nvme"}}) == {
        "checkpoint.url": "local_url needs url, the remote tier to upload to"}
    assert "checkpoint.local_url" in problems({"checkpoint": {"url": "s3://b",
                                                              "local_url": "s3://c"}})
    assert "checkpoint.keep_last_remote" in problems({"checkpoint": {"keep_last_remote": 4}})
    assert "checkpoint.endpoint_url" in problems({"checkpoint": {"url": "s3://b",
                                                                 "endpoint_url": "minio:9000"}})
    secret = problems({"checkpoint": {"url": "s3://AKIA:hunter2@bucket/x"}})
    assert "credentials never go in the config" in secret["checkpoint.url"]
    assert "hunter2" not in json.dumps(secret)
    assert "checkpoint.verify_on_load" in problems({"checkpoint": {"verify_on_load": False}})
    assert validate_data({"checkpoint": {"trust_unsigned": True}}, "t").checkpoint.trust_unsigned


def test_init_from_hf_takes_the_shape_from_config_json(tmp_path: Path) -> None:
    from trainer.hf import hf_config
    from trainer.presets import ModelArgs

    args = ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                     max_seq_len=256)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args)))
    cfg = validate_data({"trainer": {"model": {"init_from_hf": str(tmp_path)},
                                     "data": {"seq_len": 64}}}, "t")
    m = cfg.trainer.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == \
        (96, 3, 6, 2, 160, 300)
    bad = problems({"trainer": {"model": {"init_from_hf": str(tmp_path), "n_layers": 4}}})
    assert bad == {"trainer.model.n_layers": f"4 differs from 3 in {tmp_path}/config.json"}
    missing = problems({"trainer": {"model": {"init_from_hf": str(tmp_path / "nope")}}})
    assert "cannot use" in missing["trainer.model.init_from_hf"]


def test_jobview_folds_tiers_and_per_tier_pruning() -> None:
    events = [
        {"kind": "checkpoint_committed", "step": 10, "tier": "local", "path": "/l/10", "ts": 1.0},
        {"kind": "checkpoint_committed", "step": 10, "tier": "remote", "path": "s3://r/10",
         "ts": 2.0, "via": "upload"},
        {"kind": "checkpoint_committed", "step": 20, "tier": "local", "path": "/l/20", "ts": 3.0},
        {"kind": "checkpoint_pruned", "steps": [10], "tier": "local", "ts": 4.0},
        {"kind": "checkpoint_committed", "step": 30, "path": "s3://old/30", "ts": 5.0},
    ]
    view = JobView.from_events(events)
    got = [(c["step"], c["tier"], c["path"]) for c in view.committed_checkpoints]
    assert got == [(10, "remote", "s3://r/10"), (20, "local", "/l/20"),
                   (30, "remote", "s3://old/30")]
    assert view.newest_checkpoint_step == 30
    view = JobView.from_events(events[:3])
    assert view.committed_checkpoints[0]["tier"] == "local+remote"
    assert view.committed_checkpoints[0]["path"] == "/l/10"
    assert view.committed_checkpoints[0]["ts"] == 1.0


def test_a_full_disk_is_named_even_when_torch_hides_the_enospc() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint.save_errors import explain_failure

    inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    inner.__context__ = OSError(errno.ENOSPC, "No space left on device")
    exc = CheckpointException("ranks", {1: (inner, None)})
    assert explain_failure(exc, "s3://b/x").startswith("disk full (ENOSPC) writing s3://b/x")
    plain = CheckpointException("ranks", {0: (ValueError("bad shape"), None)})
    assert explain_failure(plain, "s3://b/x") == "ValueError: bad shape"


runner = CliRunner()


def test_list_verify_prune_commands(tmp_path: Path) -> None:
    job = tmp_path / "ckpt" / "job"
    write_default_key(tmp_path / "ckpt")  # where the CLI finds it with no --key-file
    for s in (10, 20, 30):
        make_step(job, s)
    make_step(job, 40, commit=False)
    flip_byte(job / "step-00000030" / "__0_0.distcp")

    listed = runner.invoke(app, ["checkpoints", "list", str(job), "--json"])
    assert listed.exit_code == 0  # sizes and signatures: the flip is not seen
    rows = {r["step"]: r for r in json.loads(listed.stdout)}
    assert [rows[s]["verified"] for s in (10, 20, 30, 40)] == [True, True, True, None]
    assert rows[10]["signature"] == "signed"
    checked = runner.invoke(app, ["checkpoints", "list", str(job), "--json", "--checksums"])
    assert checked.exit_code == 1  # a listed checkpoint fails
    rows = {r["step"]: r for r in json.loads(checked.stdout)}
    assert rows[30]["verified"] is False and rows[30]["tier"] == "local"
    table = runner.invoke(app, ["checkpoints", "list", str(job), "--checksums"])
    assert table.exit_code == 1
    assert "uncommitted" in table.stdout and "NO" in table.stdout and "signed" in table.stdout

    newest = runner.invoke(app, ["checkpoints", "verify", str(job)])
    assert newest.exit_code == 1
    assert "step-00000030" in newest.stderr and "__0_0.distcp: blake3" in newest.stderr
    ok = runner.invoke(app, ["checkpoints", "verify", str(job / "step-00000020")])
    assert ok.exit_code == 0 and "OK" in ok.stdout and "signed (key" in ok.stdout
    parent = runner.invoke(app, ["checkpoints", "verify", str(tmp_path / "ckpt")])
    assert parent.exit_code == 2 and "job(s) job" in parent.stderr

    # The corrupt newest one does not count: the rule keeps step 20 and reports step 30.
    dry = runner.invoke(app, ["checkpoints", "prune", str(job), "--keep-last", "1",
                              "--dry-run"])
    assert dry.exit_code == 1 and "would remove 1" in dry.stdout
    assert "would keep steps 20" in dry.stdout and "failing step 30" in dry.stderr
    assert len(list(job.iterdir())) == 4
    done = runner.invoke(app, ["checkpoints", "prune", str(job), "--keep-last", "1"])
    assert done.exit_code == 1 and "steps 10" in done.stdout
    assert sorted(p.name for p in job.iterdir()) == ["step-00000020", "step-00000030",
                                                     "step-00000040"]
    gone = runner.invoke(app, ["checkpoints", "prune", str(job), "--keep-last", "1",
                               "--remove-failing"])
    assert gone.exit_code == 1 and "steps 30" in gone.stdout
    assert sorted(p.name for p in job.iterdir()) == ["step-00000020", "step-00000040"]


def test_verify_says_signed_unsigned_or_forged_and_sign_moves_checkpoints(
        tmp_path: Path) -> None:
    job = tmp_path / "ckpt" / "job"
    write_default_key(tmp_path / "ckpt")
    make_step(job, 10)
    make_step(job, 20, key=None)  # unsigned: an import, or an older version's
    make_step(job, 30, key=b"forger-key-" + b"f" * 21)
    unsigned = runner.invoke(app, ["checkpoints", "verify", str(job / "step-00000020")])
    assert unsigned.exit_code == 1 and "unsigned" in unsigned.stderr
    trusted = runner.invoke(app, ["checkpoints", "verify", str(job / "step-00000020"),
                                  "--trust-unsigned"])
    assert trusted.exit_code == 0 and "unsigned (trusted" in trusted.stdout
    forged = runner.invoke(app, ["checkpoints", "verify", str(job / "step-00000030")])
    assert forged.exit_code == 1 and "forged" in forged.stderr

    # Another job adopts step 10: sign it with its key after verifying with the old one.
    other = tmp_path / "other-job.key"
    other.write_bytes(b"other-job-key-" + b"o" * 18)
    old = tmp_path / "old.key"
    old.write_bytes(KEY)
    step10 = str(job / "step-00000010")
    refused = runner.invoke(app, ["checkpoints", "sign", step10, "--key-file", str(other)])
    assert refused.exit_code == 1 and "not signed" in refused.stderr
    moved = runner.invoke(app, ["checkpoints", "sign", step10, "--key-file", str(other),
                                "--from-key-file", str(old)])
    assert moved.exit_code == 0, moved.stderr
    assert runner.invoke(app, ["checkpoints", "verify", step10, "--key-file",
                               str(other)]).exit_code == 0
    assert runner.invoke(app, ["checkpoints", "verify", step10]).exit_code == 1


def test_export_refuses_a_checkpoint_that_fails_verification(tmp_path: Path) -> None:
    job = tmp_path / "ckpt" / "job"
    write_default_key(tmp_path / "ckpt")
    make_step(job, 10)
    flip_byte(job / "step-00000010" / "__0_0.distcp")
    out = runner.invoke(app, ["export", "--checkpoint", str(job / "step-00000010"),
                              "--to-hf", str(tmp_path / "hf")])
    assert out.exit_code == 1 and "fails verification" in out.stderr
    assert not (tmp_path / "hf").exists()
