"""Checkpoints of a Neuron run: NxD's files in our layout, committed by our manifest.

``neuronx_distributed.trainer.save_checkpoint(<job root>, tag="step-XXXXXXXX", model=,
optimizer=, user_content=, use_xser=True, async_save=, num_kept_ckpts=None)`` writes into
``<root>/<job>/step-XXXXXXXX/``: ``model/dp_rank_00_tp_rank_<t>_pp_rank_00.pt`` per TP rank,
``optim/dp_rank_<d>_tp_rank_<t>_pp_rank_00.pt`` per rank under ZeRO-1 (xser: each with an
``.info.pt`` and a ``.tensors/`` directory), ``user_content.pt`` (rank 0: our client state)
and NxD's ``checkpoint`` and ``done`` markers. NxD writes to a path or to ``s3://`` itself.
Retention stays ours (``num_kept_ckpts=None``).

With ``async_save``, NxD copies the tensors to the host (the blocking part) and writes them in
a background process; it learns that every rank finished only in its next collective wait,
``checkpoint.finalize_checkpoint()`` (also called by the next ``save_checkpoint``). We call it
at the next save, at the end and on close, on every rank, and rank 0 then writes the manifest:
a checkpoint commits one interval late (a crash in between resumes from the previous one).

Not run here: no Neuron SDK on this machine (see ``trainer.backends.neuron``); the file list
(``nxd_files``) is unit-tested against NxD's naming (``_get_path`` in its checkpoint module).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import torch.distributed as dist

from trainer.checkpoint import layout
from trainer.checkpoint.client import RNG, ClientStateCheckpointer
from trainer.checkpoint.store import Choice
from trainer.state import RngState

MODEL, OPTIMIZER = "model", "optimizer"  # checkpoint-state keys NxD saves itself
__all__ = ["MODEL", "OPTIMIZER", "RNG", "NeuronCheckpointer", "XlaRngState", "nxd_files"]


def nxd_files(tp: int, dp: int, zero1: bool) -> set[str]:
    """The files a complete NxD checkpoint must have (NxD's ``_get_path`` naming), relative
    to the step directory; xser's per-tensor files come on top."""
    files = {"user_content.pt", "done", "checkpoint"}
    for t in range(tp):
        files.add(f"model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")
        for d in range(dp if zero1 else 1):
            files.add(f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt")
    return files


class XlaRngState(RngState):
    """``RngState`` plus the XLA device's seed (``xm.get_rng_state`` / ``set_rng_state``),
    JSON like the rest (no pickle)."""

    def state_dict(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        states = json.loads(super().state_dict()["json"])
        states["xla"] = int(xm.get_rng_state())
        return {"json": json.dumps(states, allow_nan=False)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        super().load_state_dict(state_dict)
        if "json" in state_dict:
            xm.set_rng_state(int(json.loads(state_dict["json"])["xla"]))


class NeuronCheckpointer(ClientStateCheckpointer):
    """``Checkpointer`` whose writer and reader are neuronx-distributed's."""

    OWN = (MODEL, OPTIMIZER)

    def __init__(self, cfg: Any, store: Any, **kwargs: Any) -> None:
        super().__init__(cfg, store, **kwargs)
        from neuronx_distributed.parallel_layers import parallel_state

        self.tp = parallel_state.get_tensor_model_parallel_size()
        self.dp = parallel_state.get_data_parallel_size()
        self.root = store.primary.root
        if self.root.startswith("file://"):
            self.root = layout.filesystem(self.root)[1]

    def save(self, step: int, state: dict[str, Any], tokens: int) -> float:
        """Start NxD's save; returns the seconds training was blocked (host copy + sync)."""
        from neuronx_distributed.trainer import save_checkpoint

        t0 = time.perf_counter()
        self.wait()  # the previous save is complete everywhere and committed
        url = self.store.primary.step_url(step)
        if self.rank == 0:
            layout.remove(url, self.store.primary.fs)  # debris of a save killed midway
        if self.group is not None:
            dist.barrier(group=self.group)
        zero1 = state[OPTIMIZER].nxd_config["optimizer_config"]["zero_one_enabled"]
        save_checkpoint(self.root, layout.step_dir_name(step), model=state[MODEL],
                        optimizer=state[OPTIMIZER], user_content=self._client_state(state),
                        use_xser=True, num_kept_ckpts=None, async_save=self.cfg.async_save)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._expected = nxd_files(self.tp, self.dp, zero1)
        if not self.cfg.async_save:
            future.set_result(self._expected)  # NxD's end() waited for every rank
        return self._start(step, url, tokens, t0, future)

    def wait(self, raise_on_failures: bool = True) -> None:
        """Complete NxD's async save on every rank (a collective), then commit it."""
        p = self._pending
        if p is not None and not p.future.done():
            from neuronx_distributed.trainer.checkpoint import finalize_checkpoint

            try:
                finalize_checkpoint()
                p.future.set_result(self._expected)
            except Exception as exc:  # noqa: BLE001 - reported as a failed save by rank 0
                p.future.set_exception(exc)
        super().wait(raise_on_failures)

    def _expected_files(self, result: Any) -> set[str]:
        return set(result)

    def _read(self, state: dict[str, Any], found: Choice) -> None:
        from neuronx_distributed.trainer import load_checkpoint

        root, tag = found.url.rstrip("/").rsplit("/", 1)
        client = load_checkpoint(root, tag=tag, model=state[MODEL], optimizer=state[OPTIMIZER],
                                 scheduler=None, strict=True)
        self._apply_client_state(state, client, found.url)
