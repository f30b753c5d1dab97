"""The config surface: every shipped file loads; bad input names its dotted field."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.config.loader import apply_overrides, default_config_path, parse_override

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


def test_configs_directory_is_not_empty() -> None:
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.job.name
    assert cfg.cluster.world_size >= 1


def test_default_is_local_yaml_two_cpu_nodes() -> None:
    assert default_config_path().name == "local.yaml"
    cfg = load_config()
    assert (cfg.cluster.nodes, cfg.cluster.procs_per_node) == (2, 1)
    assert cfg.cluster.accelerator == "cpu"
    assert cfg.trainer.parallelism.backend == "gloo"
    assert cfg.trainer.model.preset == "tiny"


def _problems(tmp_path: Path, text: str, overrides: list[str] | None = None) -> dict[str, str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert str(path) in str(err.value)
    return {p.path: p.message for p in err.value.problems}


def test_unknown_key_is_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "trainer:\n  stepz: 3\n")
    assert "trainer.stepz" in problems
    assert "unknown key" in problems["trainer.stepz"]


def test_wrong_type_is_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "cluster:\n  nodes: many\n")
    assert "cluster.nodes" in problems


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "cluster:\n  nodes: 0\njob:\n  name: Bad Name\n"
                                   "checkpoint:\n  keep_last: 0\n")
    assert {"cluster.nodes", "job.name", "checkpoint.keep_last"} <= set(problems)


def test_warmup_longer_than_run_is_impossible(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "trainer:\n  steps: 10\n  schedule:\n    warmup_steps: 11\n")
    assert "trainer.schedule.warmup_steps" in problems


def test_cross_section_checks_name_the_field(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "chaos:\n  kill:\n    - {step: 5, rank: 7}\n")
    assert "chaos.kill.0.rank" in problems


def test_secrets_never_come_from_the_file(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "job:\n  env:\n    AWS_SECRET_ACCESS_KEY: x\n")
    assert "job.env" in problems


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    cfg = load_config(None, ["trainer.steps=170", "cluster.spares=1",
                             "chaos.kill=[{step: 3}]"])
    assert cfg.trainer.steps == 170 and cfg.cluster.spares == 1
    assert cfg.chaos.kill[0].step == 3
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.steps=-1"])
    assert "trainer.steps" in {p.path for p in err.value.problems}


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")
    with pytest.raises(ConfigError):
        parse_override("a..b=1")
    with pytest.raises(ConfigError):
        apply_overrides({"a": 3}, ["a.b=1"])
    assert parse_override("x.y=[1, 2]") == (["x", "y"], [1, 2])


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
