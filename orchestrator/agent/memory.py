"""The node's memory tier, owned by the agent: a directory of slot files in shared memory.

The agent creates the directory when it first runs ranks with the memory tier on, sizes a
slot file for each slot its ranks may write (``trainer.checkpoint.memory_format`` names
them), and removes it all when it exits. Ranks only map the files the agent made: what the
tier holds on a node is bounded by ``checkpoint.memory_max_bytes`` whatever a rank does.
The files outlive the ranks (a restarted rank restores from them), not the agent: a new
agent, on this host or a replacement, starts empty, and its ranks restore from their
partner's copy or from the durable tier.

Slot files are sparse (``ftruncate``): tmpfs gives them pages only as a save writes them,
so the budget is what a node may use, not what it uses; ``usage`` reports the latter.

Ranks page-lock the slots they copy through (``cudaHostRegister``). On 4 KiB pages that is
slow both ways, measured on an H200 host with 14 GB locked (``bench/results/
alloc-after-death-h200-1gpu.json``): 5.0-5.4 s to lock, and 1.8-2.4 s for a killed rank's
process to be released, against 2.0-2.1 s and 0.31-0.32 s on a tmpfs mounted with
``huge=always``. :func:`tier_pages` says which pages a root gives, so the agent can tell.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

SLOTS = ("a", "b")
# tmpfs ``huge=`` values that give the slots 2 MiB pages (``advise``: ranks madvise their
# mappings, ``trainer.checkpoint.memory_slots``).
_HUGE_MOUNT = ("always", "within_size", "advise")
_MAX_MOUNTINFO = 1 << 22


@dataclass(frozen=True)
class TierPages:
    """Which pages a memory-tier root gives its slot files, and why."""

    huge: bool
    why: str


def _unescape(field: str) -> str:
    """A mountinfo path field (octal escapes: ``\\040`` for a space)."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and set(code) <= set("01234567"):
            out.append(chr(int(code, 8)))
            i += 4
            continue
        out.append(field[i])
        i += 1
    return "".join(out)


def tier_pages(root: Path, mountinfo: str, shmem_enabled: str) -> TierPages:
    """Which pages files under ``root`` get: the mount holding it (the longest mount point
    in ``mountinfo``, ``/proc/self/mountinfo``'s text), its file system and ``huge=``
    option, and the kernel's ``shmem_enabled`` (whose ``force`` and ``deny`` override every
    tmpfs mount). Lines that do not parse are skipped."""
    path = os.path.realpath(str(root))
    best: tuple[str, str, str] | None = None  # mount point, fs type, super options
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        point = os.path.normpath(_unescape(fields[4]))
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, rest[0], rest[2] if len(rest) > 2 else "")
    mode = next((w.strip("[]") for w in shmem_enabled.split() if w.startswith("[")), "")
    if best is None:
        return TierPages(False, f"no mount found for {path}")
    point, fstype, options = best
    if fstype != "tmpfs":
        return TierPages(False, f"{point} is {fstype[:40]}, not a tmpfs")
    if mode == "deny":
        return TierPages(False, "shmem_enabled is deny")
    if mode == "force":
        return TierPages(True, "shmem_enabled is force")
    huge = next((o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")),
                "never")
    if huge in _HUGE_MOUNT:
        return TierPages(True, f"tmpfs {point} huge={huge}")
    return TierPages(False, f"tmpfs {point} huge={huge[:20]}: 4 KiB pages")


def read_tier_pages(root: Path) -> TierPages:
    """:func:`tier_pages` for ``root`` on this host."""
    texts = []
    for name in ("/proc/self/mountinfo", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        try:
            with open(name, encoding="utf-8", errors="replace") as f:
                texts.append(f.read(_MAX_MOUNTINFO))
        except OSError:
            texts.append("")
    return tier_pages(root, texts[0], texts[1])


def node_dir(root: Path, run_dir: Path, node_id: str) -> Path:
    """``<root>/orch-mem-<hash of the run dir>-<node id>``: unique per job and node, so
    jobs (and the simulated nodes of one host) never share a slot."""
    tag = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return root / f"orch-mem-{tag}-{node_id}"


class NodeMemory:
    """Create, size, measure and free this node's slot files (see the module)."""

    def __init__(self, root: Path, run_dir: Path, node_id: str) -> None:
        self.path = node_dir(root, run_dir, node_id)
        self.budget = 0
        self._fresh = False  # this agent removed what a previous agent left

    def provision(self, ranks: list[int], world_size: int, procs_per_node: int,
                  budget: int, partner: bool) -> int:
        """Slot files for ``ranks`` (global ranks of this node) and the partners they hold,
        each ``budget`` / (slots per node); returns the size of one slot."""
        if not self._fresh:
            # A previous agent's memory (this one restarted) is not ours to vouch for.
            shutil.rmtree(self.path, ignore_errors=True)
            self._fresh = True
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        nodes = world_size // procs_per_node if procs_per_node > 0 else 1
        partnered = partner and nodes > 1
        kinds = ("own", "partner") if partnered else ("own",)
        slot_bytes = budget // max(1, len(ranks) * len(kinds) * len(SLOTS))
        slot_bytes -= slot_bytes % 4096
        wanted: set[str] = set()
        for rank in ranks:
            for kind in kinds:
                owner = rank if kind == "own" else (rank - procs_per_node) % world_size
                for slot in SLOTS:
                    wanted.add(f"{kind}-r{owner}-{slot}.bin")
        for entry in os.scandir(self.path):  # slots of ranks this node no longer runs
            if entry.name.endswith(".bin") and entry.name not in wanted:
                os.unlink(entry.path)
                Path(entry.path[:-4] + ".json").unlink(missing_ok=True)
        for name in sorted(wanted):
            path = self.path / name
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if os.fstat(fd).st_size != slot_bytes:
                    # A new size invalidates what the slot held: its manifest goes first.
                    (self.path / (name[:-4] + ".json")).unlink(missing_ok=True)
                    os.ftruncate(fd, slot_bytes)
            finally:
                os.close(fd)
        self.budget = slot_bytes * len(wanted)
        return slot_bytes

    def forget(self) -> list[str]:
        """Uncommit every copy (its manifest goes; the bytes stay, unread): the next ranks
        are not the ones that follow on from the generation that wrote them
        (``lease.SupervisorLease.memory_continues``). Returns the manifests removed."""
        removed = []
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return removed
        for entry in entries:
            if entry.name.endswith(".json"):
                Path(entry.path).unlink(missing_ok=True)
                removed.append(entry.name)
        return removed

    def usage(self) -> int:
        """Bytes the slot files hold now (allocated pages, not their sparse size)."""
        total = 0
        try:
            for entry in os.scandir(self.path):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            return 0
        return total

    def free(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
