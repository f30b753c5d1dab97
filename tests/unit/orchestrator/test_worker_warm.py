"""A spare interpreter (``orchestrator.worker.warm``) handed a rank: a module, or a user's
script by path, run as ``__main__`` with the rank's argv, environment, directory and log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent.ranks import warm_module

PROBE = '''
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "file": __file__, "json": "json" in sys.modules}))
'''


def hand_off(tmp_path: Path, spec: dict) -> dict:
    log = tmp_path / "rank.log"
    spec = {"env": {"PROBE": "rank-env"}, "log": str(log), "cwd": str(tmp_path), **spec}
    out = subprocess.run([sys.executable, "-P", "-u", "-m", "orchestrator.worker.warm",
                          "--preload", "json"], input=json.dumps(spec) + "\n", text=True,
                         capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr + log.read_text()
    return json.loads(log.read_text().strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [[], ["--steps", "3"]])
def test_a_script_runs_by_path_as_python_would_run_it(tmp_path: Path, argv: list[str]) -> None:
    scripts = tmp_path / "src"
    scripts.mkdir()
    (scripts / "train.py").write_text(PROBE)
    target, args = warm_module([sys.executable, "-u", str(scripts / "train.py"), *argv])
    seen = hand_off(tmp_path, {"path": target.removeprefix("path:"), "argv": args})
    assert seen["name"] == "__main__" and seen["argv"] == [str(scripts / "train.py"), *argv]
    assert seen["path0"] == str(scripts)  # its own directory first, as `python train.py`
    assert seen["cwd"] == str(tmp_path) and seen["env"] == "rank-env"
    assert seen["file"] == str(scripts / "train.py") and seen["json"]


def test_a_module_runs_as_main(tmp_path: Path) -> None:
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(PROBE)
    spec = {"module": "probe_pkg", "argv": ["x"],
            "env": {"PROBE": "rank-env", "PYTHONPATH": str(tmp_path)}}
    # The spare's own sys.path was set at its start: the package must be importable there.
    out = subprocess.run([sys.executable, "-P", "-u", "-m", "orchestrator.worker.warm"],
                         input=json.dumps({**spec, "log": str(tmp_path / "m.log"),
                                           "cwd": str(tmp_path)}) + "\n", text=True,
                         capture_output=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{Path.cwd()}"})
    log = (tmp_path / "m.log").read_text()
    assert out.returncode == 0, out.stderr + log
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["x"]
    assert seen["env"] == "rank-env"


def test_end_of_input_exits_quietly(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-P", "-m", "orchestrator.worker.warm"], input="",
                         text=True, capture_output=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stderr == ""
