"""How long after SIGKILL a GPU process's local socket closes, against when its parent can
reap it (``waitpid``) - the gap the agent's early exit report saves.

A child connects to a unix socket (as the worker SDK does at start, before CUDA), allocates
``GB`` of GPU memory and 4 GiB of pinned host memory, then is SIGKILLed; the parent polls the
socket and a pidfd. On an H100 the socket closed 0.12-0.16 s after the kill and the process
was reapable 0.75-0.95 s after it (the CUDA context's release), whatever the GPU memory.

    python bench/recovery/exit_teardown.py --device "NVIDIA H100 80GB HBM3" \
        --out exit-teardown-h100.json
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header, write  # noqa: E402

CHILD = r'''
import socket, sys, time, torch
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
x = torch.empty(int(float(sys.argv[2]) * 2**30), dtype=torch.uint8, device="cuda"); x.fill_(1)
y = torch.empty(4 * 2**30, dtype=torch.uint8).pin_memory()
torch.cuda.synchronize()
s.send(b"ready")
time.sleep(1000)
'''


def one(gb: float) -> dict[str, float]:
    path = os.path.join(tempfile.mkdtemp(prefix="exit-"), "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    p = subprocess.Popen([sys.executable, "-c", CHILD, path, str(gb)])
    try:
        conn, _ = srv.accept()
        if conn.recv(5) != b"ready":
            raise SystemExit("the child did not get ready")
        pidfd = os.pidfd_open(p.pid)
        t0 = time.perf_counter()
        os.kill(p.pid, signal.SIGKILL)
        seen: dict[str, float] = {}
        names = {conn.fileno(): "socket_closed_s", pidfd: "reapable_s"}
        poller = select.poll()
        for fd in names:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        while len(seen) < 2:
            for fd, _ in poller.poll(30_000):
                seen[names[fd]] = round(time.perf_counter() - t0, 4)
                poller.unregister(fd)
        return {"gpu_gb": gb, **seen}
    finally:
        p.kill()
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", default="1,20,60", help="GPU GiB to hold, comma-separated")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="exit-teardown.json")
    a = ap.parse_args()
    runs = [one(float(g)) for g in a.gb.split(",")]
    for r in runs:
        print(r, flush=True)
    print(f"wrote {write(Path(a.out).name, {**header(a.device), 'runs': runs})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
