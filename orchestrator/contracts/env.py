"""Every ``ORCH_*`` environment variable, built and parsed in one place.

Writers (the supervisor for a generation, the agent for its node, launchers for the agent's
token) call a builder; readers (the worker SDK, the trainer, the agent, the health check)
call a parser. A value that does not parse is an :class:`EnvError` naming the variable, never
a silent default: a rank told a wrong generation or a wrong skip window must not train on.

This module imports only the standard library: the worker SDK and the preload hook import it
in every rank.

=============================  ==============  ==================================================
variable                       written by      meaning
=============================  ==============  ==================================================
ORCH_TOKEN                     launcher        control-API token (agents only; ranks never see it)
ORCH_AGENT_SOCKET              agent           unix socket of the node agent (a rank is managed)
ORCH_CONFIG                    agent           the job's resolved config (JSON file)
ORCH_NODE_ID                   agent           this node's id
ORCH_HEARTBEAT_INTERVAL        agent           seconds between a rank's heartbeats
ORCH_RUN_DIR                   agent           the run directory (stacks, errors, logs)
ORCH_JOB                       supervisor      job name
ORCH_GENERATION                supervisor      generation number (1 = first launch)
ORCH_CHECKPOINT_ROOT           supervisor      checkpoint root of the job
ORCH_SKIP_WINDOWS              supervisor      JSON ``[[start, end], ...]`` data to skip
ORCH_LR_SCALE                  supervisor      learning-rate multiplier after a rollback
ORCH_RESUME_MAX_STEP           supervisor      newest step a restore may use ('' = no limit)
ORCH_COLLECTIVE_TIMEOUT_S      supervisor      collective timeout, just above the hang timeout
ORCH_CHAOS                     supervisor      fault injection (JSON object)
ORCH_IN_JOB_WAIT_S             supervisor      in-job recovery on: how long a rank whose
                                               collective failed waits for the order
ORCH_LINEAGE                   supervisor      ``{"run": id, "lineage": [[generation, resume
                                               step], ...]}``: the fencing token's history
ORCH_HEALTH_NET                agent           the network check's spec (JSON object)
ORCH_HEALTH_OUT                agent           where the network check writes its report
ORCH_WARM_HANDOFF_TS           warm spare      wall time a spare was handed its rank
ORCH_REPLACEMENT               agent           '1': the rank replaces a failed one in place
ORCH_HOOK_PID                  preload hook    pid of the rank the hook serves (children skip)
ORCH_MEMORY_DIR                agent           the node's memory-tier directory
ORCH_TLS_CA                    launcher        CA bundle an agent verifies an https supervisor
                                               with (default: the system's trust store)
ORCH_CHECKPOINT_KEY            operator        checkpoint signing key itself (never journaled;
                                               agents only: ranks never see it)
ORCH_CHECKPOINT_KEY_FILE       supervisor      path of the checkpoint signing key file
                                               (agents only: ranks never see it)
ORCH_NODE_COUNT                deploy          pods of the agents' Indexed Job (nodes + spares)
=============================  ==============  ==================================================
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from orchestrator.contracts.chaos import ChaosPlan

TOKEN = "ORCH_TOKEN"
AGENT_SOCKET = "ORCH_AGENT_SOCKET"
CONFIG = "ORCH_CONFIG"
NODE_ID = "ORCH_NODE_ID"
HEARTBEAT_INTERVAL = "ORCH_HEARTBEAT_INTERVAL"
RUN_DIR = "ORCH_RUN_DIR"
JOB = "ORCH_JOB"
GENERATION = "ORCH_GENERATION"
CHECKPOINT_ROOT = "ORCH_CHECKPOINT_ROOT"
SKIP_WINDOWS = "ORCH_SKIP_WINDOWS"
LR_SCALE = "ORCH_LR_SCALE"
RESUME_MAX_STEP = "ORCH_RESUME_MAX_STEP"
COLLECTIVE_TIMEOUT_S = "ORCH_COLLECTIVE_TIMEOUT_S"
CHAOS = "ORCH_CHAOS"
IN_JOB_WAIT_S = "ORCH_IN_JOB_WAIT_S"
LINEAGE = "ORCH_LINEAGE"
HEALTH_NET = "ORCH_HEALTH_NET"
HEALTH_OUT = "ORCH_HEALTH_OUT"
WARM_HANDOFF_TS = "ORCH_WARM_HANDOFF_TS"
REPLACEMENT = "ORCH_REPLACEMENT"
HOOK_PID = "ORCH_HOOK_PID"
MEMORY_DIR = "ORCH_MEMORY_DIR"
CHECKPOINT_KEY = "ORCH_CHECKPOINT_KEY"  # read by trainer.checkpoint.signing
CHECKPOINT_KEY_FILE = "ORCH_CHECKPOINT_KEY_FILE"  # read by trainer.checkpoint.signing
# Written into the agent pods by `orchestrator deploy kubernetes`; read by orchestrator.allocation.
NODE_COUNT = "ORCH_NODE_COUNT"
TLS_CA = "ORCH_TLS_CA"  # read by orchestrator.agent.client

# Every name above; tests/unit/test_vocabulary.py keeps it complete.
ALL = (TOKEN, AGENT_SOCKET, CONFIG, NODE_ID, HEARTBEAT_INTERVAL, RUN_DIR, JOB, GENERATION,
       CHECKPOINT_ROOT, SKIP_WINDOWS, LR_SCALE, RESUME_MAX_STEP, COLLECTIVE_TIMEOUT_S, CHAOS,
       IN_JOB_WAIT_S, HEALTH_NET, HEALTH_OUT, WARM_HANDOFF_TS, REPLACEMENT, HOOK_PID,
       MEMORY_DIR, CHECKPOINT_KEY, CHECKPOINT_KEY_FILE, NODE_COUNT, LINEAGE, TLS_CA)

DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
_MAX_LEN = 1 << 20  # a JSON value past 1 MiB in the environment is a bug, not a config


class EnvError(ValueError):
    """An environment variable that does not parse; the message names it."""

    def __init__(self, name: str, value: str, expected: str) -> None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        super().__init__(f"{name}={shown!r}: expected {expected}")
        self.name = name


# -- typed readers -------------------------------------------------------------------------
def get_int(env: Mapping[str, str], name: str, default: int | None = None, *,
            minimum: int | None = None) -> int | None:
    raw = env.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise EnvError(name, raw, "an integer") from None
    if minimum is not None and value < minimum:
        raise EnvError(name, raw, f"an integer >= {minimum}")
    return value


def get_float(env: Mapping[str, str], name: str, default: float | None = None, *,
              positive: bool = False) -> float | None:
    raw = env.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise EnvError(name, raw, "a number") from None
    if not math.isfinite(value) or (positive and value <= 0):
        raise EnvError(name, raw, "a finite number > 0" if positive else "a finite number")
    return value


def get_str(env: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    raw = env.get(name, "")
    return raw if raw != "" else default


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python-only extensions


def _json(env: Mapping[str, str], name: str, default: str, expected: str) -> Any:
    raw = env.get(name, "")
    if raw.strip() == "":
        raw = default
    if len(raw) > _MAX_LEN:
        raise EnvError(name, raw, f"{expected} under {_MAX_LEN} characters")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise EnvError(name, raw, expected) from None


def get_json_object(env: Mapping[str, str], name: str) -> dict[str, Any]:
    value = _json(env, name, "{}", "a JSON object")
    if not isinstance(value, dict):
        raise EnvError(name, env.get(name, ""), "a JSON object")
    return value


def get_chaos(env: Mapping[str, str], name: str = CHAOS) -> ChaosPlan:
    """The generation's fault-injection plan (``orchestrator.contracts.chaos.ChaosPlan``)."""
    try:
        return ChaosPlan.parse(env.get(name, "") or "{}")
    except ValidationError as exc:
        raise EnvError(name, env.get(name, ""), f"a chaos plan ({exc.errors()[0]['loc']}: "
                                                f"{exc.errors()[0]['msg']})") from None


def get_windows(env: Mapping[str, str], name: str = SKIP_WINDOWS) -> list[tuple[int, int]]:
    """``[[start, end], ...]`` with integer ``0 <= start <= end``."""
    expected = "a JSON list of [start, end] integer pairs with 0 <= start <= end"
    value = _json(env, name, "[]", expected)
    out: list[tuple[int, int]] = []
    if not isinstance(value, list):
        raise EnvError(name, env.get(name, ""), expected)
    for w in value:
        ok = (isinstance(w, list) and len(w) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in w)
              and 0 <= w[0] <= w[1])
        if not ok:
            raise EnvError(name, env.get(name, ""), expected)
        out.append((w[0], w[1]))
    return out


_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def get_lineage(env: Mapping[str, str], name: str = LINEAGE,
                ) -> tuple[str | None, list[tuple[int, int]]]:
    """``(run id, [(generation, resume step or -1), ...])``; ``(None, [])`` when unset."""
    expected = ('{"run": id, "lineage": [[generation >= 0, step >= -1], ...]} with an id of '
                "1-64 of A-Z a-z 0-9 _ . -")
    if env.get(name, "").strip() == "":
        return None, []
    value = _json(env, name, "{}", expected)
    ok = isinstance(value, dict) and set(value) == {"run", "lineage"} \
        and isinstance(value["run"], str) and _RUN_ID.match(value["run"]) \
        and isinstance(value["lineage"], list)
    pairs: list[tuple[int, int]] = []
    for item in value["lineage"] if ok else []:
        if not (isinstance(item, list) and len(item) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
                and item[0] >= 0 and item[1] >= -1):
            ok = False
            break
        pairs.append((item[0], item[1]))
    if not ok:
        raise EnvError(name, env.get(name, ""), expected)
    return value["run"], pairs


# -- the supervisor's part: what one generation's ranks are told ---------------------------
@dataclass(frozen=True)
class GenerationEnv:
    """What a generation's ranks need beyond torch.distributed's variables."""

    job: str = "job"
    generation: int = 0
    checkpoint_root: str | None = None
    skip_windows: list[tuple[int, int]] = field(default_factory=list)
    lr_scale: float = 1.0
    resume_max_step: int | None = None  # 0 is a limit too (start afresh)
    collective_timeout_s: float | None = None
    chaos: ChaosPlan = field(default_factory=ChaosPlan)
    # In-job recovery (``restart.in_job``): set, a rank whose collective fails waits this
    # long for the agent's order to rejoin in place; None: it exits (a full restart).
    in_job_wait_s: float | None = None
    run_id: str | None = None  # the fencing token's run (``trainer.checkpoint.fence``)
    lineage: list[tuple[int, int]] = field(default_factory=list)

    def to_env(self) -> dict[str, str]:
        env = {
            JOB: self.job,
            GENERATION: str(self.generation),
            SKIP_WINDOWS: json.dumps([list(w) for w in self.skip_windows]),
            LR_SCALE: repr(float(self.lr_scale)),
            RESUME_MAX_STEP: "" if self.resume_max_step is None else str(self.resume_max_step),
            CHAOS: self.chaos.to_json(),
        }
        if self.checkpoint_root is not None:
            env[CHECKPOINT_ROOT] = self.checkpoint_root
        if self.collective_timeout_s is not None:
            env[COLLECTIVE_TIMEOUT_S] = str(round(self.collective_timeout_s, 1))
        if self.in_job_wait_s is not None:
            env[IN_JOB_WAIT_S] = str(round(self.in_job_wait_s, 1))
        if self.run_id is not None:
            env[LINEAGE] = json.dumps({"run": self.run_id,
                                       "lineage": [list(p) for p in self.lineage]})
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GenerationEnv:
        lr = get_float(env, LR_SCALE, 1.0)
        if lr is not None and lr < 0:
            raise EnvError(LR_SCALE, env[LR_SCALE], "a finite number >= 0")
        run_id, lineage = get_lineage(env)
        return cls(
            job=get_str(env, JOB, "job") or "job",
            generation=get_int(env, GENERATION, 0, minimum=0) or 0,
            checkpoint_root=get_str(env, CHECKPOINT_ROOT),
            skip_windows=get_windows(env),
            lr_scale=1.0 if lr is None else lr,
            resume_max_step=get_int(env, RESUME_MAX_STEP, None, minimum=0),
            collective_timeout_s=get_float(env, COLLECTIVE_TIMEOUT_S, None, positive=True),
            chaos=get_chaos(env),
            in_job_wait_s=get_float(env, IN_JOB_WAIT_S, None, positive=True),
            run_id=run_id, lineage=lineage,
        )


# -- the agent's part: how a rank reaches its node agent -----------------------------------
@dataclass(frozen=True)
class AgentEnv:
    """What the node agent tells each of its ranks (and its health-check ranks)."""

    agent_socket: str | None = None
    config_path: str | None = None
    node_id: str | None = None
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    run_dir: str | None = None
    memory_dir: str | None = None  # set when the memory tier is on

    @property
    def managed(self) -> bool:
        return bool(self.agent_socket)

    def to_env(self) -> dict[str, str]:
        env = {HEARTBEAT_INTERVAL: repr(float(self.heartbeat_interval_s))}
        for name, value in ((AGENT_SOCKET, self.agent_socket), (CONFIG, self.config_path),
                            (NODE_ID, self.node_id), (RUN_DIR, self.run_dir),
                            (MEMORY_DIR, self.memory_dir)):
            if value:
                env[name] = value
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentEnv:
        return cls(
            agent_socket=get_str(env, AGENT_SOCKET),
            config_path=get_str(env, CONFIG),
            node_id=get_str(env, NODE_ID),
            heartbeat_interval_s=get_float(env, HEARTBEAT_INTERVAL,
                                           DEFAULT_HEARTBEAT_INTERVAL_S, positive=True)
            or DEFAULT_HEARTBEAT_INTERVAL_S,
            run_dir=get_str(env, RUN_DIR),
            memory_dir=get_str(env, MEMORY_DIR),
        )


def memory_env(path: str) -> dict[str, str]:
    """The memory tier's directory for a node's training ranks (``AgentEnv.memory_dir``)."""
    return {MEMORY_DIR: path}


# What no process below the agent may see: the control-API token, and the checkpoint
# signing key and where it lies (the agent signs for its ranks, ``agent.keyservice``).
SECRETS = frozenset({TOKEN, CHECKPOINT_KEY, CHECKPOINT_KEY_FILE})


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` minus ``SECRETS``: what any process below the agent may see."""
    return {k: v for k, v in env.items() if k not in SECRETS}


def token_env(token: str) -> dict[str, str]:
    """The launcher's part: the agent's token, in its environment (never on argv)."""
    return {TOKEN: token}


def read_token(env: Mapping[str, str]) -> str | None:
    return get_str(env, TOKEN)


# -- the network health check's part -------------------------------------------------------
def health_env(spec: Mapping[str, Any], out_dir: str) -> dict[str, str]:
    return {HEALTH_NET: json.dumps(dict(spec), allow_nan=False), HEALTH_OUT: out_dir}


def read_health_env(env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    out = get_str(env, HEALTH_OUT)
    if out is None:
        raise EnvError(HEALTH_OUT, "", "the directory for the network check's report")
    return get_json_object(env, HEALTH_NET), out


def replacement_env() -> dict[str, str]:
    """The agent's mark on a rank it started to replace a failed one in an in-job recovery
    (the rank reports its start-up breakdown then, as rank 0 does at every start)."""
    return {REPLACEMENT: "1"}


def is_replacement(env: Mapping[str, str]) -> bool:
    return env.get(REPLACEMENT) == "1"


def handoff_ts(env: Mapping[str, str]) -> float | None:
    """When a warm spare was handed its rank (None: the rank started cold)."""
    return get_float(env, WARM_HANDOFF_TS, None, positive=True)
