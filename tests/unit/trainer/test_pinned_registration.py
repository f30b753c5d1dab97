"""How a rank asks PyTorch to page-lock host memory (``trainer.distributed``)."""

from __future__ import annotations

from trainer.distributed import PINNED_BY_REGISTRATION, pin_by_registration


def test_added_to_the_settings_the_job_uses_and_never_twice() -> None:
    env: dict[str, str] = {}
    pin_by_registration(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_BY_REGISTRATION}
    pin_by_registration(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_BY_REGISTRATION}
    # The job's own settings are kept, ours appended.
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,"}
    pin_by_registration(env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == f"expandable_segments:True,{PINNED_BY_REGISTRATION}"
    # PyTorch reads PYTORCH_ALLOC_CONF first: where the job set it, ours goes there.
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    pin_by_registration(env)
    assert env == {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{PINNED_BY_REGISTRATION}"}


def test_a_job_that_says_how_to_pin_is_left_as_it_is() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
    pin_by_registration(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
