"""Where the test suite's CPU goes: each test's CPU seconds, its processes included.

The suite runs on CI's 2 cores in parallel (pytest-xdist), so a test's wall time mostly
measures the others' load. Its CPU does not: while a test runs, its xdist worker sits in a
cgroup (v1 ``cpuacct``) of its own, and every process the test starts (supervisor, agents,
ranks, servers) inherits it. Processes of session fixtures stay in the cgroups where they
began and are not counted. Linux, root, and a cgroup v1 ``cpuacct`` hierarchy mounted at
``/sys/fs/cgroup/cpuacct``.

    python bench/ci/test_cpu.py run --out ci-test-cpu.json [pytest args...]

runs the README's test command with this file as a plugin (``-p test_cpu``) and writes each
test's CPU and wall seconds, the suite's wall time, and the totals per module, slowest first.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CGROUP = Path("/sys/fs/cgroup/cpuacct")
_RECORD = "TEST_CPU_RECORD"  # where the plugin appends one line per test
TOP = 300  # tests listed one by one in the result, costliest first
_state: dict[str, Any] = {}


# -- the plugin, in each pytest process that runs tests ---------------------------------------
def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_configure(config: Any) -> None:
    # The controller of a parallel run reports the workers' tests: it runs none itself.
    _state["runs_tests"] = hasattr(config, "workerinput") or not getattr(
        config.option, "numprocesses", None)


def _enter(group: Path) -> None:
    group.mkdir(parents=True, exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    base = os.environ.get(_RECORD)
    if not base or not _state.get("runs_tests"):
        return
    _state["n"] = _state.get("n", 0) + 1
    group = CGROUP / Path(base).stem / f"{_worker()}-{_state['n']}"
    _enter(group)
    _state.update(group=group, start=time.time())


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    group = _state.pop("group", None)
    if group is None:
        return
    _enter(CGROUP / Path(os.environ[_RECORD]).stem / f"idle-{_worker()}")
    cpu = int((group / "cpuacct.usage").read_text()) / 1e9
    line = {"id": nodeid, "cpu_s": round(cpu, 3), "wall_s": round(time.time() - _state["start"], 3),
            "worker": _worker()}
    with open(os.environ[_RECORD], "a") as f:
        f.write(json.dumps(line) + "\n")


# -- running the suite and summing up ---------------------------------------------------------
def summarize(lines: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    modules: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: {"tests": 0, "cpu_s": 0.0, "wall_s": 0.0})
    for r in lines:
        m = modules[r["id"].split("::", 1)[0]]
        m["tests"] += 1
        m["cpu_s"] += r["cpu_s"]
        m["wall_s"] += r["wall_s"]
    cpu = sum(r["cpu_s"] for r in lines)
    return {
        "suite_wall_s": round(wall_s, 1), "tests": len(lines), "tests_cpu_s": round(cpu, 1),
        "cpu_s_per_wall_s": round(cpu / wall_s, 2) if wall_s else None,
        "modules": [{"module": k, **{f: round(v, 1) for f, v in m.items()}}
                    for k, m in sorted(modules.items(), key=lambda kv: -kv[1]["cpu_s"])],
        # The costliest tests (ids cut: a parametrized id can carry a 100 kB value).
        "tests_by_cpu": [{**r, "id": r["id"][:200]}
                         for r in sorted(lines, key=lambda r: -r["cpu_s"])[:TOP]]}


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "run":
        print(__doc__)
        return 2
    args = argv[1:]
    out = "ci-test-cpu.json"
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1]
        del args[i:i + 2]
    if not (CGROUP / "cpuacct.usage").exists():
        print(f"no cgroup v1 cpuacct at {CGROUP}", file=sys.stderr)
        return 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import header, write

    record = Path(tempfile.mkdtemp(prefix="test-cpu-")) / f"test-cpu-{os.getpid()}.jsonl"
    env = {**os.environ, _RECORD: str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "test_cpu", *args], env=env)
    wall = time.time() - t0
    lines = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    for group in sorted((CGROUP / record.stem).glob("*"), reverse=True):
        with contextlib.suppress(OSError):  # one a process still sits in stays
            group.rmdir()
    with contextlib.suppress(OSError):
        (CGROUP / record.stem).rmdir()
    report = {**header(), "pytest_rc": rc, "pytest_args": args, **summarize(lines, wall)}
    path = write(out, report)
    print(f"wrote {path}: {report['tests']} tests, {report['tests_cpu_s']} CPU s in "
          f"{report['suite_wall_s']} s")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
