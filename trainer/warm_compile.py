"""What a warm spare imports ahead of a restart when the job compiles (``trainer.parallelism.
compile``): TorchDynamo and Inductor, which ``Module.compile`` and the first compiled step
import otherwise. On 2 x H200 a restarted rank spent 4.8-5.7 s between choosing its
checkpoint and wrapping its model for compile (the model itself is built on the meta device
in well under a second), every restart; a spare pays it while the job trains.

Importing these initialises no accelerator: a spare stays a plain interpreter until it is
handed a rank.
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
