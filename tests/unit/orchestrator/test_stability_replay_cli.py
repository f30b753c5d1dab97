"""``orchestrator stability replay``: events as JSON lines, config files and overrides, errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cli.replay import load_replay_config, replay_lines, run_replay


def lines(n: int = 40, spikes: dict[int, float] | None = None) -> list[str]:
    out = []
    for s in range(1, n + 1):
        g = (spikes or {}).get(s, 1.0 + 0.01 * (s % 3))
        out.append(json.dumps({"step": s, "loss": 2.0, "grad_norm": g, "param_norm": 10.0,
                               "lr": 1e-3}))
    return out


def write(path: Path, text_lines: list[str]) -> Path:
    path.write_text("\n".join(text_lines) + "\n")
    return path


def replay(tmp_path: Path, *args: str, records: list[str] | None = None) -> tuple[int, str, str]:
    path = write(tmp_path / "records.jsonl", records if records is not None else
                 lines(40, {30: 1.3, 31: 1.3, 35: 5.0}))
    out, err = io.StringIO(), io.StringIO()
    config = Path(args[1]) if args[:1] == ("--config",) else None
    overrides = [a for a in args if "=" in a]
    code = run_replay(path, config, overrides, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_default_thresholds_print_one_object_per_event(tmp_path: Path) -> None:
    code, out, err = replay(tmp_path)
    assert code == 0
    events = [json.loads(line) for line in out.splitlines()]
    spikes = [e for e in events if e["kind"] == "grad_spike"]
    # g > r + 0.1 (the study's rule): steps 30 (a two-step spike) and 35.
    assert [e["step"] for e in spikes] == [30, 35]
    assert spikes[0]["g"] == 1.3 and abs(spikes[0]["r"] - 1.01) < 0.01
    assert abs(spikes[0]["threshold"] - (spikes[0]["r"] + 0.1)) < 1e-9
    end = next(e for e in events if e["kind"] == "grad_spike_end")
    assert (end["step"], end["length"], end["onset_step"]) == (32, 2, 30)
    growth = next(e for e in events if e["kind"] == "growth")
    assert growth["step"] == 35 and growth["ratio"] > 3
    assert "built-in defaults" in err and "2 grad-norm spike(s)" in err


def test_overrides_retune_the_thresholds(tmp_path: Path) -> None:
    code, out, _ = replay(tmp_path, "grad_spike.margin=0.5", "stability.growth.enabled=false")
    assert code == 0
    assert [(e["kind"], e["step"]) for e in map(json.loads, out.splitlines())] == \
        [("grad_spike", 35), ("grad_spike_end", 36)]


def test_a_job_config_file_supplies_its_stability_section(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"trainer": {"steps": 10}, "checkpoint": {"interval_steps": 7},
                                   "stability": {"grad_spike": {"mode": "relative",
                                                                "rel_margin": 3.0}}}))
    config, interval = load_replay_config(job, [])
    assert config.grad_spike.mode == "relative" and interval == 7
    code, out, err = replay(tmp_path, "--config", str(job))
    assert code == 0 and str(job) in err
    assert [json.loads(line)["step"] for line in out.splitlines()
            if json.loads(line)["kind"] == "grad_spike"] == [35]


def test_a_run_directory_replays_with_its_own_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"stability": {"growth": {"ratio": 1.2}}}))
    write(run / "steps.jsonl", lines(40, {35: 1.5}))
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(run / "steps.jsonl", None, [], out=out, err=err) == 0
    assert "config.yaml" in err.getvalue()
    assert any(json.loads(line)["kind"] == "growth" for line in out.getvalue().splitlines())


def test_a_bad_line_names_its_number(tmp_path: Path) -> None:
    records = lines(5) + ['{"step": 6}'] + lines(2)
    code, out, err = replay(tmp_path, records=records)
    assert code == 2 and "line 6" in err and "loss" in err
    code, _, err = replay(tmp_path, records=lines(3) + ["not json"])
    assert code == 2 and "line 4: invalid JSON" in err


def test_config_problems_name_the_dotted_field(tmp_path: Path) -> None:
    code, _, err = replay(tmp_path, "grad_spike.window=1")
    assert code == 2 and "stability.grad_spike.window" in err
    code, _, err = replay(tmp_path, "grad_spike.windw=3")
    assert code == 2 and "stability.grad_spike.windw" in err and "unknown key" in err


def test_generations_in_steps_jsonl_follow_the_lineage() -> None:
    spike = {24: 5.0}
    first = [json.dumps({"generation": 1, **json.loads(line)}) for line in lines(27, spike)]
    redo = [json.dumps({"generation": 2, **json.loads(line)})
            for line in lines(40, {**spike, 35: 5.0})[20:]]
    config = load_replay_config(None, [])[0]
    seen = [(e["kind"], e["step"]) for e in replay_lines(first + redo, config)]
    early = [("grad_spike", 24), ("growth", 24), ("grad_spike_end", 25)]
    later = [("grad_spike", 35), ("growth", 35), ("grad_spike_end", 36)]
    # No checkpoint snapshots: the redone steps 21..27 are consumed once only.
    assert seen == early + later
    # With a checkpoint at step 20 the lineage restarts there and step 24 runs (and fires) again.
    seen = [(e["kind"], e["step"]) for e in replay_lines(first + redo, config, 10)]
    assert seen == early * 2 + later


def test_the_cli_command_runs(tmp_path: Path) -> None:
    path = write(tmp_path / "r.jsonl", lines(40, {35: 5.0}))
    result = CliRunner().invoke(app, ["stability", "replay", str(path), "--set",
                                      "growth.enabled=false"])
    assert result.exit_code == 0
    kinds = [json.loads(line)["kind"] for line in result.stdout.splitlines()
             if line.startswith("{")]
    assert kinds == ["grad_spike", "grad_spike_end"]
    missing = CliRunner().invoke(app, ["stability", "replay", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2
