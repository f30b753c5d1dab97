"""The Neuron backend's pure parts: config translation, checkpoint files, and the clear error
on a machine without the Neuron SDK (this one: its XLA paths cannot run here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from trainer.backends import backend_for
from trainer.backends.neuron import NEURON_SDK, NeuronBackend, nxd_config_kwargs, require_neuron
from trainer.backends.neuron_checkpoint import nxd_files
from trainer.backends.neuron_tp import TPBlock
from trainer.config import TrainerConfig
from trainer.distributed import DistContext
from trainer.settings import load_settings

TRN = Path(__file__).parents[3] / "configs" / "llama2-7b-trn1-128.yaml"


def test_the_trainium_config_translates_to_nxd() -> None:
    cfg = load_settings(str(TRN)).trainer
    assert nxd_config_kwargs(cfg, block_cls=TPBlock) == {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 1,
        "optimizer_config": {"zero_one_enabled": True, "grad_clipping": True,
                             "max_grad_norm": 1.0},
        # bf16 weights with ZeRO-1: fp32 master weights, fp32 gradient accumulation.
        "mixed_precision_config": {"use_master_weights": True, "use_fp32_grad_acc": True,
                                   "use_master_weights_in_ckpt": False},
        "activation_checkpoint_config": (TPBlock,),
        "sequence_parallel": False,
    }


def test_fp32_without_zero1_asks_nxd_for_no_master_weights() -> None:
    cfg = TrainerConfig.model_validate({
        "device": "xla", "optimizer": {"grad_clip": 0.3},
        "parallelism": {"strategy": "neuron", "zero_stage": 0, "tensor_parallel": 2}})
    kwargs = nxd_config_kwargs(cfg)
    assert kwargs["optimizer_config"] == {"zero_one_enabled": False, "grad_clipping": True,
                                          "max_grad_norm": 0.3}
    # NxD raises if master weights or fp32 accumulation are asked for without ZeRO-1.
    assert not any(kwargs["mixed_precision_config"].values())
    assert kwargs["activation_checkpoint_config"] is None


def test_checkpoint_files_follow_nxd_naming() -> None:
    assert nxd_files(tp=2, dp=2, zero1=True) == {
        "user_content.pt", "done", "checkpoint",
        "model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_00.pt",
        "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt",
        "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_01_tp_rank_01_pp_rank_00.pt"}
    # Without ZeRO-1 the optimizer state is replicated over data parallel: one copy per TP rank.
    assert {f for f in nxd_files(tp=2, dp=4, zero1=False) if f.startswith("optim/")} == {
        "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt"}


def test_without_the_sdk_the_error_says_what_is_missing() -> None:
    if importlib.util.find_spec("neuronx_distributed") is not None:
        pytest.skip("the Neuron SDK is installed here")
    with pytest.raises(RuntimeError, match="needs torch-neuronx and neuronx-distributed"):
        require_neuron()
    backend = backend_for("neuron")
    assert isinstance(backend, NeuronBackend)
    dctx = DistContext(0, 0, 8, torch.device("cpu"), "xla", None)
    with pytest.raises(RuntimeError) as err:
        backend.setup(load_settings(str(TRN)), dctx)
    assert str(err.value).startswith(NEURON_SDK)
