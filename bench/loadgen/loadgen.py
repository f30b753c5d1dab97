"""Load generator: the real supervisor against N simulated agents speaking the real protocol.

The supervisor runs as ``orchestrator up`` in a subprocess with ``launcher.kind: kubernetes``
(it waits for agents to register on their own); ``--nodes`` simulated agents
(``loadgen_agent.SimNode``) run in ``--shards`` processes of their own (``loadgen_fleet``;
one per 256 nodes by default), each with its own connections. Once the job is
RUNNING the scenario injects each fault in ``--faults`` in turn (``crash``: a rank exits 1;
``hang``: a rank's step stops while its beats go on; ``node_lost``: a node goes silent, and
comes back once the supervisor has stopped the generation), waits for the relaunch to be
RUNNING again, and finally stops the job as an operator would. Everything is then read from
the journal (typed, through ``orchestrator.journal.read_journal``) and from what the agents
measured:

    registration_s / running_s     supervisor start -> every node registered / RUNNING
    heartbeat p50 / p99 / max      round trip of a beat as the agent saw it; drops = failed
    supervisor cpu / rss           /proc of the supervisor's process, and of its heartbeat
                                   process (api.heartbeat_process), sampled every 0.5 s
    per fault                      detection latency (vs its timeout), stop (STOPPING ->
                                   RECOVERING), relaunch (STOPPING -> RUNNING), relaunches
    invariants                     healthy nodes declared LOST (must be 0), relaunches per
                                   fault (must be 1)

    python bench/loadgen/loadgen.py --nodes 2048 --procs 8 --runs 3 --out scale-2048x8.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common

import loadgen_wire as wire
from bench.common import header, write
from loadgen_agent import Net, Stats, quiet_gc
from loadgen_fleet import Fleet, NodeView
from loadgen_http import Conn
from loadgen_phases import phase_report

from orchestrator.contracts import events as ev
from orchestrator.journal.store import read_journal
from orchestrator.contracts.state import NodeState

FAULTS = ("crash", "hang", "node_lost")


def start_py_spy(a: argparse.Namespace, sup: Supervised,
                 index: int) -> subprocess.Popen[bytes] | None:
    """``--py-spy DIR``: sample the supervisor for the whole run (every thread, idle
    samples included, so the main thread's samples are in time order at ``--py-spy-rate``)
    into DIR/run<index>.speedscope.json."""
    if not a.py_spy:
        return None
    out = Path(a.py_spy) / f"run{index}.speedscope.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "--pid", str(sup.proc.pid), "--rate",
                             str(a.py_spy_rate), "--idle", "--threads", "--nonblocking",
                             "--format", "speedscope", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def supervisor_cmd(run: Path, a: argparse.Namespace) -> list[str]:
    sets = {
        "job.name": "scale", "job.entrypoint": "[simulated]",
        "cluster.nodes": a.nodes, "cluster.procs_per_node": a.procs,
        "cluster.spares": a.spares, "launcher.kind": "kubernetes",
        "health.preflight": "off", "health.after_failure": "off",
        "timeouts.heartbeat_interval_s": a.heartbeat_s, "timeouts.node_lost_s": a.lost_s,
        "timeouts.training_floor_s": a.hang_s, "timeouts.stop_grace_s": a.stop_grace_s,
        "timeouts.stack_dump_wait_s": 5, "timeouts.register_s": a.phase_timeout_s,
        "timeouts.launch_s": a.phase_timeout_s, "restart.backoff_initial_s": 1,
        "restart.max_restarts": 20, "metrics.port": 0,
    }
    sets.update(a.sets)  # --set KEY=VALUE: A/B runs
    cmd = [sys.executable, "-m", "orchestrator", "up", "--run-dir", str(run)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_cpu_rss(pid: int) -> tuple[float, float]:
    """A process's CPU seconds (user + system, its threads included) and resident bytes,
    from /proc (no psutil: the run needs only what `pip install -e .` installs)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/statm") as f:
        rss_pages = int(f.read().split()[1])
    return (int(fields[11]) + int(fields[12])) / _TICK, float(rss_pages * _PAGE)


def children_cpu_rss(pid: int) -> dict[int, tuple[float, float]]:
    """CPU seconds and RSS of each of ``pid``'s children (the supervisor's heartbeat process,
    with ``api.heartbeat_process``; the kubernetes launcher starts no other)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return {}
    out = {}
    for kid in kids:
        try:
            out[kid] = proc_cpu_rss(kid)
        except (OSError, ValueError, IndexError):
            continue
    return out


def children_cpu_s(kids: list[dict[int, tuple[float, float]]]) -> float:
    """CPU seconds the children used between the first sample and the last they were seen
    (a child that exited before the last sample keeps what it used)."""
    first = kids[0] if kids else {}
    last: dict[int, float] = {}
    for sample in kids:
        for pid, (cpu, _) in sample.items():
            last[pid] = cpu
    return sum(cpu - first.get(pid, (0.0, 0.0))[0] for pid, cpu in last.items())


def cpu_list(text: str) -> set[int]:
    """`taskset -c` syntax: "0,1" or "2-15" or "0-1,4"."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus or not cpus <= os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)):
        raise argparse.ArgumentTypeError(f"not CPUs of this machine: {text!r}")
    return cpus


class Supervised:
    """The supervisor subprocess: its URL, its state (via /healthz) and its CPU and RSS."""

    def __init__(self, run: Path, a: argparse.Namespace, token: str) -> None:
        self.run, self.token = run, token
        env = {**os.environ, "ORCH_TOKEN": token}
        run.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(run.parent / "supervisor.out", "wb")  # noqa: SIM115
        # In our process group: whoever kills the generator's group (a test at its
        # timeout) kills the supervisor with it.
        self.proc = subprocess.Popen(supervisor_cmd(run, a), env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT)
        if a.supervisor_cpus:
            # As `taskset -c -p` would: set while the child is still importing, before it
            # starts a thread (threads inherit it). No preexec_fn: this process has threads.
            os.sched_setaffinity(self.proc.pid, a.supervisor_cpus)
        self.started = time.time()
        self.samples: list[tuple[float, float, float]] = []  # wall, cpu s, rss bytes
        self.kids: list[dict[int, tuple[float, float]]] = []  # its children: cpu s, rss
        self.own: list[tuple[float, float]] = []  # the generator's wall, cpu s (its shards')
        self.fleet_pids: list[int] = []  # the processes of the simulated agents
        self.load: list[float] = []  # the machine's 1-minute load average
        self.late_s: float | None = None  # the supervisor's own loop lateness (/metrics)
        self.late: list[tuple[float, float]] = []  # (wall, late seconds so far), from /metrics
        self.url = ""

    async def wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        info = self.run / "supervisor.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited with {self.proc.returncode}")
            try:
                self.url = json.loads(info.read_text())["url"]
                return self.url
            except (OSError, ValueError, KeyError):
                await asyncio.sleep(0.05)
        raise TimeoutError("the supervisor did not start listening")

    async def sample(self) -> None:
        while self.proc.poll() is None:
            try:
                cpu, rss = proc_cpu_rss(self.proc.pid)
            except (OSError, ValueError, IndexError):
                return
            mine = os.times()
            agents = 0.0
            for pid in self.fleet_pids:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    agents += proc_cpu_rss(pid)[0]
            self.samples.append((time.time(), cpu, rss))
            self.kids.append(children_cpu_rss(self.proc.pid))
            self.own.append((time.time(), mine.user + mine.system + agents))
            self.load.append(os.getloadavg()[0])
            await asyncio.sleep(0.5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # the kubernetes launcher started no children of its own
            self.proc.wait()
        self.out.close()


async def job_health(net: Net) -> tuple[str, int | None]:
    """The job's state and generation, from /healthz ("?" and None if it did not answer)."""
    try:
        status, data = await net.call("", "GET", "/healthz", 5.0)
    except (OSError, TimeoutError):
        return "?", None
    if status != 200 or not isinstance(data, dict):
        return "?", None
    gen = data.get("generation")
    return str(data.get("state")), gen if isinstance(gen, int) else None


async def job_state(net: Net) -> str:
    return (await job_health(net))[0]


async def wait_until(net: Net, sup: Supervised, timeout: float,
                     done: Callable[[str, int | None], bool]) -> bool:
    """Until ``done(state, generation)`` holds for what /healthz says (False at the timeout
    or if the supervisor exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sup.proc.poll() is None:
        if done(*await job_health(net)):
            return True
        await asyncio.sleep(0.2)
    return False


async def wait_state(net: Net, states: set[str], timeout: float, sup: Supervised) -> bool:
    return await wait_until(net, sup, timeout, lambda state, _: state in states)


_RECOVERY = {"STOPPING", "RECOVERING", "HEALTH_CHECK", "LAUNCHING", "FAILED"}


async def supervisor_metrics(net: Net | Conn) -> dict[str, float]:
    """The supervisor's /metrics, the samples this generator reads (by their line's name and
    labels as written, job label left out)."""
    try:
        if isinstance(net, Conn):
            _, text = await net.request("GET", "/metrics", 10.0, raw=True)
        else:
            _, text = await net.call("", "GET", "/metrics", 10.0, raw=True)
    except (OSError, TimeoutError):
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(str(text)):
        for sample in family.samples:
            if sample.name == "orchestrator_supervisor_late_seconds_total":
                out["late_s"] = sample.value
            elif sample.name == "orchestrator_heartbeats_total":
                out[f"heartbeats_{sample.labels['door']}"] = sample.value
    return out


async def supervisor_late(net: Net | Conn) -> float | None:
    """orchestrator_supervisor_late_seconds_total: how late the supervisor's loop was."""
    return (await supervisor_metrics(net)).get("late_s")


async def sample_late(net: Net, sup: Supervised, period_s: float = 0.5) -> None:
    """The supervisor's loop lateness over time (``/metrics``, its own connection: the
    journal is not read while the run goes on), to place it in the scenario's phases."""
    conn = net.conn("")
    try:
        while sup.proc.poll() is None:
            late = await supervisor_late(conn)
            if late is not None:
                sup.late.append((time.time(), late))
            await asyncio.sleep(period_s)
    finally:
        conn.close()


def _newer(gen: int | None, than: int | None) -> bool:
    return gen is not None and (than is None or gen > than)


def pick_victim(nodes: list[NodeView], taken: set[str]) -> NodeView:
    """A live node of the running generation, not the one of rank 0, not used before."""
    live = [n for n in nodes if n.alive and n.rank_offset != 0 and n.node_id not in taken]
    live.sort(key=lambda n: n.rank_offset)
    return live[len(live) // 2]


async def scenario(a: argparse.Namespace, net: Net, sup: Supervised,
                   fleet: Fleet) -> dict[str, Any]:
    out: dict[str, Any] = {"faults": [], "reached_running": False}
    if not await wait_state(net, {"RUNNING"}, a.phase_timeout_s * 2, sup):
        return out
    out["reached_running"] = True
    taken: set[str] = set()
    for kind in a.faults:
        await asyncio.sleep(a.settle_s)
        victim = pick_victim(await fleet.nodes(), taken)
        taken.add(victim.node_id)
        _, gen = await job_health(net)
        rank = victim.rank_offset + 1
        fault: dict[str, Any] = {"kind": kind, "node_id": victim.node_id, "rank": rank,
                                 "ts": time.time()}
        await fleet.fault(victim.node_id, "silent" if kind == "node_lost" else kind, rank)
        # A newer generation counts as well as a recovery state: at a few hundred nodes a
        # crash's whole recovery (STOPPING ... RUNNING) fits between two looks at /healthz.
        left = await wait_until(net, sup, a.phase_timeout_s, lambda state, g, g0=gen:
                                state in _RECOVERY or _newer(g, g0))
        if kind == "node_lost":
            # The partition heals: the node beats again, LOST -> REGISTERED.
            await fleet.fault(victim.node_id, "heal", rank)
        back = left and await wait_until(net, sup, a.phase_timeout_s * 2,
                                         lambda state, g, g0=gen: state == "FAILED"
                                         or (state == "RUNNING" and _newer(g, g0)))
        fault["relaunched"] = bool(back) and await job_state(net) == "RUNNING"
        out["faults"].append(fault)
        if not fault["relaunched"]:
            break
    await asyncio.sleep(a.settle_s)
    final = await supervisor_metrics(net)
    sup.late_s = final.get("late_s")
    # Beats the supervisor took by door: its API port, or its heartbeat process.
    out["heartbeats_by_door"] = {k.removeprefix("heartbeats_"): int(v)
                                 for k, v in final.items() if k.startswith("heartbeats_")}
    out["stop_ts"] = time.time()
    try:
        await net.call("", "POST", "/v1/stop", 10.0, json={"reason": "loadgen done"})
    except (OSError, TimeoutError) as exc:
        out["stop_error"] = repr(exc)
    return out


def default_shards(nodes: int) -> int:
    """One agent process per 256 nodes, 1 to 8: a shard's loop then has 256 beats a second
    to send and read, and at most 2,048 assignments of a stop or launch to answer."""
    return max(1, min(8, -(-nodes // 256)))


async def one_run(a: argparse.Namespace, index: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"loadgen-{a.nodes}x{a.procs}-", dir=a.workdir))
    run = root / "run"
    token = secrets.token_hex(16)
    load_before = os.getloadavg()
    sup = Supervised(run, a, token)
    profiler: subprocess.Popen[bytes] | None = None
    fleet: Fleet | None = None
    try:
        net_url = await sup.wait_url(60.0)
        async with Net(net_url, token, Stats()) as net:
            fleet = await Fleet.start(a.shards, url=net_url, token=token,
                                      nodes=a.nodes + a.spares, procs=a.procs,
                                      step_s=a.step_s, stacks=run / "stacks",
                                      beat_timeout_s=max(5.0, 3.0 * a.lost_s),
                                      logs=root / "shards", gc_default=a.gc_default)
            sup.fleet_pids = fleet.pids
            sampler = asyncio.create_task(sup.sample())
            late_sampler = asyncio.create_task(sample_late(net, sup))
            profiler = start_py_spy(a, sup, index)
            try:
                result = await asyncio.wait_for(scenario(a, net, sup, fleet), a.run_timeout_s)
            except TimeoutError:
                result = {"faults": [], "timed_out": True}
            for _ in range(int(a.phase_timeout_s * 10)):
                if sup.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            sampler.cancel()
            late_sampler.cancel()
            stats, own_late, opened = await fleet.finish()
            # Each a TCP accept (and a TLS handshake where the API is https) on the
            # supervisor's loop.
            result["agent_connections_opened"] = opened
    finally:
        if fleet is not None:
            await fleet.close()
        sup.kill()
        if profiler is not None:
            profiler.wait(timeout=60)
    result.update(analyse(run, sup, stats, result, a, own_late))
    per_shard = [sum(s for _, s, j in own_late if j == shard) for shard in range(a.shards)]
    result.update({"shards": a.shards,
                   # How late the simulated agents' loops were (the worst shard): a beat
                   # sent or read late is the network's delay, not the supervisor's.
                   "loadgen_late_s": round(max(per_shard), 2),
                   "loadgen_late_worst_s": round(max((s for _, s, _ in own_late),
                                                     default=0.0), 3),
                   "supervisor_late_s": None if sup.late_s is None else round(sup.late_s, 2),
                   "load_during_max": round(max(sup.load), 2) if sup.load else None,
                   "load_during_mean": round(statistics.fmean(sup.load), 2) if sup.load
                   else None})
    result.update({"run": index, "run_dir": str(run), "supervisor_rc": sup.proc.returncode,
                   "load_before": [round(x, 2) for x in load_before],
                   "load_after": [round(x, 2) for x in os.getloadavg()]})
    return result


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def lost_nodes(envs: list[Any]) -> list[tuple[float, str, str | None]]:
    """Every move of a node to LOST: (ts, node, reason)."""
    return [(e.ts, e.event.node_id, e.event.reason) for e in envs
            if isinstance(e.event, ev.NodeStateChanged) and e.event.state is NodeState.LOST]


def analyse(run: Path, sup: Supervised, stats: Stats, res: dict[str, Any],
            a: argparse.Namespace,
            own_late: list[tuple[float, float, int]] | None = None) -> dict[str, Any]:
    envs = list(read_journal(run / "events.jsonl"))
    start = next((e.ts for e in envs if isinstance(e.event, ev.SupervisorStarted)), sup.started)
    regs = [e.ts for e in envs if isinstance(e.event, ev.NodeRegistered)]
    first_reg: dict[str, float] = {}
    for e in envs:
        if isinstance(e.event, ev.NodeRegistered):
            first_reg.setdefault(e.event.node_id, e.ts)
    trans = [e for e in envs if isinstance(e.event, ev.Transition)]
    running = [e.ts for e in trans if e.event.to.value == "RUNNING"]
    lost = lost_nodes(envs)
    launches = [e.ts for e in envs if isinstance(e.event, ev.GenerationLaunched)]
    victims = {f["node_id"] for f in res.get("faults", []) if f["kind"] == "node_lost"}
    faults = []
    marks = [f["ts"] for f in res.get("faults", [])] + [res.get("stop_ts", float("inf"))]
    for i, f in enumerate(res.get("faults", [])):
        t0, t1 = f["ts"], marks[i + 1]
        stopping = next((e for e in trans if e.ts >= t0 and e.event.to.value == "STOPPING"),
                        None)
        item = {"kind": f["kind"], "node_id": f["node_id"], "rank": f["rank"],
                "relaunched": f["relaunched"],
                "relaunches": sum(1 for t in launches if t0 <= t < t1)}
        if stopping is not None:
            s = stopping.ts
            rec = next((e.ts for e in trans if e.ts >= s and e.event.to.value == "RECOVERING"),
                       None)
            back = next((t for t in running if t >= s), None)
            cause = stopping.event.cause
            item.update({"detected_as": cause.value if cause else None,
                         "detection_s": round(s - t0, 3),
                         "timeout_s": {"hang": a.hang_s, "node_lost": a.lost_s}.get(f["kind"]),
                         "stop_s": None if rec is None else round(rec - s, 3),
                         "relaunch_s": None if back is None else round(back - s, 3)})
        faults.append(item)
    lat = stats.beat_latency
    samples = sup.samples
    cpu_s = samples[-1][1] - samples[0][1] if len(samples) > 1 else None
    wall = samples[-1][0] - samples[0][0] if len(samples) > 1 else None
    ranks_lost = [x for x in lost if x[1] not in victims]
    return {
        "nodes": a.nodes, "procs_per_node": a.procs, "spares": a.spares,
        "registration_s": round(max(first_reg.values()) - start, 3) if first_reg else None,
        "registered": len(first_reg), "node_registered_events": len(regs),
        "running_s": round(running[0] - start, 3) if running else None,
        "heartbeats": len(lat), "heartbeat_drops": stats.beats_failed,
        "heartbeats_late": stats.beats_late,
        "heartbeat_p50_ms": _ms(_pct(lat, 0.5)), "heartbeat_p99_ms": _ms(_pct(lat, 0.99)),
        "heartbeat_max_ms": _ms(max(lat) if lat else None),
        "supervisor_cpu_s": None if cpu_s is None else round(cpu_s, 2),
        "supervisor_cpu_pct": None if not wall else round(100 * cpu_s / wall, 1),
        "loadgen_cpu_pct": round(100 * (sup.own[-1][1] - sup.own[0][1]) / wall, 1)
        if wall else None,
        "supervisor_rss_mb_max": round(max(s[2] for s in samples) / 2**20, 1) if samples
        else None,
        # With api.heartbeat_process: its share, and the two processes together.
        "heartbeat_process_cpu_pct": round(100 * children_cpu_s(sup.kids) / wall, 1)
        if wall else None,
        "supervisor_total_cpu_pct": round(100 * (cpu_s + children_cpu_s(sup.kids)) / wall, 1)
        if wall and cpu_s is not None else None,
        "supervisor_total_rss_mb_max": round(max(s[2] + sum(r for _, r in k.values())
                                                 for s, k in zip(samples, sup.kids,
                                                                 strict=True)) / 2**20, 1)
        if samples else None,
        "journal_events": len(envs),
        "healthy_nodes_lost": len(ranks_lost),
        "healthy_lost_examples": [f"{n}: {r}" for _, n, r in ranks_lost[:5]],
        "lost_events": len(lost),
        "generations_launched": len(launches),
        "stack_files": stats.stack_files, "reregistered_after_404": stats.reregistered_after_404,
        "register_retries": stats.register_retries, "events_failed": stats.events_failed,
        "agent_errors": stats.errors[:10],
        "fault_results": faults,
        **phase_report(envs, stats, sup.late, res, late_ms=a.late_ms,
                       own_late=own_late or []),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("registration_s", "running_s", "heartbeat_p50_ms", "heartbeat_p99_ms",
            "heartbeat_max_ms", "heartbeat_drops", "supervisor_cpu_pct",
            "heartbeat_process_cpu_pct", "supervisor_total_cpu_pct",
            "supervisor_rss_mb_max", "supervisor_total_rss_mb_max", "healthy_nodes_lost", "loadgen_cpu_pct", "loadgen_late_s",
            "supervisor_late_s", "load_during_mean", "load_during_max")
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    for kind in FAULTS:
        for k in ("detection_s", "stop_s", "relaunch_s", "relaunches"):
            vals = [f[k] for r in runs for f in r.get("fault_results", [])
                    if f["kind"] == kind and f.get(k) is not None]
            if vals:
                out[f"{kind}_{k}"] = statistics.median(vals)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--hang-s", type=float, default=10.0, help="training timeout floor")
    ap.add_argument("--lost-s", type=float, default=10.0, help="timeouts.node_lost_s")
    ap.add_argument("--stop-grace-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=5.0, help="RUNNING before each fault")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help="comma-separated, in order: crash, hang, node_lost (or empty)")
    ap.add_argument("--phase-timeout-s", type=float, default=120.0)
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--shards", type=int, default=None,
                    help="processes the simulated agents run in (default: one per 256 "
                    "nodes, 1 to 8)")
    ap.add_argument("--late-ms", type=float, default=100.0,
                    help="a beat answered later than this counts as late, by phase")
    ap.add_argument("--py-spy", default=None, metavar="DIR",
                    help="profile the supervisor with py-spy (speedscope files into DIR)")
    ap.add_argument("--py-spy-rate", type=int, default=100)
    ap.add_argument("--gc-default", action="store_true",
                    help="leave this generator's garbage collection at CPython's defaults")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    type=key_value,
                    help="a supervisor setting over the generator's own (A/B runs of one "
                    "setting)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workdir", default=None, help="where run dirs go (default: $TMPDIR)")
    ap.add_argument("--out", default=None, help="results/<name>.json (default: print only)")
    ap.add_argument("--json", default=None, help="also write the report to this path")
    ap.add_argument("--supervisor-cpus", type=cpu_list, default=None,
                    help="pin the supervisor to these CPUs, taskset -c syntax (e.g. 0-1)")
    ap.add_argument("--loadgen-cpus", type=cpu_list, default=None,
                    help="pin this generator (the simulated agents) to these CPUs (e.g. 2-15)")
    a = ap.parse_args()
    if a.loadgen_cpus:
        os.sched_setaffinity(0, a.loadgen_cpus)
    a.faults = [f for f in a.faults.split(",") if f]
    a.shards = a.shards or default_shards(a.nodes + a.spares)
    if a.shards < 1:
        ap.error("--shards must be at least 1")
    unknown = set(a.faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown fault(s): {sorted(unknown)}")
    wire.check_messages()
    runs = []
    quiet_gc(a.gc_default)
    for i in range(a.runs):
        runs.append(asyncio.run(one_run(a, i)))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "agent_errors"}),
              flush=True)
    report = {**header(a.device), "cpus": os.cpu_count(),
              "affinity": sorted(os.sched_getaffinity(0)),
              "params": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(a).items()
                         if k not in ("out", "json")},
              "runs_done": len(runs), "median": summarize(runs), "runs": runs}
    if a.out:
        print(f"wrote {write(Path(a.out).name, report)}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report["median"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
