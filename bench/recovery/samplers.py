"""What runs beside a job while ``recovery.py`` measures it, read from ``/proc``.

- :class:`StandbySampler`: the warm standbys' host memory and every process's GPU memory.
- :class:`DeathWatch`: each rank's or standby's death, from the moment the kernel marks it
  exiting (``PF_EXITING``) to the end of its teardown (a zombie, or gone), and, for
  ``window_s`` after each death, what every thread of the other ranks and standbys is doing
  in the kernel (its state, its system call and that call's file, ``wchan``, the top of its
  kernel stack), sampled every ``every_s``. A thread blocked in an ``ioctl`` on
  ``/dev/nvidia1`` for 0.9 s after a death says the GPU driver holds it; one in ``futex``
  says it waits for another thread of its process.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

_PF_EXITING = 0x4
# x86-64 system call numbers a thread of a rank is commonly found in.
_SYSCALLS = {0: "read", 1: "write", 3: "close", 7: "poll", 9: "mmap", 10: "mprotect",
             11: "munmap", 16: "ioctl", 23: "select", 24: "sched_yield", 28: "madvise",
             35: "nanosleep", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg",
             61: "wait4", 72: "fcntl", 202: "futex", 230: "clock_nanosleep",
             232: "epoll_wait", 257: "openat", 270: "pselect6", 271: "ppoll",
             281: "epoll_pwait",
             441: "epoll_pwait2"}
# Calls with a file descriptor as their first argument, worth naming.
_FD_CALLS = {"read", "write", "ioctl", "recvfrom", "recvmsg", "sendto", "sendmsg", "fcntl"}
WATCHED = (b"-m\0trainer", b"orchestrator.worker.warm")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class StandbySampler:
    """Every few seconds while a job runs: the warm standbys' host memory (RSS of the
    ``orchestrator.worker.warm`` processes) and every process's GPU memory (nvidia-smi),
    the largest of each kept."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.standby_rss: dict[int, int] = {}
        self.gpu_mib: dict[int, int] = {}
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    cmd = Path(entry.path, "cmdline").read_bytes()
                    if b"orchestrator.worker.warm" not in cmd:
                        continue
                    for line in Path(entry.path, "status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            kb = int(line.split()[1])
                            pid = int(entry.name)
                            self.standby_rss[pid] = max(self.standby_rss.get(pid, 0), kb * 1024)
                except (OSError, ValueError):
                    continue
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=20, check=False).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in out.splitlines():
                try:
                    pid, mib = (int(x) for x in line.split(","))
                except ValueError:
                    continue
                self.gpu_mib[pid] = max(self.gpu_mib.get(pid, 0), mib)

    def report(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=30)
        standbys = sorted(self.standby_rss)
        return {"standby_pids": standbys,
                "standby_rss_bytes": [self.standby_rss[p] for p in standbys],
                "standby_gpu_mib": [self.gpu_mib.get(p) for p in standbys],
                "gpu_mib_by_pid": self.gpu_mib}


class DeathWatch:
    """Deaths of a job's ranks and standbys, and their peers' threads right after each
    (see the module's docstring). ``report`` stops it and returns what it saw."""

    def __init__(self, window_s: float = 3.0, every_s: float = 0.01,
                 min_segment_s: float = 0.02) -> None:
        self.window_s, self.every_s, self.min_segment_s = window_s, every_s, min_segment_s
        self.pids: dict[int, str] = {}  # watched: pid -> "rank" or "standby"
        self.status: dict[int, dict[str, int]] = {}  # pid -> last VmRSS/VmPin/VmLck (kB)
        self.deaths: list[dict[str, Any]] = []
        # (pid, tid) -> [[start, end, label], ...] while a window is open
        self.segments: dict[tuple[int, int], list[list[Any]]] = {}
        self.names: dict[tuple[int, int], str] = {}
        self._fds: dict[tuple[int, str], str] = {}
        self._window_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="death-watch")
        self._thread.start()

    # -- sampling ------------------------------------------------------------------------

    def _scan(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self.pids:
                continue
            try:
                cmd = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if WATCHED[0] in cmd:
                self.pids[int(entry.name)] = "rank"
            elif WATCHED[1] in cmd:
                self.pids[int(entry.name)] = "standby"

    def _memory(self, pid: int) -> None:
        raw = _read(f"/proc/{pid}/status")
        if raw is None:
            return
        got = {}
        for line in raw.splitlines():
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmPin", "VmLck"):
                got[key] = int(line.split()[1])
        self.status[pid] = got

    def _run(self) -> None:
        last_scan = last_mem = 0.0
        dying: dict[int, dict[str, Any]] = {}
        while not self._stop.is_set():
            now = time.time()
            if now - last_scan >= 0.2:
                self._scan()
                last_scan = now
            if now - last_mem >= 1.0:
                for pid in list(self.pids):
                    if pid not in dying:
                        self._memory(pid)
                last_mem = now
            for pid in list(self.pids):
                raw = _read(f"/proc/{pid}/stat")
                fields = raw[raw.rfind(")") + 2:].split() if raw else []
                gone = len(fields) < 7 or fields[0] in ("Z", "X", "x")
                exiting = gone or bool(int(fields[6]) & _PF_EXITING)
                if exiting and pid not in dying:
                    d = {"pid": pid, "kind": self.pids[pid], "exiting": now,
                         "memory_kb": dict(self.status.get(pid, {}))}
                    dying[pid] = d
                    self.deaths.append(d)
                    self._window_until = now + self.window_s
                if gone:
                    dying[pid]["teardown_end"] = now
                    del self.pids[pid]
            if now < self._window_until:
                for pid in self.pids:
                    if pid not in dying:
                        self._threads(pid, now)
            self._stop.wait(self.every_s)

    def _fd(self, pid: int, fd: str) -> str:
        key = (pid, fd)
        if key not in self._fds:
            try:
                self._fds[key] = os.readlink(f"/proc/{pid}/fd/{int(fd, 16)}")
            except (OSError, ValueError):
                return f"fd{fd}"
        return self._fds[key]

    def _threads(self, pid: int, now: float) -> None:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            stat = _read(f"{base}/stat")
            call = _read(f"{base}/syscall")
            if stat is None or call is None:
                continue
            state = stat[stat.rfind(")") + 2:].split(" ", 1)[0]
            parts = call.split()
            if not parts or parts[0] == "running":
                label = f"{state} running"
            else:
                try:
                    name = _SYSCALLS.get(int(parts[0]), "user" if parts[0] == "-1" else f"sys{parts[0]}")
                except ValueError:
                    name = parts[0]
                label = f"{state} {name}"
                if name in _FD_CALLS and len(parts) > 1:
                    label += f" {self._fd(pid, parts[1].removeprefix('0x'))}"
                if name == "ioctl" or state == "D":
                    wchan = (_read(f"{base}/wchan") or "").strip()
                    stack = _read(f"{base}/stack") or ""
                    top = [ln.split("] ", 1)[-1].split("+", 1)[0]
                           for ln in stack.splitlines()[:4]]
                    label += f" [{wchan}] {' < '.join(top)}" if wchan or top else ""
            key = (pid, int(tid))
            if key not in self.names:
                self.names[key] = (_read(f"{base}/comm") or "?").strip()
            segs = self.segments.setdefault(key, [])
            if segs and segs[-1][2] == label and now - segs[-1][1] < 5 * self.every_s:
                segs[-1][1] = now
            else:
                segs.append([now, now, label])

    # -- the report ----------------------------------------------------------------------

    def report(self, roles: dict[int, str] | None = None) -> dict[str, Any]:
        """Every death (wall-clock ``exiting`` and ``teardown_end``, its last memory), and
        per death the other processes' threads in its window: segments of one label at
        least ``min_segment_s`` long, of the threads :func:`worth_keeping` keeps. ``roles`` names pids (``rank 0``...) where the caller knows them."""
        self._stop.set()
        self._thread.join(timeout=30)
        roles = roles or {}
        out = []
        for d in self.deaths:
            t0 = d["exiting"]
            item = {**d, "role": roles.get(d["pid"], d["kind"]), "threads": {}}
            if "teardown_end" in d:
                item["teardown_s"] = round(d["teardown_end"] - t0, 3)
            for (pid, tid), segs in self.segments.items():
                inside = [s for s in segs if s[1] >= t0 and s[0] <= t0 + self.window_s]
                if pid == d["pid"] or not inside or not worth_keeping(inside, tid == pid):
                    continue
                kept = [[round(max(s[0], t0) - t0, 3), round(s[1] - t0, 3), s[2]]
                        for s in inside if s[1] - s[0] >= self.min_segment_s]
                if kept:
                    name = f"{roles.get(pid, self.pids.get(pid, 'pid'))} {pid}/" \
                           f"{tid} {self.names.get((pid, tid), '?')}"
                    item["threads"][name] = kept
            out.append(item)
        return {"deaths": out}


# Calls a thread that does nothing sits in.
_IDLE = {"futex", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select",
         "nanosleep", "clock_nanosleep", "wait4", "read", "recvfrom", "recvmsg", "pselect6"}


def worth_keeping(segments: list[list[Any]], main: bool) -> bool:
    """Whether a thread's segments in a window say something: a process's main thread
    always; another only if it ran, sat in uninterruptible sleep, or waited in a call that
    is not a plain idle wait (an ``ioctl`` into the GPU driver, say)."""
    return main or any(not (label.startswith("S ") and label.split(" ")[1] in _IDLE)
                       for _, _, label in segments)
