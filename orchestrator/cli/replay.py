"""``orchestrator stability replay``: the detectors over a file of step records.

Operators tune thresholds on a past run: ``orchestrator stability replay runs/latest/steps.jsonl
--set grad_spike.margin=0.2`` prints, one JSON object a line, every event those thresholds
would have raised. The records go through the same ``LineageMonitor`` as in the live supervisor,
so a run directory's ``steps.jsonl`` (several generations, redone steps after restarts and
rollbacks) replays to the events the supervisor journaled.

Output: ``kind``, ``step``, ``rule``, ``action`` and the figures behind the decision, with the
study's short names for the two central ones: ``g`` (the grad norm) and ``r`` (the running mean
it was compared with); ``threshold``, ``length``, ``ratio``, ``onset_step`` and the rest keep
their names. Non-finite figures are the strings "nan", "inf", "-inf".
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from orchestrator.contracts import readback
from orchestrator.config.loader import ConfigError, Problem, apply_overrides, read_yaml
from stability.config import StabilityConfig
from stability.lineage import LineageMonitor

_SHORT_NAMES = {"grad_norm": "g", "running_mean": "r"}


def load_replay_config(path: Path | None,
                       overrides: list[str]) -> tuple[StabilityConfig, int | None]:
    """The stability section of ``path`` (a job config, or just the section) with overrides.

    ``--set`` keys may be given with or without the ``stability.`` prefix. Returns the config
    and the job's checkpoint interval (None when the file has none). Raises ConfigError.
    """
    data: dict[str, Any] = read_yaml(path) if path is not None else {}
    job = "stability" in data
    section = data.get("stability") if job else data
    if section is not None and not isinstance(section, dict):
        raise ConfigError(str(path), [Problem("stability", "must be a mapping")])
    keys = [o if o.startswith("stability.") else f"stability.{o}" for o in overrides]
    merged = apply_overrides({"stability": section or {}}, keys)["stability"]
    try:
        config = StabilityConfig.model_validate(merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            where = ".".join(["stability", *(str(p) for p in err["loc"])])
            message = "unknown key (not in the schema)" if err["type"] == "extra_forbidden" \
                else err["msg"]
            problems.append(Problem(where, message))
        raise ConfigError(str(path or "--set"), problems) from None
    interval = None
    if job and isinstance(data.get("checkpoint"), dict):
        value = data["checkpoint"].get("interval_steps")
        interval = value if isinstance(value, int) and value > 0 else None
    return config, interval


def replay_lines(lines: Iterable[str], config: StabilityConfig,
                 checkpoint_every: int | None = None,
                 lineage: LineageMonitor | None = None) -> Iterator[dict[str, Any]]:
    """One output object per event raised over the JSONL ``lines``.

    A record's ``generation`` (as ``steps.jsonl`` writes it) selects its lineage; records
    without one are one generation. Raises ValueError naming the 1-based line of a bad record.
    """
    monitor = lineage or LineageMonitor(config, checkpoint_every=checkpoint_every)
    # As the live supervisor does: once a rollback is decided in a generation, what that
    # generation's later records fire is the abandoned lineage's, never journaled.
    decided: set[int] = set()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = readback.loads_object(line, readback.STEPS)
        except readback.Unreadable as exc:
            raise ValueError(f"line {lineno}: invalid JSON: {exc}") from None
        if "ts" in record and set(record) <= {"step", "ts", "generation"}:
            continue  # the preload hook's {step, ts}: a step, nothing to judge
        generation = record.get("generation") or 0
        if isinstance(generation, bool) or not isinstance(generation, int) \
                or not 0 <= generation <= 1 << 31:
            raise ValueError(f"line {lineno}: generation {str(generation)[:40]!r} is not one")
        try:
            events = monitor.feed(record, generation)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"line {lineno}: {exc}") from None
        if generation in decided:
            continue
        for event in events:
            yield {_SHORT_NAMES.get(k, k): v for k, v in event.to_dict().items()}
        if any(event.action in ("rollback", "lower_lr") for event in events):
            decided.add(generation)


def _default_config(records: Path) -> Path | None:
    # A run directory's steps.jsonl replays with that run's own thresholds unless told otherwise.
    beside = records.parent / "config.yaml"
    return beside if records.name == "steps.jsonl" and beside.is_file() else None


def run_replay(records: Path, config: Path | None, overrides: list[str],
               out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The command: 0 when the file replayed, 2 on a bad file or config."""
    out, err = out or sys.stdout, err or sys.stderr
    source = config or _default_config(records)
    try:
        cfg, interval = load_replay_config(source, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=err)
        return 2
    print(f"stability config: {source or 'built-in defaults'}"
          + (f" with {len(overrides)} override(s)" if overrides else ""), file=err)
    lineage = LineageMonitor(cfg, checkpoint_every=interval)
    count = 0
    try:
        with open(records, encoding="utf-8") as f:
            for event in replay_lines(f, cfg, lineage=lineage):
                out.write(json.dumps(event, allow_nan=False) + "\n")
                count += 1
    except BrokenPipeError:  # `| head` has read enough: stop quietly, as cat does
        _silence(out)
        return 0
    except OSError as exc:
        print(f"error: {records}: {exc.strerror or exc}", file=err)
        return 2
    except ValueError as exc:
        print(f"error: {records}: {exc}", file=err)
        return 2
    s = lineage.monitor.summary()
    print(f"{count} event(s); through step {lineage.last_step}: {s['spikes_total'] or 0} "
          f"grad-norm spike(s), longest {s['longest_spike'] or 0} step(s), growth ratio "
          f"{_fmt(s['growth_ratio'])}", file=err)
    return 0


def _silence(out: TextIO) -> None:
    """Point ``out``'s descriptor at /dev/null so the interpreter's final flush of the closed
    pipe does not print "Broken pipe" either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # not a real descriptor (a test's StringIO): nothing will flush it


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
