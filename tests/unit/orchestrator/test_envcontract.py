"""The ORCH_* environment contract: what a writer builds, a reader parses back exactly, and a
malformed value is an error naming its variable (fuzzed with hypothesis)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import env as ec
from orchestrator.contracts.chaos import ChaosPlan, StepKill
from orchestrator.agent.rank_env import read_error_file

windows = st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**6)).map(
    lambda t: (t[0], t[0] + t[1])), max_size=5)
json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20)
_seconds = st.floats(0, 3600, allow_nan=False)
chaos = st.builds(
    ChaosPlan,
    kills=st.lists(st.builds(StepKill, id=st.text(max_size=64), rank=st.integers(0, 10**6),
                             step=st.integers(1, 10**9),
                             signal=st.sampled_from(["SIGKILL", "SIGTERM", "SIGSEGV", "SIGSTOP"])),
                   max_size=3),
    poison_batches=st.lists(st.integers(0, 10**9), max_size=3),
    fail_at_start_rank=st.none() | st.integers(0, 10**6), slow_checkpoint_s=_seconds,
    slow_final_commit_s=_seconds, slow_first_step_s=_seconds,
    slow_ranks=st.dictionaries(st.integers(0, 10**6), _seconds, max_size=3))


@settings(max_examples=200, deadline=None)
@given(job=st.text(min_size=1, max_size=30).filter(lambda s: "\0" not in s),
       generation=st.integers(0, 10**6), root=st.none() | st.text(min_size=1, max_size=40)
       .filter(lambda s: "\0" not in s),
       windows=windows, lr=st.floats(0, 100, allow_nan=False),
       resume=st.none() | st.integers(0, 10**9),
       timeout=st.none() | st.floats(0.1, 1e6, allow_nan=False), chaos=chaos)
def test_generation_env_round_trips(job, generation, root, windows, lr, resume, timeout,
                                    chaos) -> None:
    built = ec.GenerationEnv(job=job, generation=generation, checkpoint_root=root,
                             skip_windows=windows, lr_scale=lr, resume_max_step=resume,
                             collective_timeout_s=timeout, chaos=chaos)
    env = built.to_env()
    assert all(k in ec.ALL for k in env)
    parsed = ec.GenerationEnv.from_env(env)
    assert parsed.skip_windows == windows and parsed.resume_max_step == resume
    assert parsed.lr_scale == lr and parsed.chaos == chaos and parsed.job == job
    assert parsed.generation == generation and parsed.checkpoint_root == root
    assert parsed.collective_timeout_s == (None if timeout is None else round(timeout, 1))


@settings(max_examples=1000, deadline=None)
@given(name=st.sampled_from([ec.GENERATION, ec.SKIP_WINDOWS, ec.LR_SCALE, ec.RESUME_MAX_STEP,
                             ec.COLLECTIVE_TIMEOUT_S, ec.CHAOS, ec.HEARTBEAT_INTERVAL]),
       value=st.text(max_size=40) | st.sampled_from(
           ["NaN", "inf", "-1", "[[3, 1]]", "[[1]]", "[[true, 2]]", "{}", "[]", "1e400",
            '{"a": NaN}', "[" * 5000, "0", "0.0", " 7 "]))
def test_a_bad_value_is_an_error_naming_its_variable(name, value) -> None:
    env = {name: value}
    try:
        ec.GenerationEnv.from_env(env)
        ec.AgentEnv.from_env(env)
    except ec.EnvError as exc:
        assert exc.name == name and str(exc).startswith(name + "=")


@pytest.mark.parametrize(("name", "value"), [
    (ec.GENERATION, "two"), (ec.SKIP_WINDOWS, "[[9, 4]]"), (ec.LR_SCALE, "nan"),
    (ec.RESUME_MAX_STEP, "-3"), (ec.COLLECTIVE_TIMEOUT_S, "0"), (ec.CHAOS, "[1]"),
    (ec.HEARTBEAT_INTERVAL, "fast")])
def test_each_malformed_variable_is_named(name: str, value: str) -> None:
    with pytest.raises(ec.EnvError, match=f"^{name}="):
        ec.GenerationEnv.from_env({name: value})
        ec.AgentEnv.from_env({name: value})


def test_agent_env_round_trips_and_token_never_reaches_ranks() -> None:
    built = ec.AgentEnv(agent_socket="/tmp/x.sock", config_path="/r/c.json", node_id="n-1",
                        heartbeat_interval_s=0.25, run_dir="/r")
    assert ec.AgentEnv.from_env(built.to_env()) == built
    assert ec.without_secrets({**ec.token_env("s3cret"), "A": "1"}) == {"A": "1"}


@settings(max_examples=200, deadline=None)
@given(data=st.recursive(json_scalars, lambda c: st.lists(c, max_size=3)
                         | st.dictionaries(st.sampled_from(["message", "extraInfo",
                                                            "py_callstack", "x"]), c,
                                           max_size=3), max_leaves=10))
def test_an_error_file_of_any_shape_never_crashes_the_agent(tmp_path_factory, data) -> None:
    path = tmp_path_factory.mktemp("e") / "error.json"
    path.write_text(json.dumps(data))
    out = read_error_file(path)
    assert out is None or (isinstance(out[0], str) and isinstance(out[1], list))


def test_what_record_writes_is_read_back(tmp_path: Path) -> None:
    script = ("from torch.distributed.elastic.multiprocessing.errors import record\n"
              "@record\n"
              "def main():\n"
              "    raise KeyError('missing shard 7')\n"
              "main()\n")
    path = tmp_path / "error.json"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"TORCHELASTIC_ERROR_FILE": str(path), "PATH": "/usr/bin"},
                         timeout=120)
    assert out.returncode != 0
    message, traceback = read_error_file(path)
    assert message == "KeyError: 'missing shard 7'"
    assert traceback[0].startswith("Traceback") and "missing shard 7" in traceback[-1]

