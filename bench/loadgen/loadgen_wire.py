"""The load generator's side of the wire: credentials and every message it sends.

All of it is here so a protocol change (per-node credentials, stricter models) is adapted in
one file. Messages are built as plain dicts on the hot path (2,048 heartbeats a second would
otherwise cost the generator a core of pydantic), and ``check_messages`` validates one of
each kind against the real models of ``orchestrator.contracts.protocol`` before a run starts: a
message the supervisor would refuse stops the generator at once instead of skewing a run.
Answers (register responses, assignments) are parsed into the protocol's types before use.
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator.contracts.auth import node_credential
from orchestrator.contracts.protocol import (
    Assignment,
    EventBatch,
    Heartbeat,
    RegisterRequest,
    RegisterResponse,
)


def bearer(secret: str, node_id: str) -> str:
    """The token an agent of ``node_id`` sends: its own credential, derived from the job
    secret (``orchestrator.contracts.auth``); with no node id, the operator's (the secret itself).
    Ranks are simulated: their pids are None, so no tool ever signals a made-up pid."""
    return node_credential(secret, node_id) if node_id else secret


def rank_info(rank: int, local_rank: int, pid: int | None, *, alive: bool = True,
              step: int | None = None, phase: str | None = None,
              last_step_ts: float | None = None, beat_ts: float | None = None,
              interval_max: float | None = None, exit_code: int | None = None,
              signal: str | None = None) -> dict[str, Any]:
    return {"rank": rank, "local_rank": local_rank, "pid": pid, "alive": alive,
            "exit_code": exit_code, "signal": signal, "step": step, "phase": phase,
            "last_step_ts": last_step_ts, "beat_ts": beat_ts,
            "step_interval_max": interval_max}


def register(node_id: str, procs: int, pid: int, free_port: int | None,
             generation: int | None, version: int,
             ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node_id": node_id, "host": f"sim-{node_id}", "addr": "127.0.0.1",
            "procs": procs, "agent_pid": pid, "free_port": free_port,
            "generation": generation, "assignment_version": version, "ranks": ranks}


def heartbeat(node_id: str, generation: int | None, free_port: int | None,
              ranks: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node_id": node_id, "generation": generation, "free_port": free_port,
            "ranks": ranks, "records": records}


def step_record(step: int, ts: float, step_s: float, tokens: int) -> dict[str, Any]:
    return {"step": step, "ts": ts, "loss": 2.0 + 1.0 / (step + 1), "grad_norm": 1.0,
            "lr": 1e-3, "tokens": tokens, "step_time": step_s}


def ranks_started(generation: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "ranks_started", "generation": generation, "ranks": ranks,
            "ts": time.time()}


def rank_exit(generation: int, rank: int, pid: int | None, exit_code: int | None,
              signal: str | None, log_tail: list[str]) -> dict[str, Any]:
    return {"type": "rank_exit", "generation": generation, "rank": rank, "pid": pid,
            "exit_code": exit_code, "signal": signal, "ts": time.time(),
            "log_tail": log_tail}


def ranks_stopped(generation: int, free_port: int | None) -> dict[str, Any]:
    return {"type": "ranks_stopped", "generation": generation, "ts": time.time(),
            "free_port": free_port}


def events(node_id: str, batch: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node_id": node_id, "events": batch}


def parse_register_response(data: Any) -> RegisterResponse:
    return RegisterResponse.model_validate(data)


def parse_assignment(data: Any) -> Assignment | None:
    """An empty object is a long-poll that timed out with nothing new."""
    return Assignment.model_validate(data) if data else None


def check_messages() -> None:
    """Validate one message of each kind against the protocol's models (raises if not)."""
    now = time.time()
    infos = [rank_info(r, r, 1000 + r, step=3, phase="training", last_step_ts=now,
                       beat_ts=now, interval_max=0.5) for r in range(2)]
    RegisterRequest.model_validate(register("node-0000", 2, 1, 29500, 1, 2, infos))
    Heartbeat.model_validate(heartbeat("node-0000", 1, None, infos,
                                       [step_record(3, now, 0.5, 4096)]))
    EventBatch.model_validate(events("node-0000", [
        ranks_started(1, infos), rank_exit(1, 0, 1000, None, "SIGTERM", ["x"]),
        ranks_stopped(1, 29501)]))
