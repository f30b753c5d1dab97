"""SageMaker training jobs: every host starts the same image; the first host leads.

Inside a training job SageMaker starts the container on every instance with the same
command (``orchestrator sagemaker host``) and tells each one who it is: the hosts and the
current host in ``/opt/ml/input/config/resourceconfig.json`` (or ``SM_HOSTS`` /
``SM_CURRENT_HOST``, as the sagemaker-training toolkit sets them). The host named first runs
the supervisor, whose ``sagemaker`` launcher starts that host's own agent; every other host
runs an agent that registers with it at ``http://<first host>:<launcher.sagemaker.port>``.
The job's token reaches every host through the job's environment (``ORCH_TOKEN``).

Checkpoints go to ``/opt/ml/checkpoints`` (SageMaker syncs it with the job's
``CheckpointConfig.S3Uri`` and restores it when a job is restarted) unless the config names
an ``s3://`` url; the model is exported to ``/opt/ml/model``, which SageMaker uploads.

Every ``/opt/ml`` path comes from a variable (``SM_*``) defaulting to the real location, so a
test points them at temporary directories. This module reads them only in ``read_env``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.contracts.events import AgentsExpected, AgentSpawned
from orchestrator.launchers.base import AgentSpec, Launcher, agent_command, terminate_pids

# An agent whose supervisor is gone (the first host failed) and that runs no rank exits
# after this long, so the job ends instead of idling to its MaxRuntimeInSeconds.
SAGEMAKER_ORPHAN_TIMEOUT_S = 300.0

# What SageMaker's training containers get (the SM_* names are the sagemaker-training
# toolkit's where it has one; SM_CHECKPOINT_DIR and SM_OUTPUT_DIR are ours).
ENV_DEFAULTS = {
    "SM_INPUT_CONFIG_DIR": "/opt/ml/input/config",
    "SM_CHANNEL_CONFIG": "/opt/ml/input/data/config",
    "SM_MODEL_DIR": "/opt/ml/model",
    "SM_CHECKPOINT_DIR": "/opt/ml/checkpoints",
    "SM_OUTPUT_DIR": "/opt/ml/output",
    "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
}
_MAX_HOSTS = 4096  # SageMaker's own instance limit per job is far lower
_HOST_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")


class SageMakerEnvError(ValueError):
    """The SageMaker environment or resourceconfig.json is missing or malformed."""


class _ResourceConfig(BaseModel):
    # SageMaker writes more keys (network_interface_name, instance_groups...): ignored.
    model_config = ConfigDict(extra="ignore", frozen=True)

    current_host: str = Field(min_length=1, max_length=253)
    hosts: list[str] = Field(min_length=1, max_length=_MAX_HOSTS)

    @model_validator(mode="after")
    def _check(self) -> _ResourceConfig:
        bad = [h for h in [self.current_host, *self.hosts]
               if not h or len(h) > 253 or not set(h) <= _HOST_CHARS]
        if bad:
            raise ValueError(f"not a host name: {bad[0]!r}")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError("hosts are not distinct")
        if self.current_host not in self.hosts:
            raise ValueError(f"current_host {self.current_host!r} is not among the hosts")
        return self


class SageMakerEnv(BaseModel):
    """Who this host is in the training job, and where SageMaker wants files."""

    model_config = ConfigDict(frozen=True)

    current_host: str
    hosts: list[str]
    config_channel: Path
    model_dir: Path
    checkpoint_dir: Path
    output_dir: Path
    output_data_dir: Path

    @property
    def leader(self) -> str:
        """The host named first runs the supervisor (SageMaker's own convention: algo-1)."""
        return self.hosts[0]

    @property
    def is_leader(self) -> bool:
        return self.current_host == self.leader

    @property
    def run_dir(self) -> Path:
        # Under output/data: SageMaker uploads it to S3 when the job ends (journal, logs).
        return self.output_data_dir / "run"

    def head_url(self, port: int) -> str:
        return f"http://{self.leader}:{port}"


def parse_resource_config(text: str) -> tuple[str, list[str]]:
    """resourceconfig.json's text -> (current host, hosts); SageMakerEnvError if malformed."""
    try:
        rc = _ResourceConfig.model_validate_json(text)
    except ValidationError as exc:
        raise SageMakerEnvError(f"resourceconfig.json: {exc.errors()[0]['msg']}") from None
    return rc.current_host, list(rc.hosts)


def read_env(environ: Mapping[str, str]) -> SageMakerEnv:
    """The SageMaker environment of this host, parsed and checked.

    ``SM_HOSTS`` (a JSON list) with ``SM_CURRENT_HOST`` when both are set, else
    ``<SM_INPUT_CONFIG_DIR>/resourceconfig.json``, the file SageMaker itself writes."""
    paths = {k: Path(environ.get(k) or v) for k, v in ENV_DEFAULTS.items()}
    if environ.get("SM_HOSTS") and environ.get("SM_CURRENT_HOST"):
        try:
            hosts = json.loads(environ["SM_HOSTS"])
        except json.JSONDecodeError:
            raise SageMakerEnvError("SM_HOSTS is not JSON") from None
        text = json.dumps({"current_host": environ["SM_CURRENT_HOST"], "hosts": hosts})
    else:
        rc = paths["SM_INPUT_CONFIG_DIR"] / "resourceconfig.json"
        try:
            text = rc.read_text()
        except OSError as exc:
            raise SageMakerEnvError(
                f"not inside a SageMaker training job: neither SM_HOSTS/SM_CURRENT_HOST nor "
                f"{rc} ({exc.strerror})") from None
    current, hosts = parse_resource_config(text)
    return SageMakerEnv(
        current_host=current, hosts=hosts, config_channel=paths["SM_CHANNEL_CONFIG"],
        model_dir=paths["SM_MODEL_DIR"], checkpoint_dir=paths["SM_CHECKPOINT_DIR"],
        output_dir=paths["SM_OUTPUT_DIR"], output_data_dir=paths["SM_OUTPUT_DATA_DIR"])


def find_config(channel: Path) -> Path:
    """The job's config: the one ``*.yaml``/``*.yml`` file of the ``config`` input channel."""
    found = sorted(p for p in channel.glob("*") if p.suffix in (".yaml", ".yml"))
    if len(found) != 1:
        raise SageMakerEnvError(
            f"the config channel {channel} must hold exactly one YAML file; it holds "
            f"{[p.name for p in found]}")
    return found[0]


def leader_overrides(sm: SageMakerEnv, *, port: int, spares: int,
                     checkpoint_url: str | None) -> list[str]:
    """``--set`` overrides that make a config run as this training job's supervisor.

    The instance count decides the node count (nodes + spares = hosts). Checkpoints go to
    the SageMaker checkpoint directory unless the config already names an object store."""
    nodes = len(sm.hosts) - spares
    if nodes < 1:
        raise SageMakerEnvError(f"{len(sm.hosts)} host(s) cannot hold cluster.spares={spares} "
                                "and at least one node")
    out = ["launcher.kind=sagemaker", f"launcher.advertise_host={sm.current_host}",
           "metrics.host=0.0.0.0", f"metrics.port={port}", f"cluster.nodes={nodes}"]
    if not (checkpoint_url or "").startswith("s3://"):
        out.append(f"checkpoint.url={sm.checkpoint_dir}")
    return out


def write_failure(sm: SageMakerEnv, reason: str) -> None:
    """SageMaker shows ``/opt/ml/output/failure`` as the job's FailureReason (first 1 KiB)."""
    sm.output_dir.mkdir(parents=True, exist_ok=True)
    (sm.output_dir / "failure").write_text(reason[:1024])


class SageMakerLauncher(Launcher):
    """On the first host: start this host's agent; the other hosts start their own."""

    kind = "sagemaker"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._proc: subprocess.Popen | None = None

    async def start(self, spec: AgentSpec) -> None:
        sm = read_env(os.environ)
        if len(sm.hosts) != self.wanted_nodes:
            raise RuntimeError(f"the training job has {len(sm.hosts)} host(s); the config "
                               f"wants {self.wanted_nodes} (cluster.nodes + cluster.spares)")
        self._spawn(spec, sm.current_host)
        self.record(AgentsExpected(count=self.wanted_nodes - 1, launcher=self.kind,
                                   head_url=spec.head_url))

    def _spawn(self, spec: AgentSpec, host: str) -> None:
        """This host's own agent, in a session of its own (as the local launcher's)."""
        spec.run_dir.agents.mkdir(parents=True, exist_ok=True)
        cmd = agent_command(spec, host, addr=host, procs=self.cfg.cluster.procs_per_node,
                            orphan_timeout_s=SAGEMAKER_ORPHAN_TIMEOUT_S)
        # This host's agent gets its node's credential, not the job secret (other hosts'
        # agents derive theirs from the secret in the job's environment: SupervisorClient).
        env = {**os.environ, **self.agent_env(spec, host), "PYTHONUNBUFFERED": "1"}
        with open(spec.run_dir.agents / f"{host}.out", "ab") as out:
            self._proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self.record(AgentSpawned(node_id=host, pid=self._proc.pid, launcher=self.kind))

    async def close(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and proc.poll() is None:
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            await asyncio.to_thread(terminate_pids, [proc.pid], 3.0)
        await asyncio.to_thread(proc.wait)
