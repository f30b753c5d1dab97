"""Where in a load-generator run the late heartbeats were: by scenario phase, and by second.

A phase is one job state within one part of the scenario: ``start`` (before the first
fault), then each fault's part (from its injection: the rest of RUNNING, STOPPING,
RECOVERING, HEALTH_CHECK, LAUNCHING and the steady RUNNING after the relaunch), then
``final`` (from the operator's stop). Phase boundaries are the journal's transition times
(wall clock, the same machine's); a beat belongs to the phase in which it was sent. Beside
each phase: how many beats were answered later than ``late_ms``, their p99 and max, the
drops, and how late the supervisor's own loop was meanwhile (its
``orchestrator_supervisor_late_seconds_total``, sampled from ``/metrics`` during the run).

``worst_seconds`` lists the seconds of the run with the most late beats, with their phase:
a p99 set by one or two bursts shows there.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from orchestrator.contracts import events as ev


def _phases(envs: list[Any], res: dict[str, Any]) -> list[tuple[float, str]]:
    """(start wall time, name) of each phase, in order."""
    marks = sorted([(f["ts"], f["kind"]) for f in res.get("faults", [])]
                   + ([(res["stop_ts"], "final")] if res.get("stop_ts") else []))
    trans = [(e.ts, e.event.to.value) for e in envs if isinstance(e.event, ev.Transition)]
    start = next((e.ts for e in envs if isinstance(e.event, ev.SupervisorStarted)),
                 trans[0][0] if trans else 0.0)
    points = sorted([(t, "t", state) for t, state in trans]
                    + [(t, "m", kind) for t, kind in marks])
    out: list[tuple[float, str]] = [(start, "start PENDING")]
    part, state = "start", "PENDING"
    for t, what, value in points:
        if what == "m":
            part = value
        else:
            state = value
        out.append((t, f"{part} {state}"))
    return out


def _late_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """The supervisor's lateness counter as last sampled at or before ``t``."""
    if not samples:
        return None
    i = bisect.bisect_right([s[0] for s in samples], t) - 1
    return samples[max(0, i)][1]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def phase_report(envs: list[Any], stats: Any, late_samples: list[tuple[float, float]],
                 res: dict[str, Any], late_ms: float = 100.0,
                 own_late: list[tuple[float, float, int]] | None = None) -> dict[str, Any]:
    """``own_late``: when the generator's loops woke late, by how much, and in which of
    its agent processes (shard): a beat in flight then was answered late as measured here,
    whatever the supervisor did. A phase's ``loadgen_late_s`` is the worst shard's."""
    own = own_late or []

    def own_between(t0: float, t1: float) -> float:
        per: Counter[int] = Counter()
        for t, s, shard in own:
            if t0 <= t < t1:
                per[shard] += s
        return round(max(per.values(), default=0.0), 2)

    phases = _phases(envs, res)
    if not phases:
        return {}
    starts = [t for t, _ in phases]
    limit = late_ms / 1000.0
    per: dict[int, list[float]] = {}
    drops: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    t0 = starts[0]
    for sent, lat in zip(stats.beat_sent, stats.beat_latency, strict=True):
        i = max(0, bisect.bisect_right(starts, sent) - 1)
        per.setdefault(i, []).append(lat)
        if lat > limit:
            seconds[int(sent - t0)] += 1
    for sent in stats.drop_sent:
        drops[max(0, bisect.bisect_right(starts, sent) - 1)] += 1
    end = max([*stats.beat_sent, *stats.drop_sent, starts[-1]])
    rows = []
    total_late = sum(1 for x in stats.beat_latency if x > limit)
    for i, (t, name) in enumerate(phases):
        t_end = starts[i + 1] if i + 1 < len(phases) else end
        lat = per.get(i, [])
        late = [x for x in lat if x > limit]
        a, b = _late_at(late_samples, t), _late_at(late_samples, t_end)
        if not lat and not drops[i] and t_end - t < 0.05:
            continue
        rows.append({"phase": name, "at_s": round(t - t0, 2), "dur_s": round(t_end - t, 2),
                     "beats": len(lat), "late": len(late),
                     "late_share": round(len(late) / total_late, 3) if total_late else 0.0,
                     "p99_ms": None if not lat else round(1000 * (_pct(lat, 0.99) or 0), 1),
                     "max_ms": None if not lat else round(1000 * max(lat), 1),
                     "drops": drops[i],
                     "supervisor_late_s": None if a is None or b is None
                     else round(b - a, 2),
                     "loadgen_late_s": own_between(t, t_end)})
    worst = []
    for sec, n in seconds.most_common(10):
        at = t0 + sec
        i = max(0, bisect.bisect_right(starts, at) - 1)
        a, b = _late_at(late_samples, at), _late_at(late_samples, at + 1.5)
        worst.append({"second": sec, "late_beats": n, "phase": phases[i][1],
                      "supervisor_late_s": None if a is None or b is None else round(b - a, 2),
                      "loadgen_late_s": own_between(at, at + 1.5)})
    return {"late_ms": late_ms, "heartbeats_over_late_ms": total_late,
            "phases": rows, "worst_seconds": worst}
