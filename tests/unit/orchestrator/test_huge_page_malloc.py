"""A rank's malloc backs large blocks with transparent huge pages (``rank_env.huge_page_malloc``):
the tunable is added once, an operator's or a job's own setting stands, and a real process
started with the rank's environment gets huge pages for a large malloc'd block."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent.rank_env import HUGE_PAGE_MALLOC, huge_page_malloc, rank_env
from orchestrator.contracts.protocol import Assignment

KEY = "glibc.malloc.hugetlb"
ITEM = st.from_regex(r"[a-z][a-z0-9_.]{0,30}=[0-9a-z]{0,6}", fullmatch=True)


def _items(value: str) -> list[str]:
    return [i for i in value.split(":") if i]


@settings(max_examples=300, deadline=None)
@given(items=st.lists(ITEM | st.sampled_from(["", KEY + "=0", KEY + "=2", " " + KEY + " =1"]),
                      max_size=6),
       absent=st.booleans())
def test_the_tunable_is_added_once_and_a_setting_of_it_stands(items: list[str],
                                                              absent: bool) -> None:
    env = {} if absent else {"GLIBC_TUNABLES": ":".join(items), "OTHER": "x"}
    before = dict(env)
    out = huge_page_malloc(env)
    assert out is env  # in place
    assert {k: v for k, v in out.items() if k != "GLIBC_TUNABLES"} == \
        {k: v for k, v in before.items() if k != "GLIBC_TUNABLES"}
    had = any(i.split("=", 1)[0].strip() == KEY for i in items) and not absent
    if had:
        assert out["GLIBC_TUNABLES"] == before["GLIBC_TUNABLES"]
    else:
        # Every item the operator set is kept, in order; ours comes last, once.
        assert _items(out["GLIBC_TUNABLES"]) == [*_items(before.get("GLIBC_TUNABLES", "")),
                                                 HUGE_PAGE_MALLOC]


def _assignment(env: dict[str, str]) -> Assignment:
    return Assignment(action="run", generation=2, node_rank=0, nproc=2, world_size=2,
                      master_addr="127.0.0.1", master_port=29500, entrypoint=["x"], env=env)


def test_every_rank_gets_it_and_the_jobs_own_setting_wins(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    env = rank_env(_assignment({}), 1, dict(base), run_dir=tmp_path, max_restarts=3, job="j")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGE_MALLOC}"
    env = rank_env(_assignment({"GLIBC_TUNABLES": f"{KEY}=0"}), 1, dict(base),
                   run_dir=tmp_path, max_restarts=3, job="j")
    assert env["GLIBC_TUNABLES"] == f"{KEY}=0"
    assert base["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"  # the agent's is untouched


# Allocates 64 MiB with malloc, writes it, and prints the AnonHugePages (kB) of the mapping
# holding it: what the pinned staging of a rank is made of.
_PROBE = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    huge, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= p < hi
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
    print(huge)
""")


def _thp_mode() -> str:
    try:
        raw = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return raw.split("[", 1)[1].split("]", 1)[0] if "[" in raw else raw.strip()


def _glibc() -> tuple[int, int]:
    try:
        _, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except (ValueError, OSError, AttributeError):
        return (0, 0)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="THP off on this host")
@pytest.mark.skipif(_glibc() < (2, 35), reason="glibc before 2.35 has no hugetlb tunable")
def test_a_process_started_with_the_rank_environment_gets_huge_pages() -> None:
    def huge_kb(env: dict[str, str]) -> int:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                             text=True, timeout=60, check=True)
        return int(out.stdout.strip())

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    with_tunable = huge_page_malloc(dict(plain))
    got = huge_kb(with_tunable)
    assert got >= 32 * 1024, f"only {got} kB of 64 MiB on huge pages"
    if _thp_mode() == "madvise":  # without the tunable nothing asks for them
        assert huge_kb({**plain, "GLIBC_TUNABLES": f"{KEY}=0"}) < got
