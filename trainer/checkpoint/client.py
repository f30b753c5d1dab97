"""Checkpointers whose writer saves the model and optimizer itself (DeepSpeed, NxD).

Such writers take the rest of our state as one "client state", written by rank 0 only:
progress, the data position, the LR schedule's position, the skip-step guard, and the RNG
states of EVERY rank (JSON strings), gathered into a list that each rank indexes on load.
The writer pickles it (``torch.save``) and its loader unpickles it: a checkpoint reaches the
loader only after rank 0 verified its signature and digests (``Checkpointer.choose``). The
commit (manifest), verification, retention and upload stay the ``Checkpointer``'s.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from trainer.checkpoint.checkpointer import Checkpointer

RNG = "rng"  # checkpoint-state key of this rank's RngState; saved as a list over ranks


class ClientStateCheckpointer(Checkpointer):
    """``Checkpointer`` plus the client state of a writer that saves ``OWN`` keys itself."""

    OWN: tuple[str, ...] = ()  # checkpoint-state keys the writer saves itself

    def prepare_staging(self, state: dict[str, Any]) -> None:
        """Nothing to stage ahead: these writers stage (or save synchronously) themselves."""

    def _gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (a collective over the checkpoint group)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _client_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Everything but ``OWN``, with the RNG blobs of all ranks (collective)."""
        client = {key: obj.state_dict() for key, obj in state.items()
                  if key not in self.OWN and key != RNG}
        client[RNG] = [s["json"] for s in self._gather(state[RNG].state_dict())]
        return client

    def _apply_client_state(self, state: dict[str, Any], client: dict[str, Any] | None,
                            url: str) -> None:
        if client is None:
            raise RuntimeError(f"{url}: the checkpoint holds no client state")
        for key, obj in state.items():
            if key in self.OWN or key == RNG:
                continue
            if key not in client:
                raise KeyError(f"{url}: the checkpoint's client state has no {key!r}")
            obj.load_state_dict(client[key])
        rngs = client[RNG]
        if len(rngs) != self.world_size:
            raise ValueError(f"{url} holds the RNG states of {len(rngs)} ranks, this run has "
                             f"{self.world_size}: resume with the same world size")
        rng = rngs[self.rank]  # format 1 held a pickle (bytes) per rank, format 2 JSON
        state[RNG].load_state_dict({"blob": rng} if isinstance(rng, bytes) else {"json": rng})
