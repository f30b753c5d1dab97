"""NVML rules on recorded snapshots: healthy nodes pass, each failure kind fails by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.health import nvml

FIX = Path(__file__).parent / "fixtures" / "nvml"


def devices(name: str) -> list[dict]:
    return json.loads((FIX / name).read_text())["devices"]


@pytest.mark.parametrize("name", ["h100x8-healthy.json", "v100x8-healthy.json"])
def test_healthy_nodes_pass_every_rule(name: str) -> None:
    devs = devices(name)
    assert nvml.judge_inventory(devs, 8, None).ok
    assert nvml.judge_ecc(devs).ok
    assert nvml.judge_retirement(devs, 60).ok


def test_inventory_counts_and_names() -> None:
    out = nvml.judge_inventory(devices("h100x8-healthy.json"), 8, "H100")
    assert out.ok and out.message == "8 x NVIDIA H100 80GB HBM3" and out.details["count"] == 8
    short = nvml.judge_inventory(devices("seven-gpus.json"), 8, None)
    assert not short.ok and short.message.startswith("7 GPUs visible, the job needs 8")
    wrong = nvml.judge_inventory(devices("a100x8.json"), 8, "H100")
    assert not wrong.ok and "GPU 0 (0000:18:00.0) is a NVIDIA A100-SXM4-80GB, expected H100" \
        in wrong.message
    assert nvml.judge_inventory(devices("a100x8.json"), 8, None).ok


def test_a_lost_gpu_fails_the_inventory() -> None:
    out = nvml.judge_inventory(devices("gpu-lost.json"), 8, None)
    assert not out.ok and "GPU 6" in out.message and "GPU is lost" in out.message


def test_uncorrectable_ecc_since_boot_fails_older_ones_are_noted() -> None:
    bad = nvml.judge_ecc(devices("ecc-uncorrectable.json"))
    assert not bad.ok and bad.message == ("GPU 3 (0000:5D:00.0): 2 uncorrectable ECC error(s) "
                                          "since the driver loaded")
    old = nvml.judge_ecc(devices("ecc-old-error-only.json"))
    assert old.ok and "1 uncorrectable ECC error(s) in its lifetime" in old.message


@pytest.mark.parametrize(("name", "needle"), [
    ("row-remap-pending.json", "GPU 5 (0000:AB:00.0): row remapping pending (needs a GPU reset)"),
    ("row-remap-failure.json", "GPU 2 (0000:3A:00.0): row remapping failed"),
    ("retired-pages-pending.json", "GPU 4 (0000:9A:00.0): page retirement pending"),
    ("retired-pages-worn-out.json", "GPU 0 (0000:18:00.0): 61 retired pages (replace at 60)"),
])
def test_each_memory_retirement_failure(name: str, needle: str) -> None:
    out = nvml.judge_retirement(devices(name), 60)
    assert not out.ok and needle in out.message
    # The other devices of the same node are not blamed.
    assert len(set(re.findall(r"GPU (\d+) \(", out.message))) == 1


def test_xids_from_the_kernel_log() -> None:
    fallen = nvml.parse_xids((FIX / "dmesg-xid79.txt").read_text())
    assert fallen == [nvml.Xid("PCI:0000:ba:00", 79, "pid='<unknown>', name=<unknown>, GPU has "
                                                     "fallen off the bus.")]
    out = nvml.judge_xids(fallen)
    assert not out.ok and "PCI:0000:ba:00: XID 79 (GPU has fallen off the bus)" in out.message
    dbe = nvml.judge_xids(nvml.parse_xids((FIX / "dmesg-xid48-dbe.txt").read_text()))
    assert not dbe.ok and "XID 48 (double-bit ECC error)" in dbe.message
    assert "non-critical XIDs seen: 63" in dbe.message
    app = nvml.judge_xids(nvml.parse_xids((FIX / "dmesg-xid13-app-fault.txt").read_text()))
    assert app.ok and app.message == "no critical XID events; non-critical XIDs seen: 13, 43"
    assert nvml.judge_xids([]).ok


def test_read_nvml_without_the_library_says_why() -> None:
    snap = nvml.read_nvml()
    if snap["available"]:  # a GPU machine with nvidia-ml-py: the real snapshot's shape
        assert all("errors" in d and "index" in d for d in snap["devices"])
    else:
        assert snap["devices"] == [] and snap["reason"]
