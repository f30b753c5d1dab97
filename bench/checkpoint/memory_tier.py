"""Restore time: the memory tier against the durable tier, one rank, same state.

The state of a trainer model (``--preset``) and its AdamW optimizer after one step, with the
counters, schedule, data position and RNG, as ``trainer.state.checkpoint_state`` makes it:

    durable  save (DCP, committed: BLAKE3 digests, signed manifest), then restore as a
             restart does: ``choose`` (verify the manifest, every digest) + ``load`` (DCP)
    memory   save into an agent-made slot in /dev/shm (digest while writing, signed
             manifest), then restore as a restart does: ``plan`` (verify the signature and
             the digest) + ``load`` (a copy from the mapping into each live tensor)

Each restore goes into a freshly built model and optimizer, and must give back the saved
parameters bit for bit. The durable files are in the page cache (written just before), so
the difference is the format's, not the disk's (a tmpfs does not help the durable tier
either). Medians of ``--repeat`` rounds. ``load_copies_s`` is the memory load's copies
alone; the rest of a load, in both tiers, is torch's ``get_state_dict``/``set_state_dict``
(which materialise the optimizer's state with a zero-learning-rate step first).

    python bench/checkpoint/memory_tier.py --preset small --out memory-tier-cpu.json
    python bench/checkpoint/memory_tier.py --preset 1b --device cuda --out memory-tier-h100.json
    python bench/checkpoint/memory_tier.py --preset 1b --device cuda --pin-restore --out memory-tier-h100-pinned.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench.common import header, write

KEY = b"bench-key-" * 4  # both tiers sign and verify with the same key


class _Loader:
    def __init__(self) -> None:
        self.pos = {"epoch": 0, "index": 123}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.pos)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = dict(sd)


def build(preset: str, device: str, seed: int) -> tuple[dict[str, Any], torch.nn.Module]:
    from trainer.model import Transformer
    from trainer.presets import PRESETS
    from trainer.state import Progress, checkpoint_state

    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(PRESETS[preset])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    if seed == 0:  # the saved state: one real step, so Adam's moments exist
        tokens = torch.randint(0, 256, (2, 64), device=device)
        model(tokens).float().square().mean().backward()
        opt.step()
        sched.step()
    return checkpoint_state(model, opt, sched, Progress(7, 7000), _Loader(), 0), model


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values(), strict=True))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def durable_round(preset: str, device: str, root: Path) -> dict[str, float]:
    from trainer.checkpoint import signing
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.store import open_store
    from trainer.config import CheckpointConfig

    cfg = CheckpointConfig(async_save=False)

    def make() -> Checkpointer:
        store = open_store(cfg, "bench", str(root), trust=signing.Trust(KEY))
        return Checkpointer(cfg, store, rank=0, world_size=1, group=None, meta={},
                            report=lambda *a, **k: None, log=lambda m: None,
                            device_type=device)

    state, model = build(preset, device, 0)
    ck = make()
    sync(device)
    t0 = time.perf_counter()
    blocking_s = ck.save(7, state, 7000)
    ck.wait()
    save_s = time.perf_counter() - t0
    ck.close()
    fresh, fresh_model = build(preset, device, 1)
    ck = make()
    sync(device)
    t0 = time.perf_counter()
    choice = ck.choose()
    t1 = time.perf_counter()
    ck.load(fresh, choice)
    sync(device)
    t2 = time.perf_counter()
    assert same(model, fresh_model), "the durable restore is not bit-exact"
    ck.close()
    return {"save_s": save_s, "save_blocking_s": blocking_s, "verify_s": t1 - t0,
            "load_s": t2 - t1, "restore_s": t2 - t0}


def memory_round(preset: str, device: str, run: Path, shm: Path,
                 pin_restore: bool) -> dict[str, float]:
    from orchestrator.agent.memory import NodeMemory
    from trainer.checkpoint import signing
    from trainer.checkpoint.memory import MemoryTier

    node = NodeMemory(shm, run, "bench")
    node.provision([0], 1, 1, 64 * 2**30, partner=False)
    trust = signing.Trust(KEY)

    def make() -> MemoryTier:
        return MemoryTier(node.path, rank=0, world_size=1, procs_per_node=1, job="bench",
                          config_hash=None, generation=1, partner=False, group=None,
                          trust=lambda: trust, log=lambda m: None, device_type=device,
                          pin_restore=pin_restore)

    try:
        state, model = build(preset, device, 0)
        tier = make()
        t0 = time.perf_counter()
        tier.prepare_saves(state)  # slots faulted in (and page-locked) after start-up
        tier.wait()
        pin_s = time.perf_counter() - t0
        sync(device)
        t0 = time.perf_counter()
        blocking_s = tier.save(7, 7000, state)
        tier.wait()
        save_s = time.perf_counter() - t0
        tier.close()
        fresh, fresh_model = build(preset, device, 1)
        tier = make()
        sync(device)
        t0 = time.perf_counter()
        plan = tier.plan(durable_step=None, max_step=None)
        t1 = time.perf_counter()
        assert plan.use, plan.reason
        tier.load(plan, fresh)
        sync(device)
        t2 = time.perf_counter()
        assert same(model, fresh_model), "the memory restore is not bit-exact"
        nbytes = tier.last_bytes or plan.manifest.data_bytes
        copy_s = tier.last_copy_s
        del plan
        tier.close()
    finally:
        node.free()
    return {"save_s": save_s, "save_blocking_s": blocking_s, "verify_s": t1 - t0,
            "load_s": t2 - t1, "load_copies_s": copy_s, "restore_s": t2 - t0,
            "pin_slots_s": pin_s, "bytes": nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shm", default="/dev/shm", help="where the memory tier's slots go")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (configs/local.yaml's trainer.num_threads: 1)")
    ap.add_argument("--pin-restore", action="store_true",
                    help="page-lock the slot for the restore's host-to-device copies (CUDA)")
    ap.add_argument("--out", default=None, help="file name under bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds: dict[str, list[dict[str, float]]] = {"durable": [], "memory": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            rounds["durable"].append(durable_round(args.preset, args.device,
                                                   Path(tmp) / f"ck{i}"))
            rounds["memory"].append(memory_round(args.preset, args.device,
                                                 Path(tmp) / f"run{i}", Path(args.shm),
                                                 args.pin_restore))
    med = {tier: {k: round(statistics.median(r[k] for r in rs), 6) for k in rs[0]}
           for tier, rs in rounds.items()}
    device = None
    if args.device == "cuda":
        device = f"cuda: {torch.cuda.get_device_name(0)}"
    report = {**header(device), "preset": args.preset, "repeat": args.repeat,
              "threads": args.threads,
              "pin_restore": args.pin_restore,
              "state_bytes": med["memory"]["bytes"], "median": med,
              "speedup_restore": round(med["durable"]["restore_s"] /
                                       med["memory"]["restore_s"], 2),
              "rounds": rounds}
    print(f"{args.preset} on {args.device}: state {med['memory']['bytes'] / 2**20:.1f} MiB; "
          f"restore durable {med['durable']['restore_s'] * 1000:.1f} ms "
          f"(verify {med['durable']['verify_s'] * 1000:.1f} + load "
          f"{med['durable']['load_s'] * 1000:.1f}), memory "
          f"{med['memory']['restore_s'] * 1000:.1f} ms (verify "
          f"{med['memory']['verify_s'] * 1000:.1f} + load "
          f"{med['memory']['load_s'] * 1000:.1f}, of which copies "
          f"{med['memory']['load_copies_s'] * 1000:.1f}): {report['speedup_restore']}x")
    if args.out:
        print(write(args.out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
