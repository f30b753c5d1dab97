"""A command that needs an optional dependency which is not installed says so in one line
naming the extra (``pip install 'orchestrator[s3]'``), and ``validate`` and ``health`` find
it before a job starts. The modules are hidden from a subprocess by a ``sys.meta_path``
blocker (a ``sitecustomize`` on its PYTHONPATH, inherited by the agents and their check
processes); nothing is uninstalled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config import load_config
from orchestrator.extras import EXTRA_OF, MissingExtra, from_import_error, missing, needs

ROOT = Path(__file__).resolve().parents[3]

_BLOCKER = '''
import os, sys

class _Hidden:
    """Refuses the modules in HIDE_MODULES as if they were not installed."""
    hidden = set(filter(None, os.environ.get("HIDE_MODULES", "").split(",")))

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
'''


def _env(site: Path, modules: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(HIDE_MODULES=modules, COLUMNS="250",
               PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "hide"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    return site


@pytest.fixture
def hidden(tmp_path: Path, site: Path):
    """Run ``orchestrator ARGS`` with the given modules hidden."""

    def run(modules: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=tmp_path,
                              capture_output=True, text=True, env=_env(site, modules),
                              timeout=timeout)

    return run


def _one_line(result: subprocess.CompletedProcess, extra: str) -> str:
    text = result.stdout + result.stderr
    assert "Traceback" not in text and "ModuleNotFoundError" not in text, text
    lines = [line for line in text.splitlines() if f"pip install 'orchestrator[{extra}]'" in line]
    assert len(lines) == 1, text
    return lines[0]


def test_the_blocker_hides_what_it_is_told_to(site: Path) -> None:
    """The commands below fail because of the blocker, not by chance: with nothing hidden the
    same modules import in the same kind of process."""
    probe = [sys.executable, "-c", "import s3fs, safetensors, boto3"]
    assert subprocess.run(probe, env=_env(site, ""), capture_output=True).returncode == 0
    hid = subprocess.run(probe, env=_env(site, "safetensors"), capture_output=True, text=True)
    assert hid.returncode == 1 and "No module named 'safetensors'" in hid.stderr


def test_checkpoints_on_s3_without_s3fs_name_the_s3_extra(hidden, tmp_path: Path) -> None:
    for cmd in (["checkpoints", "list", "s3://bucket/ckpt/job"],
                ["checkpoints", "verify", "s3://bucket/ckpt/job"],
                ["checkpoints", "prune", "s3://bucket/ckpt/job", "--keep-last", "2"]):
        result = hidden("s3fs", *cmd)
        assert result.returncode == 2, result.stdout + result.stderr
        line = _one_line(result, "s3")
        assert "s3fs" in line and "s3://bucket/ckpt/job" in line


def test_export_without_safetensors_names_the_hf_extra(hidden, tmp_path: Path) -> None:
    result = hidden("safetensors", "export", "--checkpoint", str(tmp_path / "ckpt"),
                    "--to-hf", str(tmp_path / "hf"))
    assert result.returncode == 2
    assert "safetensors" in _one_line(result, "hf")
    assert not (tmp_path / "hf").exists()


def test_sagemaker_submit_without_boto3_names_the_extra(hidden, tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"launcher": {"kind": "sagemaker"},
                                   "checkpoint": {"url": "s3://bucket/ckpt"}}))
    result = hidden("boto3", "sagemaker", "submit", str(cfg), "--image", "img:1",
                    "--instance-type", "ml.m5.xlarge", "--instance-count", "2",
                    "--role", "arn:aws:iam::123456789012:role/R",
                    "--output-s3", "s3://bucket/out")
    assert result.returncode == 2
    assert "boto3" in _one_line(result, "s3")


def test_validate_finds_a_missing_module_the_config_needs(hidden, tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"checkpoint": {"url": "s3://bucket/ckpt"}}))
    result = hidden("s3fs", "validate", str(cfg))
    assert result.returncode == 1, result.stdout
    line = _one_line(result, "s3")
    assert line.strip().startswith("checkpoint.url:") and "s3fs" in line
    ok = hidden("", "validate", str(cfg))  # installed: the same file is fine
    assert ok.returncode == 0 and ": ok" in ok.stdout, ok.stderr


def test_health_fails_the_node_that_lacks_the_module(hidden, tmp_path: Path) -> None:
    """The quick round's module check on every node (the agents and their check processes
    inherit the blocker), before any rank starts: exit 1, the extra named."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "job": {"name": "h"}, "cluster": {"nodes": 1, "procs_per_node": 1},
        "metrics": {"port": 0, "host": "127.0.0.1"},
        "checkpoint": {"url": "s3://bucket/ckpt"},
        "health": {"preflight": "quick"}}))
    result = hidden("s3fs", "health", str(cfg), "--json", "--run-dir", str(tmp_path / "run"),
                    timeout=240)
    assert result.returncode == 1, result.stdout + result.stderr
    report = yaml.safe_load(result.stdout)
    failed = {r["check"]: r["message"] for r in _results(report) if not r["ok"]}
    assert "host.python_modules" in failed, failed
    assert "pip install 'orchestrator[s3]'" in failed["host.python_modules"]
    assert "pip install 'orchestrator[s3]'" in failed["storage.checkpoint"]


def _results(report: object) -> list[dict]:
    """Every check result in ``health --json``'s output, however it is nested."""
    found: list[dict] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if "check" in x and "ok" in x:
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(report)
    return found


def test_needs_follow_the_config() -> None:
    plain = load_config(None, [])
    assert needs(plain) == []
    cfg = load_config(None, ["checkpoint.url=s3://b/c", "checkpoint.local_url=/nvme/c",
                             "trainer.data.format=arrow", "trainer.data.prepare_from=null",
                             "launcher.kind=sagemaker"])
    got = {(n.field, n.module) for n in needs(cfg)}
    assert got == {("checkpoint.url", "s3fs"), ("trainer.data.format", "pyarrow"),
                   ("launcher.kind", "safetensors")}
    # A script of the user's own: the built-in trainer's needs are not its needs.
    script = load_config(None, ["job.entrypoint=[python, train.py]", "checkpoint.url=s3://b/c",
                                "trainer.data.format=arrow", "trainer.data.prepare_from=null"])
    assert {n.module for n in needs(script)} == {"s3fs"}
    assert [n.module for n in missing(cfg, lambda m: m != "pyarrow")] == ["pyarrow"]
    for n in needs(cfg):
        assert f"pip install 'orchestrator[{EXTRA_OF[n.module]}]'" in n.problem


def test_an_import_error_names_its_extra_only_for_known_modules() -> None:
    known = ModuleNotFoundError("No module named 'boto3'", name="boto3")
    assert str(from_import_error(known)).endswith("pip install 'orchestrator[s3]'")
    try:  # fsspec's way: ImportError("Install s3fs ...") raised from the import's error
        try:
            raise ModuleNotFoundError("No module named 's3fs'", name="s3fs")
        except ImportError as inner:
            raise ImportError("Install s3fs to access S3") from inner
    except ImportError as outer:
        assert isinstance(from_import_error(outer), MissingExtra)
    assert from_import_error(ModuleNotFoundError("x", name="orchestrator.nope")) is None
    assert from_import_error(ImportError("cannot import name 'x'")) is None
