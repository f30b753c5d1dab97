"""Do a generation's ranks resume from the same step? Compared from what each rank's
optimizer says at its first step (the preload hook's ``optimizer_resume`` event).

Ranks of a data-parallel job resume from one checkpoint. A script that snapshots into its
working directory resumes each rank from its own copy when the ranks do not share that
directory (``job.workdir: work/{node_id}``): one rank at epoch 10, another at 0, and the job
fails later with an error that does not say why. Said once per generation, at the first
rank that disagrees."""

from __future__ import annotations

from orchestrator.worker.hook import RESUME_EVENT

__all__ = ["RESUME_EVENT", "ResumeCheck"]


class ResumeCheck:
    """Each rank's resume step in the current generation; a message at the first mismatch."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self.steps: dict[int, int] = {}
        self.said = False

    def begin(self, generation: int) -> None:
        self.generation, self.steps, self.said = generation, {}, False

    def note(self, generation: int | None, rank: int, step: int) -> str | None:
        """Take a rank's resume step; the warning, once, when the ranks disagree."""
        if generation != self.generation or step < 0:
            return None
        self.steps[rank] = step
        if self.said or len(set(self.steps.values())) < 2:
            return None
        self.said = True
        shown = ", ".join(f"rank {r} from step {s}" for r, s in sorted(self.steps.items())[:8])
        return (f"ranks resumed from different optimizer steps ({shown}): ranks that resume "
                "from different checkpoints go apart and fail later. Do they share one "
                "checkpoint? A per-node job.workdir ({node_id}) gives each node its own copy "
                "of a snapshot the script writes into its working directory")
