"""A Hugging Face Trainer script that knows nothing of the orchestrator: a tiny
LlamaForCausalLM built from a config (nothing downloaded) on generated tokens, DDP over
gloo, one process per rank (torchrun's environment).

Environment (all optional):
  STEPS        optimizer steps (default 40)
  STEP_S       seconds each training step sleeps, standing in for compute (default 0)
  POISON_STEP  the step whose loss is scaled by 1e4 (a gradient explosion)
  OUT          the Trainer's output_dir (default ./hf-out)
  ATTACH       "1": attach the orchestrator's hook with its one line
  FAIL_ONCE    a path: rank 0 exits 1 after its final line unless the path exists (which
               it then creates): a rank that fails on its way out, once
"""

import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Slow(Trainer):
    """The script's own Trainer subclass: a sleep standing in for compute, and a poisoned step."""

    def compute_loss(self, model, inputs, **kwargs):
        loss = super().compute_loss(model, inputs, **kwargs)
        if self.state.global_step + 1 == int(os.environ.get("POISON_STEP", "-1")):
            loss = loss * 1e4
        step_s = float(os.environ.get("STEP_S", "0"))
        if step_s:
            time.sleep(step_s)
        return loss


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ)
    model = LlamaForCausalLM(cfg)
    args = TrainingArguments(
        output_dir=os.environ.get("OUT", "hf-out"), max_steps=int(os.environ.get("STEPS", "40")),
        per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=10,
        save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    trainer = Slow(model=model, args=args, train_dataset=Tokens(4096))
    if os.environ.get("ATTACH") == "1":
        import orchestrator.worker.hooks

        orchestrator.worker.hooks.attach(trainer)
    trainer.train()
    if trainer.is_world_process_zero():
        digest = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(f"final step {trainer.state.global_step} params {digest!r}", flush=True)
        once = os.environ.get("FAIL_ONCE")
        if once and not os.path.exists(once):
            open(once, "w").close()
            raise SystemExit(1)


if __name__ == "__main__":
    main()
