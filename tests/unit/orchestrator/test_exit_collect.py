"""A rank's released process groups are freed before its interpreter's finalization
(``orchestrator.worker.exitgc``): each case runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_CASE = """
import gc, os, socket, sys, weakref
from orchestrator.worker.exitgc import collect_released_groups
gc.disable()  # only the collection under test frees the cycle
if sys.argv[1] == "no-torch":
    print(collect_released_groups(), "torch" in sys.modules)
    raise SystemExit
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.randn(2, 4)).sum().backward()  # a work issued from a backward
model.me = model  # reachable only through a cycle once the name is gone
alive = weakref.ref(model)
del model
before = collect_released_groups(), alive() is not None
dist.destroy_process_group()
after = collect_released_groups(), alive() is not None
print(before, after)
"""


def _run(case: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CASE), case],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_nothing_is_collected_without_torch_distributed() -> None:
    assert _run("no-torch") == "False False"  # and it did not import torch itself


def test_a_group_in_use_is_left_and_a_destroyed_one_is_freed() -> None:
    # While the default group lives: no collection (a destructor could wait on a peer).
    # Destroyed: the model and the group it holds are freed now, not in finalization.
    assert _run("gloo") == "(False, True) (True, False)"


def test_the_trainer_collects_after_its_main(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.worker import exitgc
    from trainer import main as trainer_main

    order: list[str] = []
    monkeypatch.setattr(trainer_main, "main", lambda: order.append("main") or 3)
    monkeypatch.setattr(exitgc, "collect_released_groups", lambda: order.append("collect"))
    assert trainer_main.cli() == 3
    assert order == ["main", "collect"]
