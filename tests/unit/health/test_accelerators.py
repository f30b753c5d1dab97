"""Accelerator checks: their torch device tests on the CPU, the matmul verdict, CPU nodes."""

from __future__ import annotations

import pytest
import torch

from orchestrator.health import accelerators as acc

# Eight GPUs of one node, one running hot and throttled (TFLOP/s, bf16 8192^3).
TFLOPS = [712.4, 705.9, 698.2, 430.7, 709.1, 701.5, 707.3, 699.8]


def test_memory_test_writes_and_verifies_both_patterns() -> None:
    r = acc.memory_test("cpu", 1 << 20, chunk=1 << 16)
    assert r == {"bytes": 1 << 20, "mismatches": 0, "seconds": r["seconds"]}


def test_a_flipped_word_is_found_in_either_pattern() -> None:
    x = acc.pattern(0, 4096, 7, "cpu")
    assert acc.count_mismatches(x, 7, chunk=1000) == 0
    x[1234] ^= 1 << 17
    assert acc.count_mismatches(x, 7, chunk=1000) == 1
    x.bitwise_not_()
    assert acc.count_mismatches(x, 7, inverted=True, chunk=1000) == 1
    # Neighbouring words differ, so a shifted read (an address fault) does not pass.
    y = acc.pattern(1, 4097, 7, "cpu")
    assert acc.count_mismatches(y, 7) > 4000


def test_matmul_throughput_is_measured() -> None:
    assert acc.matmul_tflops("cpu", 128, dtype=torch.float32, seconds=0.05) > 0


def test_the_slow_gpu_is_named() -> None:
    out = acc.judge_matmul(TFLOPS, None, 0.8)
    assert not out.ok
    assert out.message == "device 3: 430.7 TFLOP/s, under 80% of the node's fastest (712.4)"
    assert acc.judge_matmul(TFLOPS[:3], None, 0.8).ok
    floor = acc.judge_matmul(TFLOPS[:3], 700.0, 0.8)
    assert not floor.ok and floor.message == "device 2: 698.2 TFLOP/s, floor 700"


@pytest.mark.parametrize("fn", [acc.check_inventory, acc.check_ecc, acc.check_memory_retirement,
                                acc.check_xid, acc.check_memory_test, acc.check_matmul])
def test_cpu_nodes_skip_accelerator_checks_with_the_reason(fn, make_ctx) -> None:
    out = fn(make_ctx(["accelerator.inventory"]))
    assert out.skipped and out.ok and out.message == "no accelerator: cluster.accelerator is cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_detection_says_why_nothing_was_found(make_ctx) -> None:
    ctx = make_ctx(["accelerator.inventory"])
    ctx.accelerator = "auto"
    kind, why = acc.detect(ctx)
    assert kind == "none" and "neuron-ls: not installed" in why and "torch.cuda" in why
    out = acc.check_inventory(ctx)
    assert out.skipped and out.message.startswith("no accelerator found (")
