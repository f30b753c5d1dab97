"""The docs site builds with ``--strict`` (a broken link, a missing page or a stale reference
fails it), and ``bench/README.md`` indexes every benchmark and names only result files that
exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# Helpers the benchmarks import, not benchmarks themselves.
NOT_BENCHMARKS = {"common.py", "__init__.py"}
RESULT = re.compile(r"(?:bench/)?results/[A-Za-z0-9_.-]+\.json")


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_benchmark_is_in_the_index() -> None:
    index = (BENCH / "README.md").read_text()
    scripts = [p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")
               and p.name not in NOT_BENCHMARKS and "__pycache__" not in p.parts]
    assert scripts
    missing = [p.relative_to(BENCH).as_posix() for p in scripts
               if p.relative_to(BENCH).as_posix() not in index]
    assert not missing, f"benchmarks bench/README.md does not list: {missing}"


def test_every_result_named_in_the_index_and_docs_exists() -> None:
    texts = [BENCH / "README.md", ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named: dict[str, list[str]] = {}
    for path in texts:
        for match in RESULT.findall(path.read_text()):
            name = match.removeprefix("bench/")
            named.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert named
    missing = {n: where for n, where in named.items() if not (BENCH / n).is_file()}
    assert not missing, f"result files named but absent: {missing}"
