"""The README's commands, run: the validate example's output is the real output, every
command in its command table exists and answers -h, and the flags it names are real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from jobs import env

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**env(), "COLUMNS": "200"})


def test_the_validate_example_shows_the_real_output(tmp_path: Path) -> None:
    block = re.search(r"```bash\n\$ cat bad\.yaml\n(?P<yaml>.*?)\$ orchestrator validate "
                      r"bad\.yaml\n(?P<out>.*?)```", README, re.DOTALL)
    assert block, "the README's validate example is gone"
    (tmp_path / "bad.yaml").write_text(block["yaml"])
    result = run("validate", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr + result.stdout == block["out"]


def test_every_command_in_the_table_exists_with_the_flags_it_names(tmp_path: Path) -> None:
    table = README[README.index("| command | what it does |"):README.index("### Where to look")]
    rows = re.findall(r"^\| `orchestrator ([a-z ]+?)(?: \[| [A-Z]| -|\\|`)(.*)$", table, re.MULTILINE)
    commands = {name.strip(): rest for name, rest in rows}
    assert {"up", "status", "logs", "down", "validate", "config show", "config schema",
            "health", "stability replay", "checkpoints list", "export",
            "data prepare"} <= set(commands), sorted(commands)
    for name, rest in commands.items():
        result = run(*name.split(), "-h", cwd=tmp_path)
        assert result.returncode == 0, (name, result.stderr)
        flags = set(re.findall(r"(--[a-z][a-z-]+)", rest.split("|")[0] + rest))
        for flag in flags - {"--install-completion", "--version"}:
            if flag in ("--to-hf", "--checkpoint") and name != "export":
                continue
            assert flag in result.stdout, f"`orchestrator {name}` has no {flag}"
    assert run("--version", cwd=tmp_path).stdout.startswith("orchestrator ")
