"""A survivor's restore waits for its old groups' abort to end (NCCL frees the old
communicator's buffers at the end of its abort, and those frees and the restore's copies
slowed each other on 2 x H200), unless ``trainer.parallelism.restore_during_abort``; an
abort that never ends makes the in-place recovery give up (the full restart follows)."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from trainer import pgabort
from trainer.rejoin import Rejoin, RejoinFailed


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        pgabort.wait_aborts(10.0)
        if dist.is_initialized():
            pgabort.leave_groups(overlap=False)


def _rejoin(during: bool) -> Rejoin:
    par = SimpleNamespace(restore_during_abort=during, overlap_abort=True)
    return Rejoin(settings=SimpleNamespace(trainer=SimpleNamespace(parallelism=par)),
                  backend=None, checkpointer=None, stepper=None, wait_s=1.0, log=print)


def test_the_restore_waits_for_the_abort_to_end(one_rank_group) -> None:
    at = pgabort.epoch()
    pgabort.abort_groups(slow_s=0.5, wait=False)  # the default group's abort: 0.5 s
    assert pgabort.aborting()
    rejoin = _rejoin(during=False)
    rejoin._abort_done()
    assert not pgabort.aborting()
    end = pgabort.record(at)["abort_end"]
    assert rejoin._at["abort_waited"] >= end


def test_restore_during_abort_does_not_wait(one_rank_group) -> None:
    pgabort.abort_groups(slow_s=1.0, wait=False)
    rejoin = _rejoin(during=True)
    rejoin._abort_done()
    assert pgabort.aborting()  # still aborting: the restore would begin beside it
    assert "abort_waited" not in rejoin._at


def test_an_abort_that_does_not_end_fails_the_rejoin(one_rank_group,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgabort, "WAIT_S", 0.1)
    pgabort.abort_groups(slow_s=2.0, wait=False)
    with pytest.raises(RejoinFailed, match="did not end within"):
        _rejoin(during=False)._abort_done()
