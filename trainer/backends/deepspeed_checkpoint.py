"""Checkpoints of a DeepSpeed run: DeepSpeed's files in our layout, committed by our manifest.

``engine.save_checkpoint(<job root>, tag="step-XXXXXXXX", save_latest=False)`` writes into
``<root>/<job>/step-XXXXXXXX/`` (stage 0-2: ``mp_rank_00_model_states.pt`` from rank 0 and,
under ZeRO, one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank; stage 3: a model
states file per rank too). Everything that is ours rides in ``client_state``: progress, the
data position, the LR schedule's position, and the RNG states of EVERY rank (gathered to a
list: at stages 0-2 only rank 0's model states file keeps a client state, and every rank
loads that one). After a barrier, rank 0 checksums the files and writes ``manifest.json``
with the same code as DCP saves (``Checkpointer``), so commit, verification, fallback past a
corrupt checkpoint, retention, the S3 uploader, ``orchestrator checkpoints verify`` and the
supervisor's ``checkpoint_committed`` events work unchanged.

DeepSpeed's writer is ``torch.save`` into a directory, so saves land in a filesystem tier:
the only tier, or ``checkpoint.local_url`` with ``url: s3://...`` uploaded in the background
by the ``Uploader`` (config validation requires one of these). The save is synchronous: its
whole duration is reported as the blocking time (``ckpt_block_s``); the checksums and the
manifest are still written off the training thread. DeepSpeed also drops its conversion
scripts (``zero_to_fp32.py``) into the job root, beside the step directories; they are not
part of any checkpoint.

A save that fails on some rank (a full disk) must not leave the others waiting: the ranks
whose writes succeeded sit in the barrier that ends ``save_checkpoint`` (deepspeed 0.19.8),
so a failing rank enters one barrier itself before all ranks exchange their outcome.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any

import torch.distributed as dist

from trainer.checkpoint import layout
from trainer.checkpoint.client import RNG, ClientStateCheckpointer
from trainer.checkpoint.save_errors import explain_failure
from trainer.checkpoint.store import Choice

ENGINE = "engine"  # checkpoint-state key of the engine (saved by DeepSpeed itself)
__all__ = ["ENGINE", "RNG", "DeepSpeedCheckpointer", "EngineState"]


class EngineState:
    """The DeepSpeed engine's place in the checkpoint state (DeepSpeed saves it itself)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine


class DeepSpeedCheckpointer(ClientStateCheckpointer):
    """``Checkpointer`` whose writer and reader are DeepSpeed's; the commit is ours."""

    OWN = (ENGINE,)

    def __init__(self, cfg: Any, store: Any, **kwargs: Any) -> None:
        super().__init__(cfg, store, **kwargs)
        if layout.is_remote(store.primary.root):
            raise ValueError(
                f"DeepSpeed writes checkpoints with torch.save into a directory, not to "
                f"{store.primary.root}: use a filesystem checkpoint.url, or checkpoint."
                f"local_url with the s3:// url uploaded in the background")
        self.root_path = layout.filesystem(store.primary.root)[1]

    @staticmethod
    def _visible(step_path: str) -> list[str]:
        """Files under the step directory this rank can see, relative to it."""
        out = []
        for base, _, files in os.walk(step_path):
            out += [os.path.relpath(os.path.join(base, f), step_path) for f in files]
        return out

    def save(self, step: int, state: dict[str, Any], tokens: int) -> float:
        """Save synchronously; returns the seconds training was blocked (all of it)."""
        t0 = time.perf_counter()
        self.wait()  # the previous save is committed (its manifest written) first
        url = self.store.primary.step_url(step)
        if self.rank == 0:
            # A save killed midway may have left files for this step: never mix them in.
            # The gather below and save_checkpoint's first barrier order this before writes.
            layout.remove(url, self.store.primary.fs)
        client = self._client_state(state)
        error = None
        try:
            state[ENGINE].engine.save_checkpoint(self.root_path, tag=layout.step_dir_name(step),
                                                 client_state=client, save_latest=False)
        except Exception as exc:  # noqa: BLE001 - reported like a failed async save
            error = explain_failure(exc, url)
            if self.group is not None:
                dist.barrier()  # the one that ends save_checkpoint on the other ranks
        outcomes = self._gather((error, self._visible(layout.filesystem(url)[1])))
        future: concurrent.futures.Future = concurrent.futures.Future()
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(outcomes) if e]
        if errors:
            future.set_exception(RuntimeError("; ".join(errors)))
        else:
            future.set_result({f for _, files in outcomes for f in files})
        return self._start(step, url, tokens, t0, future)

    def _expected_files(self, result: Any) -> set[str]:
        return set(result)  # every rank's view of the step directory, gathered by save()

    def _read(self, state: dict[str, Any], found: Choice) -> None:
        if layout.is_remote(found.url):
            raise ValueError(f"DeepSpeed reads checkpoints from a directory, not {found.url}")
        step_path = layout.filesystem(found.url)[1]
        root, tag = os.path.split(step_path.rstrip("/"))
        path, client = state[ENGINE].engine.load_checkpoint(
            root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint to load in {found.url}")
        self._apply_client_state(state, client, found.url)
