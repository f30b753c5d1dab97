"""Every test module has a name of its own: the suite runs as one pytest session (the
README's command) with rootdir imports, where two files of one basename stop collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
