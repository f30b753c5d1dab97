"""neuron-ls, compile-cache and nccom-test rules on recorded outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.health import neuron

FIX = Path(__file__).parent / "fixtures" / "neuron"


def load(name: str) -> tuple[list[dict], str | None]:
    return neuron.parse_neuron_ls((FIX / name).read_text())


def test_the_captured_trn1_2xlarge_output() -> None:
    devices, instance = load("trn1.2xlarge.json")
    assert instance is None and len(devices) == 1 and neuron.cores_of(devices[0]) == 2
    assert neuron.judge_neuron_inventory(devices, instance, 2, None).ok
    short = neuron.judge_neuron_inventory(devices, instance, 32, None)
    assert not short.ok and short.message == ("2 NeuronCores on 1 devices, the job needs 32")


def test_trn1_32xlarge_list_and_object_forms_agree() -> None:
    listed, none = load("trn1.32xlarge.json")
    wrapped, instance = load("trn1.32xlarge-object.json")
    assert listed == wrapped and none is None and instance == "trn1.32xlarge"
    out = neuron.judge_neuron_inventory(wrapped, instance, 32, "trn1")
    assert out.ok and out.message == "16 Neuron devices, 32 NeuronCores (trn1.32xlarge)"
    wrong = neuron.judge_neuron_inventory(wrapped, instance, 32, "trn2")
    assert not wrong.ok and "instance type trn1.32xlarge, expected trn2" in wrong.message


def test_a_missing_device_and_a_busy_device_fail() -> None:
    missing = neuron.judge_neuron_inventory(*load("trn1.32xlarge-device-missing.json"), 32, None)
    assert not missing.ok and missing.message == "30 NeuronCores on 15 devices, the job needs 32"
    busy = neuron.judge_neuron_inventory(*load("trn1.32xlarge-busy.json"), 32, None)
    assert not busy.ok
    assert busy.message == "device 7 is held by pid 31544 (python3 train.py --tp 32)"


@pytest.mark.parametrize("text", [(FIX / "neuron-ls-no-driver.txt").read_text(), "[{\"x\": 1}]",
                                  "{}"])
def test_output_that_is_not_a_device_list_is_an_error(text: str) -> None:
    with pytest.raises(neuron.NeuronLsError):
        neuron.parse_neuron_ls(text)


def test_compile_cache_on_fsx_warns_on_a_local_disk_passes() -> None:
    mounts = (FIX / "mounts-fsx.txt").read_text()
    assert neuron.mount_of("/fsx/neuron-cache/x", mounts) == ("/fsx", "lustre")
    assert neuron.mount_of("/mnt/my data/c", mounts) == ("/mnt/my data", "ext4")
    assert neuron.mount_of("/var/tmp/neuron-compile-cache", mounts) == ("/", "xfs")
    shared = neuron.judge_compile_cache("/fsx/neuron-cache", mounts)
    assert not shared.ok and "on lustre (/fsx)" in shared.message
    efs = neuron.judge_compile_cache("/mnt/efs/cache", mounts)
    assert not efs.ok and "nfs4" in efs.message
    local = neuron.judge_compile_cache("/scratch/neuron-cache", mounts)
    assert local.ok and local.details["fstype"] == "ext4"
    assert neuron.judge_compile_cache("s3://bucket/cache", mounts).ok


def test_where_the_compile_cache_is() -> None:
    assert neuron.compile_cache_location({}) == neuron.DEFAULT_CACHE
    assert neuron.compile_cache_location({"NEURON_CC_FLAGS": "--model-type=transformer "
                                          "--cache_dir=/fsx/cache -O1"}) == "/fsx/cache"
    assert neuron.compile_cache_location({"NEURON_COMPILE_CACHE_URL": "/scratch/c",
                                          "NEURON_CC_FLAGS": "--cache_dir=/fsx"}) == "/scratch/c"


def test_nccom_test_outputs() -> None:
    ok = neuron.judge_nccom(0, (FIX / "nccom-allr-ok.txt").read_text(), 30.0)
    assert ok.ok and ok.details["busbw_gbps"] == pytest.approx(40.6901)
    parsed = neuron.parse_nccom((FIX / "nccom-allr-ok.txt").read_text())
    assert parsed["rows"] == [{"size_b": 33554432, "count": 33554432, "type": "uint8",
                               "time_us": 768.0, "algbw_gbps": 40.69, "busbw_gbps": 40.69}]
    slow = neuron.judge_nccom(0, (FIX / "nccom-allr-slow.txt").read_text(), 30.0)
    assert not slow.ok and slow.message == "all-reduce bus bandwidth 8.8 GB/s, floor 30 GB/s"
    assert neuron.judge_nccom(0, (FIX / "nccom-allr-slow.txt").read_text(), None).ok
    err = neuron.judge_nccom(1, (FIX / "nccom-allr-error.txt").read_text(), None)
    assert not err.ok and "NeuronCore(s) not available" in err.message
