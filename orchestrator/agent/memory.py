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
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

SLOTS = ("a", "b")


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
