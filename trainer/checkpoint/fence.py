"""The generation as a fencing token on checkpoints: what a deposed generation writes is never read.

A node cut off from the supervisor may keep running its ranks for a while (until its agent's
lease runs out): they may commit a checkpoint, or upload one, after the supervisor has
launched the next generation from an older step (split brain). Every generation number is a
fencing token, checked on both sides:

Readers (``Fence.admits``). The supervisor hands each generation its *lineage*: the run's id
and, for every generation launched so far, the step it resumed from (``ORCH_LINEAGE``).
Generations are numbered per run (``up --resume`` and a standby supervisor continue a run;
a new run starts again at 1): a checkpoint of another run carries no token this run can
compare, and is judged as before (by its signature and digests only). A checkpoint
written by generation ``g`` at step ``s`` is admitted by generation ``G`` only when no
generation launched after ``g`` (up to ``G``) resumed from a step below ``s``: anything newer
than such a resume point was written after the supervisor chose it, by a generation it had
already given up on, or was never seen by it. A checkpoint from a generation newer than the
reader's own means the reader is the deposed one: refused too. A manifest without a
generation (a run outside the orchestrator, an older version) and a reader without a
lineage (plain torchrun) admit everything: there is no token to check.

Writers (``Claim``). The first rank 0 of a generation writes ``fence.json`` (its generation
and resume step) into each tier's job root once it has chosen its checkpoint. A rank 0 about
to commit a save, and an uploader about to commit a remote copy, read it first and refuse
when a newer generation has claimed the root: the write that a reader would refuse is not
made at all. (Reader and writer checks together: the writer's check is a read then a write,
so a write can still slip between them; the reader's check catches that one.)

No torch here: the agent, the CLI and the supervisor use it too.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec

FENCE_FILE = "fence.json"
_MAX_FENCE_BYTES = 4096


class Fenced(RuntimeError):
    """A write refused: a newer generation has claimed the checkpoint root."""


_RUN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # as contracts.env.get_lineage checks it


@dataclass(frozen=True)
class Fence:
    """The reader's run, generation and lineage (see the module; a rank's come from
    ``ORCH_GENERATION`` and ``ORCH_LINEAGE``). ``generation`` None: no token (a rank outside
    the orchestrator)."""

    generation: int | None = None
    # (generation, the step it resumed from; -1 for a fresh start), in launch order.
    lineage: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    run: str | None = None

    def floor(self, writer: int) -> float:
        """The newest step a checkpoint of generation ``writer`` may hold to be admitted."""
        later = [resume for gen, resume in self.lineage
                 if writer < gen and (self.generation is None or gen <= self.generation)]
        return min(later, default=float("inf"))

    def refusal(self, manifest: Mapping[str, Any] | None) -> str | None:
        """Why this reader may not use a checkpoint with ``manifest``; None: admitted."""
        if self.generation is None or self.run is None or not manifest:
            return None
        writer, step = manifest.get("generation"), manifest.get("step")
        if manifest.get("run") != self.run or not isinstance(writer, int) \
                or isinstance(writer, bool) or not isinstance(step, int):
            return None  # no token to compare: another run (or no orchestrator) wrote it
        return self.refusal_of(writer, step)

    def refusal_of(self, writer: int, step: int) -> str | None:
        if self.generation is not None and writer > self.generation:
            return (f"fenced: written by generation {writer}, newer than this reader's "
                    f"generation {self.generation} (this reader is deposed)")
        floor = self.floor(writer)
        if step > floor:
            resumed = next(g for g, r in self.lineage if writer < g and r == floor)
            return (f"fenced: written by generation {writer} at step {step}, after generation "
                    f"{resumed} resumed from step {int(floor)}: a deposed generation's write")
        return None

    def admits(self, manifest: Mapping[str, Any] | None) -> bool:
        return self.refusal(manifest) is None


@dataclass(frozen=True)
class Claim:
    """What ``fence.json`` in a tier's job root says: the newest generation of a run that
    started."""

    run: str
    generation: int
    resume_step: int

    def to_json(self) -> bytes:
        return json.dumps({"run": self.run, "generation": self.generation,
                           "resume_step": self.resume_step}).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Claim | None:
        if len(raw) > _MAX_FENCE_BYTES:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        run, gen, step = data.get("run"), data.get("generation"), data.get("resume_step")
        if not (isinstance(run, str) and _RUN.match(run) and isinstance(gen, int)
                and isinstance(step, int)) or isinstance(gen, bool) or isinstance(step, bool) \
                or gen < 0 or step < -1:
            return None
        return cls(run, gen, step)


def _path(fs: fsspec.AbstractFileSystem, job_root: str) -> str:
    from trainer.checkpoint import layout

    return posixpath.join(layout.filesystem(job_root, fs)[1], FENCE_FILE)


def read_claim(fs: fsspec.AbstractFileSystem, job_root: str) -> Claim | None:
    """The root's claim (None: none, or one that does not parse: a reader never trusts a
    malformed claim to fence anything)."""
    try:
        with fs.open(_path(fs, job_root), "rb") as f:
            return Claim.parse(f.read(_MAX_FENCE_BYTES + 1))
    except FileNotFoundError:
        return None


def claim(fs: fsspec.AbstractFileSystem, job_root: str, fence: Fence,
          resume_step: int | None) -> bool:
    """Claim the root for ``fence``'s generation unless a newer one of the same run has
    (then False; another run's claim is replaced). One small whole-object write: an object
    store commits it at once, a filesystem by rename."""
    if fence.generation is None or fence.run is None:
        return False
    current = read_claim(fs, job_root)
    if current is not None and current.run == fence.run \
            and current.generation >= fence.generation:
        return current.generation == fence.generation
    data = Claim(fence.run, fence.generation,
                 -1 if resume_step is None else resume_step).to_json()
    path = _path(fs, job_root)
    from trainer.checkpoint import layout

    if layout.is_local(fs):
        import os

        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)
    return True


def check_claim(fs: fsspec.AbstractFileSystem, job_root: str, fence: Fence) -> None:
    """Raise ``Fenced`` when a generation of the same run newer than ``fence``'s has
    claimed the root."""
    if fence.generation is None or fence.run is None:
        return
    current = read_claim(fs, job_root)
    if current is not None and current.run == fence.run \
            and current.generation > fence.generation:
        raise Fenced(f"generation {current.generation} has claimed {job_root} (resuming from "
                     f"step {current.resume_step}); this is generation {fence.generation}: "
                     "deposed, it writes no more checkpoints")
