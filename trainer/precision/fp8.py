"""FP8 training through torchao's float8 (``trainer.precision.fp8: true``).

The transformer blocks' linear layers become torchao ``Float8Linear`` (dynamic tensorwise
scaling: each matmul's inputs are cast to float8 e4m3 with a scale from their current amax,
and gradients to e5m2), before FSDP2 shards the model, as torchtitan does. Under FSDP2 the
weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``: half the bytes of bf16)
and their scales are computed for all layers in one pass after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``). The output head stays in bf16: its logits feed
the loss directly, and float8 there costs accuracy for little time.

Only devices with FP8 tensor cores run it: CUDA compute capability 8.9 or newer (Ada L4/L40S,
Hopper H100/H200, Blackwell). Anywhere else ``require_fp8`` refuses with a clear error instead
of letting torch fail deep inside a matmul (``torch._scaled_mm`` has no CPU kernel for this).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MIN_CAPABILITY = (8, 9)
# torchao's float8 matmul needs both dimensions of a weight divisible by 16.
_ALIGN = 16


class FP8Unsupported(RuntimeError):
    """The device cannot train in FP8."""


def fp8_capable(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` has FP8 tensor cores, and why not when it has none."""
    if device.type != "cuda":
        return False, (f"device {device.type} has no FP8 matmul (CUDA compute capability "
                       f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ needed: H100, H200, L40S)")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return False, (f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 needs "
                       f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (H100, H200, L40S)")
    return True, ""


def require_fp8(device: torch.device) -> None:
    """Raise ``FP8Unsupported`` unless ``device`` can train in FP8."""
    ok, why = fp8_capable(device)
    if not ok:
        raise FP8Unsupported(f"trainer.precision.fp8 is true, but {why}; set it to false")


def _in_blocks(module: nn.Module, fqn: str) -> bool:
    if not fqn.startswith("layers.") or not isinstance(module, nn.Linear):
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def convert(model: nn.Module, device: torch.device, fsdp: bool) -> int:
    """Swap the blocks' linear layers for ``Float8Linear`` (meta device is fine: call it before
    sharding); returns how many were swapped. Refuses on a device without FP8."""
    require_fp8(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    convert_to_float8_training(model, module_filter_fn=_in_blocks, config=config)
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")


def after_optimizer_step(model: nn.Module) -> Any:
    """Under FSDP2's float8 all-gather: every weight's scale in one pass (one all-reduce)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return precompute_float8_dynamic_scale_for_fsdp(model)
