"""A Lightning script that knows nothing of the orchestrator: a tiny bigram language model
on generated tokens, DDP over gloo, one process per rank (torchrun's environment).

Environment (all optional):
  STEPS        optimizer steps (default 40)
  STEP_S       seconds each training step sleeps, standing in for compute (default 0)
  POISON_STEP  the step whose loss is scaled by 1e4 (a gradient explosion)
  VAL_EVERY    validation every N steps (default 0: none)
  ATTACH       "1": attach the orchestrator's hook with its one line (else the preload
               hook attaches it, or nothing does)
"""

import os
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 64, 16


class Bigram(pl.LightningModule):
    def __init__(self, step_s: float, poison_step: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.out = torch.nn.Linear(32, VOCAB)
        self.step_s, self.poison_step = step_s, poison_step

    def training_step(self, batch, batch_idx):
        (x,) = batch
        logits = self.out(self.emb(x[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        if self.global_step + 1 == self.poison_step:
            loss = loss * 1e4
        if self.step_s:
            time.sleep(self.step_s)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        logits = self.out(self.emb(x[:, :-1]))
        self.log("val_loss", torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    steps = int(os.environ.get("STEPS", "40"))
    val_every = int(os.environ.get("VAL_EVERY", "0"))
    pl.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (4096, SEQ), generator=g))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=local, num_nodes=world // local,
        strategy="ddp" if world > 1 else "auto", max_steps=steps,
        val_check_interval=val_every or None, check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=4 if val_every else 0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True)
    if os.environ.get("ATTACH") == "1":
        import orchestrator.worker.hooks

        orchestrator.worker.hooks.attach(trainer)
    model = Bigram(float(os.environ.get("STEP_S", "0")), int(os.environ.get("POISON_STEP", "-1")))
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True),
                DataLoader(data, batch_size=8) if val_every else None)
    if trainer.global_rank == 0:
        digest = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(f"final step {trainer.global_step} params {digest!r}", flush=True)


if __name__ == "__main__":
    main()
