"""Restart policy (tenacity backoff, budget, no-progress rule) and node placement."""

from __future__ import annotations

from orchestrator.config.schema import ChaosConfig, KillSpec, RestartConfig
from orchestrator.journal.view import JobView
from orchestrator.contracts.protocol import RegisterRequest
from orchestrator.contracts.state import NodeState
from orchestrator.contracts.chaos import ChaosDriver
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.placement import place
from orchestrator.supervisor.policy import RestartPolicy


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t


def test_backoff_grows_exponentially_and_is_capped() -> None:
    p = RestartPolicy(RestartConfig(backoff_initial_s=1, backoff_multiplier=2, backoff_max_s=5))
    assert [p.backoff(n) for n in (1, 2, 3, 4, 10)] == [1, 2, 4, 5, 5]


def _view(n_failures: int, restarts: int, newest: list[int | None]) -> JobView:
    # As the supervisor journals them: a restart carries the cause of the failure before it.
    events = [{"kind": "generation_launched", "generation": g + 1,
               "after_cause": "worker_exit" if g else None} for g in range(restarts + 1)]
    events += [{"kind": "failure", "cause": "worker_exit", "newest_checkpoint_step": s}
               for s in newest[:n_failures]]
    return JobView.from_events(events)


def test_policy_restarts_within_budget_and_resets_backoff_on_progress() -> None:
    p = RestartPolicy(RestartConfig(max_restarts=5, max_restarts_without_progress=2,
                                    backoff_initial_s=1))
    d = p.decide(_view(3, 2, [10, 20, 30]))
    assert d.restart and d.delay_s == 1  # progress each time: back to the initial delay
    d = p.decide(_view(3, 2, [None, None, None]))
    assert not d.restart and "2 restarts in a row" in d.reason
    d = p.decide(_view(2, 1, [None, None]))
    assert d.restart and d.delay_s == 2
    d = p.decide(_view(6, 5, [1, 2, 3, 4, 5, 6]))
    assert not d.restart and "budget" in d.reason


def _register(reg: NodeRegistry, node_id: str) -> None:
    reg.register(RegisterRequest(node_id=node_id, host="h", addr="127.0.0.1", procs=1,
                                 agent_pid=1))


def test_placement_keeps_ranks_and_fills_from_spares() -> None:
    reg = NodeRegistry(FakeClock())
    for i in range(4):
        _register(reg, f"n-{i}")
    first = place(list(reg.nodes.values()), 3, 1)
    assert first.active == {"n-0": 0, "n-1": 1, "n-2": 2} and first.spares == ["n-3"]
    for node_id, rank in first.active.items():
        reg.nodes[node_id].state, reg.nodes[node_id].node_rank = NodeState.ACTIVE, rank
    reg.nodes["n-3"].state = NodeState.SPARE
    reg.nodes["n-1"].state = NodeState.LOST
    second = place(list(reg.nodes.values()), 3, 1)
    assert second.active == {"n-0": 0, "n-3": 1, "n-2": 2}  # the spare takes rank 1
    assert second.complete
    reg.nodes["n-3"].state = NodeState.EXCLUDED
    third = place(list(reg.nodes.values()), 3, 1)
    assert third.missing == 1


def test_placement_orders_numeric_ids_numerically() -> None:
    reg = NodeRegistry(FakeClock())
    for i in (10, 9, 2):
        _register(reg, f"local-{i}")
    assert place(list(reg.nodes.values()), 2, 1).active == {"local-2": 0, "local-9": 1}


def test_chaos_step_kills_fire_once_and_resolve_random_ranks_from_the_seed() -> None:
    cfg = ChaosConfig(kill=[KillSpec(step=5), KillSpec(step=9, rank=1)], seed=3)
    a = ChaosDriver(cfg, world_size=4, fired=set())
    b = ChaosDriver(cfg, world_size=4, fired=set())
    assert a.pending() == b.pending()  # a restarted supervisor resolves the same ranks
    assert [k.id for k in a.pending()] == ["kill-0", "kill-1"]
    a.mark_fired("kill-0")
    assert [k.id for k in a.pending()] == ["kill-1"]
    c = ChaosDriver(cfg, world_size=4, fired={"kill-0", "kill-1"})
    assert c.pending() == []


def test_chaos_interval_kills() -> None:
    d = ChaosDriver(ChaosConfig(kill_interval_s=10), world_size=2, fired=set())
    assert d.due_interval(None, 0.0) == []
    assert d.due_interval(0.0, 5.0) == []
    first = d.due_interval(0.0, 10.5)
    assert len(first) == 1 and first[0].id == "interval-1"
    assert d.due_interval(0.0, 15.0) == []
    assert d.due_interval(0.0, 21.0)[0].id == "interval-2"
