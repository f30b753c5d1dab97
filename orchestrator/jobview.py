"""A job's state as folded from its journal: what the supervisor rebuilds and ``status`` shows.

One owner for "what does the journal say": the live supervisor applies each event it writes,
a restarted supervisor replays the file, and ``orchestrator status`` replays it too, so all
three always agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.state import JobState


def _tier_of(path: str | None) -> str:
    """Events written before tiers existed name no tier: a URL is remote, a path local."""
    return "remote" if path and "://" in path and not path.startswith("file://") else "local"


@dataclass
class NodeView:
    node_id: str
    host: str = ""
    state: str = "registered"
    node_rank: int | None = None
    agent_pid: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class JobView:
    """The fold of a journal. ``apply`` takes events in journal order."""

    job: str = ""
    run_dir: str = ""
    config_hash: str = ""
    world_size: int = 0
    total_steps: int = 0
    checkpoint_root: str = ""
    state: JobState = JobState.PENDING
    generation: int = 0
    created_ts: float | None = None
    ended_ts: float | None = None
    last_ts: float | None = None
    last_step: int = 0
    tokens: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    pruned: set[tuple[int, str]] = field(default_factory=set)  # (step, tier)
    nodes: dict[str, NodeView] = field(default_factory=dict)
    chaos_fired: set[str] = field(default_factory=set)
    launches: list[dict[str, Any]] = field(default_factory=list)
    supervisor_starts: list[dict[str, Any]] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    skip_windows: list[list[int]] = field(default_factory=list)
    lr_scale: float = 1.0
    stability_events: int = 0
    stability_counts: dict[str, int] = field(default_factory=dict)
    divergence: dict[str, Any] | None = None  # a rollback asked for and not yet carried out
    last_failure_reason: str | None = None
    health: list[dict[str, Any]] = field(default_factory=list)
    first_steps: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Iterable[dict[str, Any]]) -> JobView:
        view = cls()
        for event in events:
            view.apply(event)
        return view

    # -- folding ---------------------------------------------------------------------------
    def apply(self, e: dict[str, Any]) -> None:
        kind = e.get("kind")
        self.last_ts = e.get("ts", self.last_ts)
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(e)

    def _on_job_created(self, e: dict[str, Any]) -> None:
        self.job = e.get("job", "")
        self.run_dir = e.get("run_dir", "")
        self.config_hash = e.get("config_hash", "")
        self.world_size = e.get("world_size", 0)
        self.total_steps = e.get("steps", 0)
        self.checkpoint_root = e.get("checkpoint_root", "")
        self.created_ts = e.get("ts")

    def _on_supervisor_started(self, e: dict[str, Any]) -> None:
        self.supervisor_starts.append({"ts": e.get("ts"), "pid": e.get("pid"),
                                       "resumed": e.get("resumed", False)})

    def _on_transition(self, e: dict[str, Any]) -> None:
        self.state = JobState(e["to"])
        if self.state.terminal:
            self.ended_ts = e.get("ts")
            if self.state is JobState.FAILED:
                self.last_failure_reason = e.get("reason")

    def _on_node_registered(self, e: dict[str, Any]) -> None:
        node = self.nodes.setdefault(e["node_id"], NodeView(e["node_id"]))
        node.host = e.get("host", node.host)
        node.agent_pid = e.get("agent_pid", node.agent_pid)
        node.history.append({"ts": e.get("ts"), "event": "registered"})

    def _on_node_state(self, e: dict[str, Any]) -> None:
        node = self.nodes.setdefault(e["node_id"], NodeView(e["node_id"]))
        node.state = e["state"]
        if "node_rank" in e:
            node.node_rank = e["node_rank"]
        node.history.append({"ts": e.get("ts"), "event": e["state"],
                             "reason": e.get("reason")})

    def _on_generation_launched(self, e: dict[str, Any]) -> None:
        self.generation = e["generation"]
        self.launches.append(e)
        if self.generation > 1:
            self.restarts.append({"generation": self.generation, "ts": e.get("ts"),
                                  "cause": e.get("after_cause"),
                                  "resume_step": e.get("resume_step")})

    def _on_failure(self, e: dict[str, Any]) -> None:
        self.failures.append({k: v for k, v in e.items() if k not in ("seq", "kind")})
        node = self.nodes.get(e.get("node_id") or "")
        if node is not None:
            node.history.append({"ts": e.get("ts"), "event": "failure",
                                 "reason": f"{e.get('cause')}: {e.get('message')}"})

    def _on_checkpoint_committed(self, e: dict[str, Any]) -> None:
        tier = e.get("tier") or _tier_of(e.get("path"))
        self.checkpoints = [c for c in self.checkpoints
                            if (c["step"], c["tier"]) != (e["step"], tier)]
        self.checkpoints.append({"step": e["step"], "path": e.get("path"), "tier": tier,
                                 "tokens": e.get("tokens"), "ts": e.get("ts"),
                                 "generation": e.get("generation")})
        self.checkpoints.sort(key=lambda c: (c["step"], c["tier"]))
        self.pruned.discard((e["step"], tier))  # saved again after a rollback pruned it
        if (e["step"], "*") in self.pruned:
            self.pruned.discard((e["step"], "*"))
            self.pruned.update((e["step"], t) for t in ("local", "remote") if t != tier)

    def _on_checkpoint_pruned(self, e: dict[str, Any]) -> None:
        # No tier named: pruned everywhere ("*"), e.g. a rollback discarding its lineage.
        tiers = [e["tier"]] if e.get("tier") else ["*"]
        self.pruned.update((s, t) for s in e.get("steps", []) for t in tiers)

    def _on_first_step(self, e: dict[str, Any]) -> None:
        self.first_steps[e["generation"]] = e["step"]

    def _on_progress(self, e: dict[str, Any]) -> None:
        self.last_step = e.get("step", self.last_step)
        self.tokens = e.get("tokens", self.tokens)

    def _on_chaos(self, e: dict[str, Any]) -> None:
        self.chaos_fired.add(str(e["id"]))

    def _on_calibration(self, e: dict[str, Any]) -> None:
        self.calibration = {k: v for k, v in e.items() if k not in ("seq", "kind", "ts")}

    def _on_rollback(self, e: dict[str, Any]) -> None:
        self.rollbacks.append({k: v for k, v in e.items() if k not in ("seq", "kind")})
        window = e.get("skip_window")
        if window:
            self.skip_windows.append(list(window))
        self.lr_scale = e.get("lr_scale_total", self.lr_scale)
        self.divergence = None

    def _on_stability(self, e: dict[str, Any]) -> None:
        self.stability_events += 1
        kind = str(e.get("event", "?"))
        self.stability_counts[kind] = self.stability_counts.get(kind, 0) + 1
        # The first rollback-action firing of a generation is the one the supervisor acts on.
        first = self.divergence is None or self.divergence.get("generation") != e.get("generation")
        if e.get("action") in ("rollback", "lower_lr") and first:
            self.divergence = {k: v for k, v in e.items() if k not in ("seq", "kind")}

    def _on_health(self, e: dict[str, Any]) -> None:
        self.health.append({k: v for k, v in e.items() if k not in ("seq", "kind")})

    # -- derived -----------------------------------------------------------------------------
    @property
    def pruned_steps(self) -> set[int]:
        """Steps pruned from some tier (a rollback prunes every tier of a discarded step)."""
        return {step for step, _ in self.pruned}

    @property
    def committed_checkpoints(self) -> list[dict[str, Any]]:
        """Checkpoints committed and not pruned since, one entry per step (oldest first) with
        the tiers holding it: ``tier`` is "local", "remote" or "local+remote", ``paths`` maps
        each tier to its URL, and ``path`` is the copy a restart prefers (the local one)."""
        by_step: dict[int, dict[str, Any]] = {}
        for c in self.checkpoints:
            if (c["step"], c["tier"]) in self.pruned or (c["step"], "*") in self.pruned:
                continue
            entry = by_step.setdefault(c["step"], {**c, "paths": {}})
            entry["paths"][c["tier"]] = c["path"]
            if c["ts"] is not None and (entry["ts"] is None or c["ts"] < entry["ts"]):
                entry["ts"] = c["ts"]  # when the step was first committed anywhere
        for entry in by_step.values():
            tiers = sorted(entry["paths"])
            entry["tier"] = "+".join(tiers)
            entry["path"] = entry["paths"].get("local", entry["paths"][tiers[0]])
        return [by_step[s] for s in sorted(by_step)]

    @property
    def newest_checkpoint_step(self) -> int | None:
        live = self.committed_checkpoints
        return live[-1]["step"] if live else None

    def restarts_without_progress(self) -> int:
        """Failures in a row, counted back from the newest, with no new checkpoint between.

        A failure made "progress" when a checkpoint newer than the one available at the
        previous failure was committed before it.
        """
        count = 0
        steps_at_failure = [f.get("newest_checkpoint_step") for f in self.failures]
        for i in range(len(steps_at_failure) - 1, -1, -1):
            previous = steps_at_failure[i - 1] if i > 0 else None
            current = steps_at_failure[i]
            if i > 0 and (current or -1) > (previous or -1):
                break
            if i == 0 and current is not None:
                break
            count += 1
        return count

    def cause_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.failures:
            counts[f.get("cause", "?")] = counts.get(f.get("cause", "?"), 0) + 1
        return counts
