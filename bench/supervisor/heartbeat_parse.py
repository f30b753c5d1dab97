"""Heartbeat parsing CPU per message: ``json.loads`` with loose models, the strict models the
server uses, and msgspec for comparison (heartbeat handling is ~15% of the supervisor's CPU
at 512 nodes).

Every variant parses the same bytes, an 8-rank node's heartbeat carrying rank 0's step records
since the last beat, in one process, interleaved round by round, so the figures compare as
ratios measured in one run. ``after`` is what the server does now: ``model_validate_json`` of
the strict model, then the admission check of the node's ranks.

    python bench/supervisor/heartbeat_parse.py [--messages 20000] [--records 2]

Writes ``bench/results/heartbeat-parse-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import header, write  # noqa: E402
from orchestrator.contracts.protocol import Assignment, Heartbeat  # noqa: E402
from orchestrator.supervisor.gateway.admission import Limits, check_heartbeat  # noqa: E402


# -- before: the models as they were (json.loads, then a non-strict model_validate) ------------
class _Loose(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OldRankInfo(_Loose):
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    pid: int | None = None
    alive: bool = True
    exit_code: int | None = None
    signal: str | None = None
    step: int | None = None
    phase: str | None = None
    last_step_ts: float | None = None
    beat_ts: float | None = None
    step_interval_max: float | None = None


class OldHeartbeat(_Loose):
    node_id: str
    generation: int | None = None
    free_port: int | None = Field(None, ge=1, le=65535)
    ranks: list[OldRankInfo] = Field(default_factory=list)
    records: list[dict[str, Any]] = Field(default_factory=list, max_length=100_000)


MsRank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]


class MsRankInfo(msgspec.Struct, forbid_unknown_fields=True):
    rank: MsRank
    local_rank: Annotated[int, msgspec.Meta(ge=0, lt=4096)]
    pid: int | None = None
    alive: bool = True
    exit_code: int | None = None
    signal: str | None = None
    step: Annotated[int, msgspec.Meta(ge=0)] | None = None
    phase: Literal["init", "loading", "compiling", "training", "checkpointing", "evaluating",
                   "finishing"] | None = None
    last_step_ts: float | None = None
    beat_ts: float | None = None
    step_interval_max: Annotated[float, msgspec.Meta(ge=0, le=604800.0)] | None = None


class MsHeartbeat(msgspec.Struct, forbid_unknown_fields=True):
    node_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
    generation: int | None = None
    free_port: int | None = None
    ranks: list[MsRankInfo] = []
    records: list[dict[str, float | int | bool | None | str]] = []


def heartbeat_bytes(ranks: int, records: int) -> bytes:
    now = 1.7e9
    return json.dumps({
        "node_id": "node-17", "generation": 3, "free_port": None,
        "ranks": [{"rank": 8 + i, "local_rank": i, "pid": 4000 + i, "alive": True, "step": 1200,
                   "phase": "training", "last_step_ts": now, "beat_ts": now + 0.1,
                   "step_interval_max": 0.42} for i in range(ranks)],
        "records": [{"step": 1199 + j, "ts": now - 0.4 * j, "loss": 2.345, "grad_norm": 0.87,
                     "lr": 3e-4, "tokens": 4_915_200 + j * 4096, "batch": 1199 + j,
                     "data_s": 0.0012, "step_time": 0.41} for j in range(records)],
    }).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--records", type=int, default=2, help="step records a beat carries")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    raw = heartbeat_bytes(args.ranks, args.records)
    assignment = Assignment(version=4, action="run", generation=3, node_rank=1,
                            nproc=args.ranks, world_size=4 * args.ranks, rank_offset=args.ranks)
    limits = Limits(world_size=4 * args.ranks, max_step_interval_s=3600.0, max_nodes=4096)

    def after(b: bytes) -> Any:
        hb = Heartbeat.model_validate_json(b)
        assert check_heartbeat("node-17", hb, assignment, limits) is None
        return hb

    variants: dict[str, Callable[[bytes], Any]] = {
        "before: json.loads + loose pydantic": lambda b: OldHeartbeat.model_validate(
            json.loads(b)),
        "after: strict pydantic from bytes + admission": after,
        "strict pydantic from bytes (parse only)": Heartbeat.model_validate_json,
    }
    variants["msgspec Struct (parse only; standard JSON, so no NaN loss)"] = \
        msgspec.json.Decoder(MsHeartbeat).decode
    for fn in variants.values():
        fn(raw)  # warm up, and every variant accepts the message
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.process_time()
            for _ in range(args.messages):
                fn(raw)
            samples[name].append((time.process_time() - t0) / args.messages * 1e6)
    base = statistics.median(samples["before: json.loads + loose pydantic"])
    results = {name: {"cpu_us_per_message_median": round(statistics.median(s), 2),
                      "cpu_us_per_message_min": round(min(s), 2),
                      "ratio_to_before": round(statistics.median(s) / base, 3)}
               for name, s in samples.items()}
    report = {**header(), "benchmark": "heartbeat_parse", "message_bytes": len(raw),
              "ranks_per_message": args.ranks, "records_per_message": args.records,
              "messages_per_round": args.messages, "rounds": args.rounds,
              "clock": "process CPU time (time.process_time), so a shared machine's load "
                       "does not count", "results": results}
    path = write("heartbeat-parse-cpu.json", report)
    print(json.dumps(results, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
