"""AWS Trainium / Inferentia: ``neuron-ls``, the compile cache's filesystem, ``nccom-test``.

Parsers work on text so they are tested against recorded outputs
(``tests/unit/health/fixtures/neuron``); the check functions only add the subprocess calls.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from orchestrator.contracts.rundir import is_remote
from orchestrator.health.base import Outcome, failed, passed, skipped
from orchestrator.health.context import NodeContext

# Filesystems shared between hosts: a compile cache there is read and locked over the network
# by every rank (the Trainium study's cache on FSx for Lustre caused collective timeouts).
SHARED_FS_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "glusterfs", "fuse.glusterfs", "ceph",
    "fuse.ceph", "gpfs", "beegfs", "wekafs", "panfs", "fuse.s3fs", "fuse.mountpoint-s3",
    "fuse.gcsfuse", "fuse.juicefs", "fuse.sshfs",
})
DEFAULT_CACHE = "/var/tmp/neuron-compile-cache"


class NeuronLsError(RuntimeError):
    """neuron-ls failed or printed something that is not its JSON."""


def run_neuron_ls(timeout: float = 30.0) -> str:
    """The stdout of ``neuron-ls --json-output`` (NeuronLsError names what went wrong)."""
    exe = shutil.which("neuron-ls") or ("/opt/aws/neuron/bin/neuron-ls"
                                        if Path("/opt/aws/neuron/bin/neuron-ls").exists()
                                        else None)
    if exe is None:
        raise NeuronLsError("neuron-ls is not installed")
    proc = subprocess.run([exe, "--json-output"], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise NeuronLsError(f"neuron-ls exited {proc.returncode}: "
                            f"{(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def parse_neuron_ls(text: str) -> tuple[list[dict[str, Any]], str | None]:
    """(devices, instance type or None) from neuron-ls JSON: a list of devices (Neuron SDK
    2.x), or an object with ``neuron_devices`` and ``instance_type`` (newer tools)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NeuronLsError(f"neuron-ls printed no JSON: {exc}") from None
    instance = None
    if isinstance(data, dict):
        instance = data.get("instance_type") or data.get("instance-type")
        data = data.get("neuron_devices")
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise NeuronLsError("neuron-ls JSON is not a list of devices")
    for d in data:
        if "neuron_device" not in d or "nc_count" not in d:
            raise NeuronLsError(f"a device entry lacks neuron_device/nc_count: {d}")
    return data, instance


def cores_of(device: dict[str, Any]) -> int:
    ids = device.get("neuroncore_ids")
    return len(ids) if isinstance(ids, list) and ids else int(device["nc_count"])


def judge_neuron_inventory(devices: list[dict[str, Any]], instance: str | None,
                           expected_cores: int, expect_name: str | None) -> Outcome:
    """Enough NeuronCores for the node's ranks, none held by another process."""
    cores = sum(cores_of(d) for d in devices)
    problems = []
    if cores < expected_cores:
        problems.append(f"{cores} NeuronCores on {len(devices)} devices, the job needs "
                        f"{expected_cores}")
    for d in devices:
        for p in d.get("neuron_processes") or []:
            problems.append(f"device {d['neuron_device']} is held by pid {p.get('pid')} "
                            f"({str(p.get('command', '?'))[:60]})")
    if expect_name and instance and expect_name.lower() not in instance.lower():
        problems.append(f"instance type {instance}, expected {expect_name}")
    details = {"devices": len(devices), "cores": cores, "instance_type": instance}
    if problems:
        return failed("; ".join(problems), **details)
    return passed(f"{len(devices)} Neuron devices, {cores} NeuronCores"
                  + (f" ({instance})" if instance else ""), **details)


def neuron_inventory(ctx: NodeContext) -> Outcome:
    try:
        devices, instance = parse_neuron_ls(run_neuron_ls())
    except (NeuronLsError, subprocess.TimeoutExpired) as exc:
        return failed(str(exc))
    return judge_neuron_inventory(devices, instance, ctx.devices, ctx.expect_device_name)


# -- compile cache ---------------------------------------------------------------------------
def compile_cache_location(env: dict[str, str]) -> str:
    """Where neuronx-cc caches: NEURON_COMPILE_CACHE_URL, a --cache_dir in NEURON_CC_FLAGS,
    else the SDK's default."""
    if env.get("NEURON_COMPILE_CACHE_URL"):
        return env["NEURON_COMPILE_CACHE_URL"]
    m = re.search(r"--cache_dir[= ](\S+)", env.get("NEURON_CC_FLAGS", ""))
    return m.group(1) if m else DEFAULT_CACHE


def mount_of(path: str, mounts: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``path``, from /proc/mounts text."""
    best = ("/", "unknown")
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/") or point == "/"
        if inside and len(point) >= len(best[0]):
            best = (point, parts[2])
    return best


def judge_compile_cache(location: str, mounts: str) -> Outcome:
    if is_remote(location):
        return passed(f"compile cache at {location} (remote object store)", location=location)
    path = os.path.realpath(location.removeprefix("file://"))
    point, fstype = mount_of(path, mounts)
    details = {"location": location, "mount": point, "fstype": fstype}
    if fstype in SHARED_FS_TYPES:
        return failed(f"compile cache {location} is on {fstype} ({point}), a shared "
                      "filesystem: every rank reads and locks it over the network (the "
                      "Trainium study's cache on FSx caused timeouts); use a local disk",
                      **details)
    return passed(f"compile cache {location} on {fstype} ({point})", **details)


def _neuron_node(ctx: NodeContext) -> bool:
    return ctx.accelerator == "neuron" or (ctx.accelerator == "auto"
                                           and shutil.which("neuron-ls") is not None)


def check_compile_cache(ctx: NodeContext) -> Outcome:
    if not _neuron_node(ctx):
        return skipped("not a Neuron node")
    location = compile_cache_location({**os.environ, **ctx.job_env})
    return judge_compile_cache(location, Path("/proc/mounts").read_text())


# -- nccom-test ------------------------------------------------------------------------------
_NCCOM_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
_NCCOM_AVG = re.compile(r"Avg bus bandwidth:\s*([\d.]+)\s*GB/s")


def parse_nccom(text: str) -> dict[str, Any]:
    """Rows (size, count, type, time, algbw, busbw) and the average bus bandwidth."""
    rows = [{"size_b": int(m[1]), "count": int(m[2]), "type": m[3], "time_us": float(m[4]),
             "algbw_gbps": float(m[5]), "busbw_gbps": float(m[6])}
            for m in (_NCCOM_ROW.match(line) for line in text.splitlines()) if m]
    avg = _NCCOM_AVG.search(text)
    busbw = float(avg.group(1)) if avg else (
        sum(r["busbw_gbps"] for r in rows) / len(rows) if rows else None)
    return {"rows": rows, "avg_busbw_gbps": busbw}


def judge_nccom(returncode: int, output: str, floor: float | None) -> Outcome:
    if returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-5:])[-400:]
        return failed(f"nccom-test exited {returncode}: {tail}")
    parsed = parse_nccom(output)
    busbw = parsed["avg_busbw_gbps"]
    if busbw is None:
        return failed("nccom-test printed no bandwidth")
    if floor is not None and busbw < floor:
        return failed(f"all-reduce bus bandwidth {busbw:.1f} GB/s, floor {floor:g} GB/s",
                      busbw_gbps=busbw)
    return passed(f"all-reduce bus bandwidth {busbw:.1f} GB/s", busbw_gbps=busbw)


def check_nccom(ctx: NodeContext) -> Outcome:
    if not _neuron_node(ctx):
        return skipped("not a Neuron node")
    exe = shutil.which("nccom-test")
    if exe is None:
        return skipped("nccom-test is not installed")
    ranks = ctx.devices or sum(cores_of(d) for d in parse_neuron_ls(run_neuron_ls())[0])
    # Leave the runner a few seconds to report rather than be killed mid-way.
    limit = max(5.0, ctx.timeouts.get("neuron.nccom", 300.0) - 10.0)
    try:
        proc = subprocess.run([exe, "-r", str(ranks), "allr"], capture_output=True,
                              text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        return failed(f"nccom-test -r {ranks} allr did not finish in {limit:.0f} s")
    return judge_nccom(proc.returncode, proc.stdout + proc.stderr, ctx.floors.nccom_busbw_gbps)
