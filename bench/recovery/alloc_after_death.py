"""What a replacement's first GPU allocation waits for after a rank's death.

In an in-place recovery on 2 x H200 the replacement's model allocation on the dead rank's
GPU took 0.5-0.74 s after a SIGKILL and 0.02 s after a hang (the rank killed long before),
and it ended within 20 ms of the survivor's NCCL abort each time. This script separates
the candidates, two ranks on two GPUs over NCCL and a warm standby on rank 1's GPU, with no
orchestrator:

- each rank holds ``--hold-gb`` of GPU memory and runs steps of matrix products and an
  all-reduce; rank 1 (the victim) may also page-lock ``--pin-gb`` of shared memory
  (``cudaHostRegister`` of a ``/dev/shm`` mapping, as the memory tier's slots are);
- the standby has its CUDA context and waits;
- the parent SIGKILLs rank 1, waits until ``/proc/<pid>/stat`` says it is exiting, then
  tells the standby to allocate ``--alloc-gb`` on the GPU and the survivor to abort its
  group after ``--abort-delay`` seconds;
- it records, from the kill: the survivor's abort start and end, the standby's allocation
  end, and when the victim was reaped (its teardown done).

With ``--new-group 1`` the survivor and the standby also make a new NCCL group (one
all-reduce) while the survivor's abort runs, as a recovery in place does: in the job that
abort took 1.2-1.3 s even with nothing else on the GPU, against 0.41-0.57 s here alone.

With ``--queue-ms 250`` the survivor queues that much GPU work behind each all-reduce, as a
step's later layers wait behind the collective that hangs (the micro-bench's own queue is
20 small products): the abort cannot end before that work has run if its frees synchronise
the device. ``queue_drained_s`` is when the queue ran out. With ``--load-gb`` the survivor
copies that much page-locked host memory to the GPU on a stream of its own while the abort
runs (a restore's load): ``load_end_s`` against ``abort_end_s`` says whether the abort holds
the copy back.

If the allocation ends with the survivor's abort whatever the delay, the survivor's hold on
the dead rank's memory (NCCL's imported buffers) is what it waits for; if it ends with the
reap, the dead process's own teardown.

Usage: ``python bench/recovery/alloc_after_death.py --pin-gb 0 14 --abort-delay 0 3``
(``--out FILE`` writes the JSON).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import itertools
import json
import mmap
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHM_DIR = os.environ.get("ALLOC_SHM_DIR", "/dev/shm")
COUNT = [1]  # --alloc-count
MIX = [int(os.environ.get("ALLOC_MIX", "0"))]  # --mix (read again by spawned children)
NEWPG = [int(os.environ.get("ALLOC_NEWPG", "0"))]  # --new-group (likewise)
QUEUE_MS = [float(os.environ.get("ALLOC_QUEUE_MS", "0"))]  # --queue-ms (likewise)
LOAD_GB = [float(os.environ.get("ALLOC_LOAD_GB", "0"))]  # --load-gb (likewise)
LOAD_SYNC = [os.environ.get("ALLOC_LOAD_SYNC", "stream")]  # --load-sync (likewise)
ALLOC_DELAY = [float(os.environ.get("ALLOC_DELAY", "0"))]  # --alloc-delay (likewise)


def _exiting(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X", "x")


def _kill(pid: int) -> tuple[float, float]:
    """SIGKILL ``pid``; when it was sent, and when ``/proc`` said the process was exiting
    (as the agent notices a death)."""
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    while not _exiting(pid):
        time.sleep(0.001)
    return t_kill, time.time()


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def _pin(gb: float, tag: str, huge: bool = False) -> tuple[float, list]:
    """Page-lock ``gb`` of a fresh /dev/shm file in two halves (the memory tier's two
    slots), asking for transparent huge pages first with ``huge``; the seconds it took and
    what keeps the mappings alive."""
    keep: list = []
    t0 = time.perf_counter()
    for half in range(2):
        size = int(gb * (1 << 30) / 2) // mmap.PAGESIZE * mmap.PAGESIZE
        if size <= 0:
            continue
        path = f"{SHM_DIR}/alloc-after-death-{tag}-{half}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, mmap.MAP_SHARED)
        os.close(fd)
        os.unlink(path)
        if huge:
            buf.madvise(mmap.MADV_HUGEPAGE)
        anchor = ctypes.c_char.from_buffer(buf)
        code = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(anchor), size, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister: {code}")
        keep += [buf, anchor]
    return time.perf_counter() - t0, keep


def _mixed(grad: torch.Tensor, dev: torch.device) -> None:
    """The collectives of an FSDP2 step besides the gradient's all-reduce: all-gathers and
    reduce-scatters of small, middle and large sizes (NCCL picks its LL, LL128 and Simple
    protocols by size, each with buffers of its own), and a small all-reduce."""
    for numel in (16 << 10, 1 << 20, 16 << 20):
        shard = grad[:numel]
        out = torch.empty(2 * numel, device=dev)
        dist.all_gather_into_tensor(out, shard)
        dist.reduce_scatter_tensor(shard, out)
    dist.all_reduce(grad[:256])


def _rank(rank: int, port: int, hold_gb: float, pin_gb: float, tag: str, conn, ready,
          order) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", TORCH_NCCL_ASYNC_ERROR_HANDLING="2")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    held = torch.empty(int(hold_gb * (1 << 30)), dtype=torch.uint8, device=dev) \
        if hold_gb > 0 else None
    pin_s, keep = _pin(pin_gb, tag) if rank == 1 and pin_gb > 0 else (0.0, [])
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    grad = torch.randn(64 << 20, device=dev)
    marks: dict[str, float] = {"pin_s": pin_s}

    queued = _queue_length(a) if rank == 0 and QUEUE_MS[0] > 0 else 0
    marks["queued_ops"] = queued
    load = _load_buffers(dev) if rank == 0 and LOAD_GB[0] > 0 else None

    def abort() -> None:
        marks["abort_start"] = time.time()
        dist.distributed_c10d._get_default_group().abort()
        marks["abort_end"] = time.time()

    def order_thread() -> None:
        delay = order.recv()
        time.sleep(delay)
        drained = torch.cuda.Event()
        drained.record(torch.cuda.default_stream(dev))
        watch = threading.Thread(target=_when_done, args=(drained, marks, "queue_drained"))
        watch.start()
        if not NEWPG[0] and load is None:
            abort()
            watch.join()
            conn.send(marks)
            return
        aborting = threading.Thread(target=abort)
        aborting.start()
        if load is not None:
            _load(load, dev, marks)
        if NEWPG[0]:
            marks["newpg_ready"] = _new_group(0, port + 500, dev)
        aborting.join()
        watch.join()
        conn.send(marks)

    if rank == 0:
        threading.Thread(target=order_thread, daemon=True).start()
    step = 0
    try:
        while True:
            for _ in range(20):
                a = (a @ a).tanh_()
            dist.all_reduce(grad)
            if MIX[0]:
                _mixed(grad, dev)
            for _ in range(queued):  # behind the all-reduce, as a step's later layers are
                a = (a @ a).tanh_()
            float(grad.norm())
            step += 1
            if step == 5:
                ready.send(time.time())
    except Exception as exc:  # noqa: BLE001 - the abort's error ends the loop
        marks["error"] = type(exc).__name__
    del held, keep
    time.sleep(3600)


def _queue_length(a: torch.Tensor) -> int:
    """How many of the loop's matrix products take ``--queue-ms`` on this GPU."""
    for _ in range(10):
        b = (a @ a).tanh_()
    torch.cuda.synchronize(a.device)
    t = time.perf_counter()
    for _ in range(50):
        b = (b @ b).tanh_()
    torch.cuda.synchronize(a.device)
    each = (time.perf_counter() - t) / 50
    return max(1, round(QUEUE_MS[0] / 1000 / each))


def _when_done(event: torch.cuda.Event, marks: dict, key: str) -> None:
    """Record in ``marks[key]`` when ``event`` completes (polled every millisecond)."""
    deadline = time.time() + 60
    while not event.query() and time.time() < deadline:
        time.sleep(0.001)
    marks[key] = time.time()


def _load_buffers(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``--load-gb`` of page-locked host memory and as much on the GPU (a restore's copy)."""
    n = int(LOAD_GB[0] * (1 << 30))
    return (torch.empty(n, dtype=torch.uint8, pin_memory=True),
            torch.empty(n, dtype=torch.uint8, device=dev))


def _load(bufs: tuple[torch.Tensor, torch.Tensor], dev: torch.device, marks: dict) -> None:
    """A restore's host-to-device copy while the abort runs, on a stream of its own (not
    behind the abandoned step's queue), waited for by a sync of that stream or of the whole
    device (``--load-sync``): whether the abort holds either back."""
    src, dst = bufs
    side = torch.cuda.Stream(dev)
    marks["load_start"] = time.time()
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
    marks["load_issued"] = time.time()
    if LOAD_SYNC[0] == "device":
        torch.cuda.synchronize(dev)
    else:
        side.synchronize()
    marks["load_end"] = time.time()


def _new_group(rank: int, port: int, dev: torch.device) -> float:
    """The next generation's NCCL group of two (the survivor, rank 0, hosts its store), set
    up by one all-reduce; when that all-reduce was done (wall clock)."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("next", store), rank, 2)
    one = torch.ones(1, device=dev)
    pg.allreduce([one]).wait()
    torch.cuda.synchronize(dev)
    return time.time()


def _solo(hold_gb: float, pin_gb: float, huge: bool, tag: str, ready) -> None:
    """One GPU: the victim alone, holding GPU memory and page-locked shared memory."""
    torch.cuda.set_device(0)
    held = torch.empty(int(hold_gb * (1 << 30)), dtype=torch.uint8, device="cuda:0")
    pin_s, keep = _pin(pin_gb, tag, huge) if pin_gb > 0 else (0.0, [])
    a = torch.randn(4096, 4096, device="cuda:0", dtype=torch.bfloat16)
    ready.send(pin_s)
    while True:
        for _ in range(20):
            a = (a @ a).tanh_()
        float(a.norm())
    del held, keep


def _allocate(device: int, alloc_gb: float, count: int) -> list:
    """``alloc_gb`` on ``device`` in ``count`` tensors (a model's parameters are hundreds
    of them, each its own allocation of the caching allocator)."""
    each = max(1, int(alloc_gb * (1 << 30)) // count)
    return [torch.empty(each, dtype=torch.uint8, device=f"cuda:{device}")
            for _ in range(count)]


def _standby(device: int, alloc_gb: float, count: int, conn, ready, port: int = 0) -> None:
    torch.cuda.set_device(device)
    torch.ones(1, device=f"cuda:{device}").sum().item()  # the context, as a warm standby has
    t = time.perf_counter()
    before = _allocate(device, alloc_gb, count)  # the same, with nobody dying
    before_s = time.perf_counter() - t
    del before
    torch.cuda.empty_cache()
    ready.send(time.time())
    got = conn.recv()
    newpg = _new_group(1, port + 500, torch.device("cuda", device)) if NEWPG[0] else None
    if ALLOC_DELAY[0] > 0:  # into the survivor's abort, as a replacement's model build is
        time.sleep(max(0.0, got + ALLOC_DELAY[0] - time.time()))
    t0 = time.time()
    xs = _allocate(device, alloc_gb, count)
    t1 = time.time()
    for x in xs:
        x.fill_(1)
    torch.cuda.synchronize(device)
    conn.send({"alloc_start": t0, "alloc_end": t1, "fill_end": time.time(),
               "alloc_alone_s": before_s, "newpg_ready": newpg})
    time.sleep(3600)


def one(hold_gb: float, pin_gb: float, delay: float, alloc_gb: float, port: int) -> dict:
    ctx = mp.get_context("spawn")
    surv_r, surv_w = ctx.Pipe()
    ready_r, ready_w = ctx.Pipe(duplex=False)
    order_r, order_w = ctx.Pipe(duplex=False)
    sb_parent, sb_child = ctx.Pipe()
    tag = f"{os.getpid()}-{port}"
    procs = [ctx.Process(target=_rank, args=(r, port, hold_gb, pin_gb, tag, surv_w, ready_w,
                                             order_r)) for r in range(2)]
    standby = ctx.Process(target=_standby, args=(1, alloc_gb, COUNT[0], sb_child, ready_w,
                                                 port))
    for p in [*procs, standby]:
        p.start()
    for _ in range(3):
        ready_r.recv()
    time.sleep(0.5)
    victim = procs[1]
    t_kill, t_seen = _kill(victim.pid)
    sb_parent.send(t_kill)
    order_w.send(delay)
    victim.join()
    t_reaped = time.time()
    marks = surv_r.recv() if surv_r.poll(60) else {}
    got = sb_parent.recv() if sb_parent.poll(60) else {}
    for p in [*procs, standby]:
        if p.is_alive():
            p.kill()
        p.join()

    def rel(t: float | None) -> float | None:
        return _since(t, t_kill)

    return {"hold_gb": hold_gb, "pin_gb": pin_gb, "abort_delay_s": delay,
            "alloc_gb": alloc_gb, "cumem": os.environ.get("NCCL_CUMEM_ENABLE", "default"),
            "seen_s": rel(t_seen), "reaped_s": rel(t_reaped),
            "abort_start_s": rel(marks.get("abort_start")),
            "abort_end_s": rel(marks.get("abort_end")),
            "alloc_start_s": rel(got.get("alloc_start")),
            "alloc_end_s": rel(got.get("alloc_end")), "fill_end_s": rel(got.get("fill_end")),
            "alloc_count": COUNT[0], "alloc_alone_s": got.get("alloc_alone_s"),
            "alloc_delay_s": ALLOC_DELAY[0], "new_group": NEWPG[0], "survivor_newpg_s": rel(marks.get("newpg_ready")),
            "queue_ms": QUEUE_MS[0], "queued_ops": marks.get("queued_ops"),
            "queue_drained_s": rel(marks.get("queue_drained")), "load_gb": LOAD_GB[0],
            "load_start_s": rel(marks.get("load_start")),
            "load_issued_s": rel(marks.get("load_issued")),
            "load_end_s": rel(marks.get("load_end")), "load_sync": LOAD_SYNC[0],
            "standby_newpg_s": rel(got.get("newpg_ready"))}


def one_solo(hold_gb: float, pin_gb: float, huge: bool, alloc_gb: float) -> dict:
    """One GPU: kill a process holding GPU and page-locked memory; a standby allocates."""
    ctx = mp.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    sb_parent, sb_child = ctx.Pipe()
    victim = ctx.Process(target=_solo, args=(hold_gb, pin_gb, huge, f"{os.getpid()}", ready_w))
    standby = ctx.Process(target=_standby, args=(0, alloc_gb, COUNT[0], sb_child, ready_w))
    victim.start()
    pin_s = ready_r.recv()
    standby.start()
    ready_r.recv()
    time.sleep(1.0)
    t_kill, t_seen = _kill(victim.pid)
    sb_parent.send(t_kill)
    victim.join()
    t_reaped = time.time()
    got = sb_parent.recv() if sb_parent.poll(60) else {}
    standby.kill()
    standby.join()

    def rel(t: float | None) -> float | None:
        return _since(t, t_kill)

    return {"gpus": 1, "shm_dir": os.environ.get("ALLOC_SHM_DIR", "/dev/shm"),
            "hold_gb": hold_gb, "pin_gb": pin_gb, "huge": huge,
            "pin_s": round(pin_s, 3), "alloc_gb": alloc_gb, "seen_s": rel(t_seen),
            "reaped_s": rel(t_reaped), "alloc_start_s": rel(got.get("alloc_start")),
            "alloc_end_s": rel(got.get("alloc_end")), "fill_end_s": rel(got.get("fill_end")),
            "alloc_count": COUNT[0], "alloc_alone_s": got.get("alloc_alone_s")}


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-gb", type=float, default=30.0)
    ap.add_argument("--pin-gb", type=float, nargs="+", default=[0.0, 14.0])
    ap.add_argument("--abort-delay", type=float, nargs="+", default=[0.0, 3.0])
    ap.add_argument("--alloc-gb", type=float, default=2.5)
    ap.add_argument("--alloc-count", type=int, default=1,
                    help="in this many tensors (the 1.14B model's shard: about 300)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--gpus", type=int, choices=[1, 2], default=2,
                    help="1: the victim alone and a standby on one GPU (no survivor)")
    ap.add_argument("--huge", type=int, nargs="+", choices=[0, 1], default=[0],
                    help="with --gpus 1: madvise(MADV_HUGEPAGE) the shared memory first")
    ap.add_argument("--mix", type=int, nargs="+", choices=[0, 1], default=[0],
                    help="1: each step also runs an FSDP2-like mix of collectives")
    ap.add_argument("--new-group", type=int, nargs="+", choices=[0, 1], default=[0],
                    help="1: the survivor and the standby make a new NCCL group (one "
                    "all-reduce) while the survivor's abort runs, as a recovery in place does")
    ap.add_argument("--queue-ms", type=float, nargs="+", default=[0.0],
                    help="milliseconds of the survivor's matrix products queued behind each "
                    "all-reduce (a step's layers after the collective that hangs)")
    ap.add_argument("--load-gb", type=float, nargs="+", default=[0.0],
                    help="the survivor copies this much host memory to the GPU, on a "
                    "stream of its own, while its abort runs (a restore's load)")
    ap.add_argument("--load-sync", nargs="+", choices=["stream", "device"],
                    default=["stream"], help="how the load's end is waited for")
    ap.add_argument("--alloc-delay", type=float, nargs="+", default=[0.0],
                    help="the standby allocates this many seconds after the kill (in the job "
                    "a replacement's model build reaches its allocation 0.4-0.5 s after it)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--shm-dir", default=None, help="where the page-locked files are made "
                    "(a tmpfs mounted with huge=always, say; default /dev/shm)")
    args = ap.parse_args()
    if args.shm_dir:
        os.environ["ALLOC_SHM_DIR"] = args.shm_dir  # the spawned children read it
    COUNT[0] = max(1, args.alloc_count)
    runs = []
    port = 29700
    if args.gpus == 1:
        for pin, huge, _ in itertools.product(args.pin_gb, args.huge, range(args.repeat)):
            r = one_solo(args.hold_gb, pin, bool(huge), args.alloc_gb)
            print(json.dumps(r), flush=True)
            runs.append(r)
    for mix, newpg, queue, load, sync, alloc_delay, pin, delay, _ in itertools.product(
            args.mix, args.new_group, args.queue_ms, args.load_gb, args.load_sync,
            args.alloc_delay, args.pin_gb, args.abort_delay, range(args.repeat)):
        if args.gpus == 1:
            break
        port += 1
        MIX[0], NEWPG[0], QUEUE_MS[0], LOAD_GB[0], LOAD_SYNC[0] = mix, newpg, queue, load, sync
        ALLOC_DELAY[0] = alloc_delay
        # The spawned ranks read them.
        os.environ.update(ALLOC_MIX=str(mix), ALLOC_NEWPG=str(newpg),
                          ALLOC_QUEUE_MS=str(queue), ALLOC_LOAD_GB=str(load),
                          ALLOC_LOAD_SYNC=sync, ALLOC_DELAY=str(alloc_delay))
        r = {**one(args.hold_gb, pin, delay, args.alloc_gb, port), "mix": mix}
        print(json.dumps(r), flush=True)
        runs.append(r)
    result = {"script": "bench/recovery/alloc_after_death.py",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": os.environ.get(
                  "ORCH_BENCH_COMMIT"), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
              "shmem_thp": _thp(), "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
