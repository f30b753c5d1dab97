"""Which pages the memory tier's root gives its slots, and the ranks' mappings asking for
2 MiB ones (page-locking and a dead rank's release cost a fraction of 4 KiB pages')."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent.memory import NodeMemory, TierPages, read_tier_pages, tier_pages
from trainer.checkpoint.memory_slots import Slots

NEVER = "always within_size advise [never] deny force"
ADVISE = "always within_size [advise] never deny force"


def _line(point: str, fstype: str, options: str, n: int = 30) -> str:
    return f"{n} 1 0:{n} / {point} rw,relatime - {fstype} none rw,{options}"


MOUNTS = "\n".join([
    "1 0 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
    _line("/dev/shm", "tmpfs", "size=24684092k", 2),
    _line("/mnt/huge", "tmpfs", "size=64g,huge=within_size", 3),
    _line("/mnt/huge/inner", "tmpfs", "size=1g", 4),
    _line("/mnt/my\\040tier", "tmpfs", "size=1g,huge=always", 5),
    _line("/mnt/adv", "tmpfs", "huge=advise", 6),
])


@pytest.mark.parametrize(("root", "shmem", "huge", "why"), [
    ("/dev/shm", NEVER, False, "tmpfs /dev/shm huge=never: 4 KiB pages"),
    ("/dev/shm/", ADVISE, False, "tmpfs /dev/shm huge=never: 4 KiB pages"),
    ("/mnt/huge", NEVER, True, "tmpfs /mnt/huge huge=within_size"),
    ("/mnt/huge/x/y", NEVER, True, "tmpfs /mnt/huge huge=within_size"),
    ("/mnt/hugely", NEVER, False, "/ is ext4, not a tmpfs"),
    ("/mnt/huge/inner/z", NEVER, False, "tmpfs /mnt/huge/inner huge=never: 4 KiB pages"),
    ("/mnt/my tier/t", NEVER, True, "tmpfs /mnt/my tier huge=always"),
    ("/mnt/adv", NEVER, True, "tmpfs /mnt/adv huge=advise"),
    ("/dev/shm", "always within_size advise never deny [force]", True,
     "shmem_enabled is force"),
    ("/mnt/huge", "always within_size advise never [deny] force", False,
     "shmem_enabled is deny"),
    ("/var/tier", "", False, "/ is ext4, not a tmpfs"),
])
def test_the_mount_holding_the_root_decides(root: str, shmem: str, huge: bool,
                                            why: str) -> None:
    assert tier_pages(Path(root), MOUNTS, shmem) == TierPages(huge, why)


def test_no_mount_and_broken_lines_say_so() -> None:
    text = "garbage\n1 2 3\n - tmpfs\n" + _line("/other", "tmpfs", "huge=always")
    assert tier_pages(Path("/dev/shm"), text, NEVER) == \
        TierPages(False, "no mount found for /dev/shm")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.text(max_size=80),
       st.sampled_from(["/dev/shm", "/", "/mnt/huge/a", "relative/dir"]))
def test_any_mountinfo_text_gives_an_answer(text: str, shmem: str, root: str) -> None:
    got = tier_pages(Path(root), MOUNTS + "\n" + text, shmem)
    assert isinstance(got.huge, bool) and got.why


def test_this_hosts_dev_shm_is_read() -> None:
    got = read_tier_pages(Path("/dev/shm"))
    assert got.why  # whatever this host gives, it says which and why


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[None]:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options},size=64m", "none",
                           str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _pmd_mapped_kb(path: Path) -> int:
    """Kilobytes of ``path``'s mapping in this process held in 2 MiB pages."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            for field in lines[i + 1:i + 30]:
                if field.startswith("ShmemPmdMapped:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping of {path}")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize(("options", "huge"), [("huge=advise", True), ("huge=never", False)])
def test_a_ranks_slot_on_a_huge_advise_tmpfs_gets_2_mib_pages(tmp_path: Path, options: str,
                                                              huge: bool) -> None:
    root = tmp_path / "tier"
    with _tmpfs(root, options):
        assert read_tier_pages(root).huge is huge
        node = NodeMemory(root, tmp_path / "run", "n0")
        node.provision([0], world_size=1, procs_per_node=1, budget=32 << 20, partner=False)
        slots = Slots(node.path)
        buf = slots.map("own", 0, "a")
        assert buf is not None
        buf[:] = b"\x01" * len(buf)  # a save writing it: tmpfs allocates the pages now
        kb = _pmd_mapped_kb(node.path / "own-r0-a.bin")
        assert (kb >= 2048) is huge, f"{kb} kB in 2 MiB pages on a tmpfs with {options}"
        buf.close()
