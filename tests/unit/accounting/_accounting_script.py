"""Scripted journals with a known timeline, written the way the supervisor writes them."""

from __future__ import annotations

from typing import Any


class Script:
    """Builds journal events and rank 0's step records at chosen times."""

    def __init__(self, nodes: int = 2, steps: int = 100) -> None:
        self.events: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.generation = 0
        self.event(0.0, "job_created", job="t", nodes=nodes, steps=steps, world_size=nodes)
        self.event(0.0, "supervisor_started", resumed=False)

    def event(self, ts: float, kind: str, **fields: Any) -> Script:
        self.events.append({"seq": len(self.events) + 1, "ts": ts, "kind": kind, **fields})
        return self

    def to(self, ts: float, state: str, cause: str | None = None) -> Script:
        return self.event(ts, "transition", to=state, cause=cause,
                          generation=self.generation)

    def nodes_up(self, *times: float) -> Script:
        for i, ts in enumerate(times):
            self.event(ts, "node_registered", node_id=f"n{i}")
        return self

    def launch(self, ts: float, resume_step: int | None = None,
               after: str | None = None) -> Script:
        """LAUNCHING and the generation's launch at ``ts``, RUNNING 0.1 s later."""
        self.to(ts, "LAUNCHING")
        self.generation += 1
        self.event(ts, "generation_launched", generation=self.generation,
                   resume_step=resume_step, after_cause=after)
        return self.to(ts + 0.1, "RUNNING")

    def steps(self, first_step: int, first_ts: float, count: int, every: float = 1.0,
              **extra: dict[int, dict[str, Any]]) -> Script:
        """``count`` records, steps ``first_step``.., ending at ``first_ts`` + k * every;
        ``extra[str(step)]`` adds fields (data_s, ckpt_block_s) to one record."""
        for k in range(count):
            step = first_step + k
            rec = {"generation": self.generation, "step": step, "ts": first_ts + k * every,
                   "loss": 1.0, "step_time": every, "data_s": 0.0, "tokens": 100 * step}
            rec.update(extra.get(f"s{step}", {}))
            self.records.append(rec)
        return self

    def checkpoint(self, ts: float, step: int) -> Script:
        return self.event(ts, "checkpoint_committed", generation=self.generation, step=step,
                          blocking_s=0.0)

    def crash(self, ts: float, exit_ts: float, newest_ckpt: int | None,
              cause: str = "worker_exit", stop_done: float | None = None) -> Script:
        """A rank dies at ``exit_ts``; the supervisor decides at ``ts``, stops the others
        (their SIGTERM exits come after the decision) and journals the failure."""
        if cause == "worker_exit":
            self.event(ts, "rank_exited", generation=self.generation, rank=1,
                       exit_code=None, signal="SIGKILL", exit_ts=exit_ts)
        self.to(ts, "STOPPING", cause)
        done = ts + 0.2 if stop_done is None else stop_done
        self.event(done - 0.1, "rank_exited", generation=self.generation, rank=0,
                   exit_code=None, signal="SIGTERM", exit_ts=done - 0.1)
        self.event(done, "failure", generation=self.generation, cause=cause,
                   newest_checkpoint_step=newest_ckpt)
        return self.to(done, "RECOVERING", cause)

    def start(self, health_from: float = 1.0, nodes_at: tuple[float, ...] = (2.0, 3.0),
              launch_at: float = 4.0) -> Script:
        """PENDING until ``health_from``, nodes register at ``nodes_at``, then launch."""
        self.to(health_from, "HEALTH_CHECK")
        self.nodes_up(*nodes_at)
        return self.launch(launch_at)
