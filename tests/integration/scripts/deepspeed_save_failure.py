"""Two DeepSpeed ranks where rank 1's first save hits a full disk: both ranks must come out of
the save, rank 0 must report the failure and remove the partial step directory, and the next
save must commit. Prints one JSON line per rank. Run under torchrun (2 ranks, gloo)."""

import errno
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    import deepspeed

    from trainer.backends.deepspeed import deepspeed_config
    from trainer.backends.deepspeed_checkpoint import (
        ENGINE,
        RNG,
        DeepSpeedCheckpointer,
        EngineState,
    )
    from trainer.checkpoint import layout
    from trainer.checkpoint.store import open_store
    from trainer.config import CheckpointConfig, TrainerConfig
    from trainer.model import build_model
    from trainer.optim import build_optimizer
    from trainer.presets import PRESETS
    from trainer.state import Progress, RngState

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    cfg = TrainerConfig.model_validate({"data": {"micro_batch_size": 2},
                                        "parallelism": {"strategy": "deepspeed",
                                                        "zero_stage": 2}})
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"])
    engine, *_ = deepspeed.initialize(model=model,
                                      optimizer=build_optimizer(model, cfg.optimizer, "cpu"),
                                      config=deepspeed_config(cfg), dist_init_required=False)
    tokens = torch.randint(0, 264, (2, 16))
    engine.backward(engine(tokens).logsumexp(-1).mean())
    engine.step()

    events = []
    ckpt_cfg = CheckpointConfig(max_save_failures=3)
    store = open_store(ckpt_cfg, "job", os.environ["CKPT_ROOT"])
    checkpointer = DeepSpeedCheckpointer(
        ckpt_cfg, store, rank=rank, world_size=2, group=group,
        meta={"state_layout": {}, "writer": "deepspeed"},
        report=lambda name, **kw: events.append({"event": name, **kw}), log=lambda m: None)
    state = {ENGINE: EngineState(engine), "progress": Progress(step=1), RNG: RngState()}

    real_save = engine.checkpoint_engine.save
    full = {"left": 1 if rank == 1 else 0}

    def save(state_dict, path):  # rank 1's first write finds the disk full
        if full["left"]:
            full["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_save(state_dict, path)

    engine.checkpoint_engine.save = save
    checkpointer.save(1, state, tokens=64)
    checkpointer.wait()
    first_dir_exists = os.path.exists(layout.step_url(store.primary.root, 1))
    checkpointer.save(2, state, tokens=128)
    checkpointer.finish()
    check = layout.verify(store.primary.step_url(2))
    checkpointer.close()
    print(json.dumps({"rank": rank, "events": events, "first_dir_exists": first_dir_exists,
                      "second_ok": check.ok, "failures": checkpointer.failures_in_a_row}),
          flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
