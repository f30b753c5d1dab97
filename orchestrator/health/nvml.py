"""NVIDIA GPUs: readings through NVML (nvidia-ml-py, optional) and the rules that judge them.

``read_nvml`` turns NVML into a plain JSON-able snapshot (one dict per device, ``None`` where
the device does not support a counter), and the ``judge_*`` functions decide on snapshots, so
the rules are tested on recorded samples (``tests/unit/health/fixtures/nvml``) without a GPU.
XID events come from the kernel log (NVML reports them only to a listener registered before
they happen).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from orchestrator.health.base import Outcome, failed, passed

# XIDs that mean the GPU (or its link) needs a reset or replacement before it can be trusted
# again (NVIDIA's XID catalog). Others (13, 31, 43, 45, 94: mostly the application's own
# faults, or contained errors) are reported in the message without failing the node.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    64: "page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

_XID = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<code>\d+)(?:, (?P<rest>.*))?")


def read_nvml() -> dict[str, Any]:
    """A snapshot of every GPU NVML sees: ``{"available", "reason", "driver", "devices"}``."""
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "nvidia-ml-py is not installed", "devices": []}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "reason": f"NVML: {exc}", "devices": []}
    try:
        return {"available": True, "reason": "",
                "driver": _read(pynvml, {}, "driver", pynvml.nvmlSystemGetDriverVersion),
                "devices": [_device(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]}
    finally:
        pynvml.nvmlShutdown()


def _read(nv: Any, errors: dict[str, str], key: str, fn: Any, *args: Any) -> Any:
    """One NVML call: its value, None when unsupported, the error noted otherwise."""
    try:
        value = fn(*args)
    except nv.NVMLError as exc:
        if getattr(exc, "value", None) != nv.NVML_ERROR_NOT_SUPPORTED:
            errors[key] = str(exc)
        return None
    return value.decode() if isinstance(value, bytes) else value


def _device(nv: Any, index: int) -> dict[str, Any]:
    errors: dict[str, str] = {}
    h = _read(nv, errors, "handle", nv.nvmlDeviceGetHandleByIndex, index)
    dev: dict[str, Any] = {"index": index, "errors": errors}
    if h is None:
        return dev
    mem = _read(nv, errors, "memory", nv.nvmlDeviceGetMemoryInfo, h)
    pci = _read(nv, errors, "pci", nv.nvmlDeviceGetPciInfo, h)
    ecc = _read(nv, errors, "ecc_mode", nv.nvmlDeviceGetEccMode, h)
    unc, cor = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
    dbe = _read(nv, errors, "retired_dbe", nv.nvmlDeviceGetRetiredPages, h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    sbe = _read(nv, errors, "retired_sbe", nv.nvmlDeviceGetRetiredPages, h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    pending = _read(nv, errors, "retired_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
    rows = _read(nv, errors, "remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
    pci_id = pci.busId if pci is not None else None
    dev.update({
        "name": _read(nv, errors, "name", nv.nvmlDeviceGetName, h),
        "uuid": _read(nv, errors, "uuid", nv.nvmlDeviceGetUUID, h),
        "pci_bus_id": pci_id.decode() if isinstance(pci_id, bytes) else pci_id,
        "memory_total_bytes": mem.total if mem is not None else None,
        "ecc_enabled": bool(ecc[0]) if ecc is not None else None,
        "ecc_uncorrected_volatile": _read(nv, errors, "ecc_unc_volatile",
                                          nv.nvmlDeviceGetTotalEccErrors, h, unc,
                                          nv.NVML_VOLATILE_ECC),
        "ecc_uncorrected_aggregate": _read(nv, errors, "ecc_unc_aggregate",
                                           nv.nvmlDeviceGetTotalEccErrors, h, unc,
                                           nv.NVML_AGGREGATE_ECC),
        "ecc_corrected_volatile": _read(nv, errors, "ecc_cor_volatile",
                                        nv.nvmlDeviceGetTotalEccErrors, h, cor,
                                        nv.NVML_VOLATILE_ECC),
        "retired_pages_dbe": len(dbe) if dbe is not None else None,
        "retired_pages_sbe": len(sbe) if sbe is not None else None,
        "retired_pages_pending": bool(pending) if pending is not None else None,
        "remapped_rows": None if rows is None else {
            "correctable": rows[0], "uncorrectable": rows[1], "pending": bool(rows[2]),
            "failure": bool(rows[3])},
    })
    return dev


# -- rules -------------------------------------------------------------------------------------
def _label(dev: dict[str, Any]) -> str:
    return f"GPU {dev.get('index')}" + (f" ({dev['pci_bus_id']})" if dev.get("pci_bus_id") else "")


def judge_inventory(devices: list[dict[str, Any]], expected: int,
                    expect_name: str | None) -> Outcome:
    """At least ``expected`` GPUs, each answering NVML, each named like ``expect_name``."""
    # A device that cannot answer the basic queries (GPU is lost, reset required) is broken.
    problems = [f"{_label(d)}: {', '.join(f'{k}: {v}' for k, v in d['errors'].items())}"
                for d in devices if set(d.get("errors", {})) & {"handle", "name", "memory"}]
    if expect_name:
        problems += [f"{_label(d)} is a {d.get('name')}, expected {expect_name}"
                     for d in devices if d.get("name") and
                     expect_name.lower() not in str(d["name"]).lower()]
    names = sorted({str(d.get("name")) for d in devices if d.get("name")})
    summary = f"{len(devices)} x {', '.join(names) or 'GPU'}"
    if len(devices) < expected:
        problems.insert(0, f"{len(devices)} GPUs visible, the job needs {expected}")
    if problems:
        return failed("; ".join(problems), count=len(devices), names=names)
    return passed(summary, count=len(devices), names=names)


def judge_ecc(devices: list[dict[str, Any]]) -> Outcome:
    """Uncorrectable ECC errors since the driver loaded fail the device; older ones are noted."""
    bad, notes = [], []
    for d in devices:
        volatile, aggregate = d.get("ecc_uncorrected_volatile"), d.get("ecc_uncorrected_aggregate")
        if volatile:
            bad.append(f"{_label(d)}: {volatile} uncorrectable ECC error(s) since the driver "
                       "loaded")
        elif aggregate:
            notes.append(f"{_label(d)}: {aggregate} uncorrectable ECC error(s) in its lifetime")
        if d.get("ecc_enabled") is False:
            notes.append(f"{_label(d)}: ECC is disabled")
    supported = [d for d in devices if d.get("ecc_uncorrected_volatile") is not None]
    if bad:
        return failed("; ".join(bad + notes))
    if not supported:
        return passed("ECC counters not supported by these devices" if devices else "no GPUs")
    return passed("; ".join(notes) or f"no uncorrectable ECC errors on {len(supported)} GPUs")


def judge_retirement(devices: list[dict[str, Any]], max_pages: int) -> Outcome:
    """Page retirement (before Ampere) or row remapping (Ampere on): pending or failed fails."""
    bad, notes = [], []
    for d in devices:
        pages = (d.get("retired_pages_dbe") or 0) + (d.get("retired_pages_sbe") or 0)
        if d.get("retired_pages_pending"):
            bad.append(f"{_label(d)}: page retirement pending (needs a GPU reset)")
        if pages >= max_pages:
            bad.append(f"{_label(d)}: {pages} retired pages (replace at {max_pages})")
        elif pages:
            notes.append(f"{_label(d)}: {pages} retired pages")
        rows = d.get("remapped_rows")
        if rows:
            if rows.get("failure"):
                bad.append(f"{_label(d)}: row remapping failed (the GPU needs replacing)")
            if rows.get("pending"):
                bad.append(f"{_label(d)}: row remapping pending (needs a GPU reset)")
            if rows.get("uncorrectable"):
                notes.append(f"{_label(d)}: {rows['uncorrectable']} rows remapped for "
                             "uncorrectable errors")
    if bad:
        return failed("; ".join(bad + notes))
    return passed("; ".join(notes) or f"nothing pending on {len(devices)} GPUs")


@dataclass(frozen=True)
class Xid:
    pci: str
    code: int
    text: str


def parse_xids(kernel_log: str) -> list[Xid]:
    """Every ``NVRM: Xid (PCI:...): N, ...`` line of a kernel log."""
    out = []
    for m in _XID.finditer(kernel_log):
        out.append(Xid(m.group("pci"), int(m.group("code")), (m.group("rest") or "").strip()))
    return out


def judge_xids(xids: list[Xid]) -> Outcome:
    critical = [x for x in xids if x.code in CRITICAL_XIDS]
    others = sorted({x.code for x in xids if x.code not in CRITICAL_XIDS})
    note = f"; non-critical XIDs seen: {', '.join(map(str, others))}" if others else ""
    if critical:
        seen = {}
        for x in critical:
            seen.setdefault((x.pci, x.code), x)
        text = "; ".join(f"{pci}: XID {code} ({CRITICAL_XIDS[code]})" for pci, code in seen)
        return failed(f"critical XID events in the kernel log: {text}{note}",
                      xids=sorted({x.code for x in xids}))
    return passed(f"no critical XID events{note}", xids=sorted({x.code for x in xids}))


def read_kernel_log(timeout: float = 20.0) -> tuple[str | None, str]:
    """(kernel log text, or None, and where it came from or why it could not be read)."""
    reasons = []
    for cmd in (["dmesg"], ["journalctl", "-k", "-q", "--no-pager", "-b"]):
        if shutil.which(cmd[0]) is None:
            reasons.append(f"{cmd[0]}: not installed")
            continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(f"{cmd[0]}: {exc}")
            continue
        if proc.returncode == 0 and proc.stdout:
            return proc.stdout, cmd[0]
        reasons.append(f"{cmd[0]}: {(proc.stderr or 'no output').strip()[:120]}")
    return None, "; ".join(reasons)
