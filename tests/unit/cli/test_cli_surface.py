"""The command line's surface: -h on every command, --version, config show / schema, the
dtype spellings export accepts, health from a directory it cannot write."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import typer
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cli.configdoc import canonical_dtype
from orchestrator.config.loader import default_config_path

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()


def command_paths() -> list[list[str]]:
    root = typer.main.get_command(app)
    paths: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        paths.append(path)
        if hasattr(cmd, "commands"):  # a group (typer's own click core)
            for name, sub in cmd.commands.items():
                if not sub.hidden:
                    walk(sub, [*path, name])

    walk(root, [])
    return paths


def test_dash_h_works_on_every_command() -> None:
    paths = command_paths()
    assert ["logs"] in paths and ["config", "show"] in paths and ["status"] in paths
    for path in paths:
        result = runner.invoke(app, [*path, "-h"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage:" in result.output and "--help" in result.output, path


def test_version_and_completion() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"orchestrator {version('orchestrator')}"
    assert "--install-completion" in runner.invoke(app, ["-h"]).output


def test_config_show_gives_each_field_its_description_and_default() -> None:
    result = runner.invoke(app, ["config", "show", "--set", "trainer.steps=77"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "# Where `up` creates run directories.\n  run_root: runs" in text
    # A value set away from its default says the default.
    steps = text.index("  steps: 77")
    assert "(default: " in text[text.rindex("#", 0, steps):steps]
    # The commented YAML is the resolved config itself.
    shown = yaml.safe_load(text)
    as_json = json.loads(runner.invoke(app, ["config", "show", "--json", "--set",
                                             "trainer.steps=77"]).output)
    assert shown == as_json and shown["trainer"]["steps"] == 77


def test_config_show_reports_problems_with_their_dotted_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  stepz: 3\n")
    result = runner.invoke(app, ["config", "show", str(bad)])
    assert result.exit_code == 1 and "trainer.stepz" in result.output


def test_config_schema_validates_every_shipped_config() -> None:
    result = runner.invoke(app, ["config", "schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    jsonschema.Draft202012Validator.check_schema(schema)
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert default_config_path() in configs
    for path in configs:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"trainer": {"stepz": 3}}, schema)


def test_export_accepts_the_dtype_spellings_configs_use() -> None:
    assert [canonical_dtype(d) for d in ("bf16", "BF16", "fp16", "fp32", "bfloat16", "int8")] \
        == ["bfloat16", "bfloat16", "float16", "float32", "bfloat16", "int8"]


def test_health_from_a_directory_it_cannot_write_says_what_to_do(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = runner.invoke(app, ["health", "--set", f"job.run_root={blocker}/runs"])
    assert result.exit_code == 2
    assert "cannot write the health run directory" in result.output
    assert "--run-dir" in result.output and "Traceback" not in result.output


def test_replay_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    records = tmp_path / "steps.jsonl"
    # Alternating norms: an event or two every step, far more than a pipe buffer holds.
    records.write_text("".join(json.dumps({"step": s, "loss": 2.0,
                                           "grad_norm": 100.0 if s % 2 else 1.0}) + "\n"
                               for s in range(1, 4001)))
    replay = subprocess.Popen([sys.executable, "-m", "orchestrator", "stability", "replay",
                               str(records)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-1"], stdin=replay.stdout, capture_output=True, timeout=60)
    replay.stdout.close()
    err = replay.stderr.read().decode()
    assert replay.wait(timeout=60) == 0
    assert json.loads(head.stdout)["kind"] in ("grad_spike", "growth")
    assert "Broken pipe" not in err and "Traceback" not in err


def test_slurm_outside_an_allocation_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    result = runner.invoke(app, ["up", "--set", "launcher.kind=slurm", "--run-dir",
                                 str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "runs inside an allocation" in result.output and "salloc" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_health_verdict_counts_the_nodes_that_failed() -> None:
    from orchestrator.cli.health import verdict_line

    nodes = {"local-0": {"ok": True, "fatal": [], "warn": []},
             "local-1": {"ok": False, "fatal": ["host.disk", "host.memory"], "warn": []},
             "local-2": {"ok": True, "fatal": [], "warn": ["neuron.compile_cache"]}}
    line = verdict_line({"ok": False, "nodes": nodes, "seconds": 4.12})
    assert "1 of 3 node(s) failed (local-1), 3 failed check(s), 4.1 s" in line
    ok = verdict_line({"ok": True, "nodes": {"local-0": nodes["local-0"]}, "seconds": 1.0})
    assert "healthy" in ok and "1 node(s) passed" in ok
