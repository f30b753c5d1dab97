"""The root config: one pydantic tree, composed from each component's own section.

Orchestrator-owned sections live here; the trainer owns ``trainer`` and ``checkpoint``
(``trainer.config``), the stability module owns ``stability``. Every model forbids unknown
keys, so a typo is an error naming its dotted path, never a silently ignored setting.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.config.deploy import DeployConfig
from orchestrator.contracts.env import CHECKPOINT_KEY
from orchestrator.health.config import HealthConfig
from stability.config import StabilityConfig
from trainer.config import CheckpointConfig, FieldError, TrainerConfig, check_sections


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              # NaN or infinity in a bound or a timeout disables it
                              allow_inf_nan=False)


_JOB_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class JobConfig(Section):
    """What runs, and under which name."""

    name: str = Field("local", description="Job name: label on metrics, checkpoint subfolder.")
    entrypoint: list[str] | None = Field(
        None,
        description=(
            "Command each rank runs (argv). Default: the built-in trainer "
            "(`python -m trainer`). A user script gets the torch.distributed environment and "
            "uses the worker SDK (`import orchestrator.worker`)."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for every rank."
    )
    warm_start: bool = Field(
        True,
        description=(
            "Keep one pre-imported spare interpreter per rank on every node while training: a "
            "restart skips importing torch and the trainer (a SCRIPT.py's: torch, the SDK)."
        ),
    )
    framework_hooks: bool = Field(
        True, description="In a script of your own (job.entrypoint), every Lightning, Hugging "
        "Face or torchtitan Trainer it makes reports its steps (loss, grad norm, LR, "
        "tokens), phases and saves through the orchestrator's hook "
        "(orchestrator.worker.hooks), with no code change; false: the script's trainers are "
        "left as they are (the optimizer-step count still calibrates the hang timeout).")
    run_root: str = Field("runs", description="Where `up` creates run directories.")
    workdir: str | None = Field(
        None,
        description=(
            "Working directory of every rank (created if missing; relative paths are taken "
            "from the agent's directory). `{node_id}` is replaced by the node's id: with the "
            "local launcher, `work/{node_id}` keeps simulated nodes from sharing files (not "
            "for a script whose ranks all resume from a snapshot in their working directory: "
            "they would resume from different steps). Default: the agent's own working "
            "directory, as torchrun does."
        ),
    )
    master_port: int | None = Field(
        None, ge=1, le=65535,
        description="Fixed MASTER_PORT of the rendezvous (default: a free port per launch, below "
        "the kernel's ephemeral range).",
    )
    master_port_range: tuple[int, int] | None = Field(
        None,
        description=(
            "Inclusive [low, high] range MASTER_PORT is picked from (a free port in it, for "
            "firewalls that open only a range). Exclusive with master_port."
        ),
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _JOB_NAME.match(v):
            raise ValueError(
                "must be 1-63 characters of lowercase letters, digits, '_', '.', '-', "
                "starting with a letter or digit"
            )
        return v

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, v: dict[str, str]) -> dict[str, str]:
        # The checkpoint signing key too (its *file*'s path, ORCH_CHECKPOINT_KEY_FILE, is fine).
        secret = [k for k in v if re.search(r"(SECRET|TOKEN|PASSWORD|AWS_ACCESS_KEY)", k, re.IGNORECASE)
                  or k.upper() == CHECKPOINT_KEY]
        if secret:
            raise ValueError(
                f"secrets never come from the config file ({', '.join(sorted(secret))}); "
                "pass them through the environment of `orchestrator up`"
            )
        return v

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.strip() or "\0" in v:
                raise ValueError("must be a non-empty path")
            try:
                v.format(node_id="n")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"only {{node_id}} may be substituted ({exc})") from None
        return v

    @field_validator("master_port_range")
    @classmethod
    def _check_range(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and not 1024 <= v[0] <= v[1] <= 65535:
            raise ValueError("must be [low, high] with 1024 <= low <= high <= 65535")
        return v

    @model_validator(mode="after")
    def _one_port_setting(self) -> JobConfig:
        if self.master_port is not None and self.master_port_range is not None:
            raise FieldError("master_port_range", "set master_port or master_port_range, "
                                                  "not both")
        return self


class SSHConfig(Section):
    """SSH launcher settings."""

    hosts: list[str] = Field(default_factory=list, description="Hosts (user@host[:port]).")
    hostfile: str | None = Field(None, description="File with one host per line (# comments).")
    identity_file: str | None = Field(None, description="Private key for ssh -i.")
    options: list[str] = Field(
        default_factory=list, description="Extra ssh -o options, e.g. StrictHostKeyChecking=no."
    )


class SlurmConfig(Section):
    """Slurm launcher settings (run `orchestrator up` inside an allocation)."""

    srun_args: list[str] = Field(default_factory=list, description="Extra srun arguments.")
    agents_per_node: int = Field(
        1, gt=0, description="Agents per Slurm node (1 on a real cluster; more lets one "
                             "machine act as several nodes).")
    addr: str = Field(
        "$(hostname)", description="Shell expression for the address other nodes reach an "
                                   "agent at (expanded on the node).")


class SageMakerConfig(Section):
    """SageMaker launcher settings (`orchestrator sagemaker host` on every instance)."""

    port: int = Field(
        9410, ge=1, le=65535, description="Port of the supervisor on the first host (API and "
                                           "/metrics); the other hosts' agents connect to it.")


class LauncherConfig(Section):
    """How agents get started on the nodes."""

    kind: Literal["local", "ssh", "slurm", "kubernetes", "sagemaker"] = Field(
        "local", description="local (simulated nodes on this host), ssh, slurm, kubernetes, "
                             "sagemaker (inside a SageMaker training job)."
    )
    python: str | None = Field(
        None, description="Python interpreter on the nodes (default: the supervisor's own)."
    )
    advertise_host: str | None = Field(
        None, description="Address agents use to reach the supervisor (default: this host)."
    )
    ssh: SSHConfig = Field(default_factory=SSHConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    sagemaker: SageMakerConfig = Field(default_factory=SageMakerConfig)


class ClusterConfig(Section):
    """The nodes a job runs on."""

    nodes: int = Field(2, gt=0, description="Nodes the job trains on.")
    procs_per_node: int = Field(1, gt=0, description="Ranks per node (one per accelerator).")
    spares: int = Field(0, ge=0, description="Extra nodes kept out of the job as spares.")
    accelerator: Literal["cpu", "cuda", "neuron"] = Field(
        "cpu", description="Accelerator kind each rank drives."
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class PhaseTimeouts(Section):
    """Seconds without progress, per phase, before a rank counts as hung."""

    init: float = Field(300, gt=0, description="Process start to the first heartbeat.")
    loading: float = Field(900, gt=0, description="Loading a checkpoint or data.")
    compiling: float = Field(1800, gt=0, description="torch.compile / Neuron compilation.")
    training: float | None = Field(
        None,
        gt=0,
        description="Fixed training timeout; default null = self-calibrating (see calibration).",
    )
    checkpointing: float = Field(900, gt=0, description="The blocking part of a save.")
    evaluating: float = Field(1800, gt=0, description="An evaluation pass.")
    finishing: float = Field(
        300, gt=0, description="Past the last step: the final commit's wait, the parameter "
        "digest, process-group teardown (every peer) and exit.")


class TimeoutsConfig(Section):
    """Every timeout the control plane uses."""

    register_s: float = Field(120, gt=0, description="Agents have this long to register.")
    launch_s: float = Field(120, gt=0, description="Agents have this long to start ranks.")
    stop_grace_s: float = Field(
        10, gt=0, description="SIGTERM to SIGKILL grace when stopping ranks."
    )
    stop_checkpoint_s: float = Field(
        300, ge=0, description="An operator's stop (down, SIGTERM) first asks the ranks for "
        "a checkpoint at their next step boundary and waits this long for it (0: no final "
        "checkpoint)."
    )
    heartbeat_interval_s: float = Field(
        0.5, gt=0, description="How often ranks and agents send heartbeats."
    )
    node_lost_s: float = Field(10, gt=0, description="An agent silent this long is node_lost.")
    agent_lease_s: float = Field(
        60, ge=0, description="An agent that has had no answer from its supervisor this long "
        "stops its ranks (a node cut off from the supervisor, which replaces it after "
        "node_lost_s, must not train on beside its replacement: what it writes meanwhile is "
        "fenced by the checkpoint readers; this bounds how long it can go on). Longer than a "
        "supervisor restart takes (`up --resume` keeps the ranks training); 0: never.")
    phases: PhaseTimeouts = Field(default_factory=PhaseTimeouts)
    training_floor_s: float = Field(
        30, gt=0, description="Calibrated training timeout never goes below this."
    )
    training_multiplier: float = Field(
        3.0, gt=1, description="Calibrated training timeout = multiplier x the step pace (the "
        "second-largest of a rank's last 200 step intervals past its warm-up: a slow step "
        "that does not recur never sets it)."
    )
    training_floor_calibrated_s: float | None = Field(
        1.0, gt=0, description="Once calibration_steps step intervals are measured, the "
        "training timeout's floor comes down from training_floor_s to this (a second finds "
        "a hang within 3 step intervals + 2 s, a script without the SDK's too); null: the "
        "floor stays where it is (a noisy shared CPU host)."
    )
    calibration_steps: int = Field(
        10, ge=1, description="Step intervals measured over the job (past each generation's "
        "3 warm-up steps, carried across restarts) before the floor comes down.")
    calibration_horizon_steps: int = Field(
        500, ge=1, le=10_000_000, description="The calibrated training timeout follows the "
        "largest step interval of the job's last this many steps: one slow step (a "
        "restart's warm-up) raises it for that long, not for good. Keep it above the period "
        "of a job's regular slow steps (synchronous logging every N steps) with a low "
        "training_floor_calibrated_s.")
    stack_dump_wait_s: float = Field(
        3.0, ge=0, description="On a hang, wait this long for every rank's stack dump."
    )

    @model_validator(mode="after")
    def _check(self) -> TimeoutsConfig:
        low = self.training_floor_calibrated_s
        if low is not None and low > self.training_floor_s:
            raise FieldError(
                "training_floor_calibrated_s",
                f"training_floor_calibrated_s ({low}) is where the floor comes down to: "
                f"at most training_floor_s ({self.training_floor_s})")
        if 0 < self.agent_lease_s <= 2 * self.heartbeat_interval_s:
            raise FieldError(
                "agent_lease_s",
                f"agent_lease_s ({self.agent_lease_s}) must be 0 (no lease) or exceed two "
                f"heartbeat intervals ({2 * self.heartbeat_interval_s})",
            )
        if self.node_lost_s <= 2 * self.heartbeat_interval_s:
            raise FieldError(
                "node_lost_s",
                f"node_lost_s ({self.node_lost_s}) must exceed two heartbeat intervals "
                f"({2 * self.heartbeat_interval_s})",
            )
        return self


class RestartConfig(Section):
    """When to restart a failed job, and when to give up."""

    max_restarts: int = Field(20, ge=0, description="Total restart budget of the job.")
    max_restarts_without_progress: int = Field(
        3, gt=0, description="FAILED after this many restarts in a row with no new checkpoint."
    )
    backoff_initial_s: float = Field(1.0, ge=0, description="First restart delay.")
    backoff_max_s: float = Field(60.0, ge=0, description="Longest restart delay.")
    backoff_multiplier: float = Field(2.0, ge=1, description="Delay growth per restart.")
    backoff_window_s: float = Field(
        600.0, ge=0, description="A failure with no other failure in the window this long "
        "before it restarts at once (no backoff: a job that fails once an hour should not "
        "wait); later ones in the window back off from backoff_initial_s. 0: always back off.")
    node_failure_limit: int = Field(
        2, gt=0, description="A node blamed for this many failures in the window is excluded "
                             "(when a spare can take its place).")
    node_failure_window_s: float = Field(
        3600.0, gt=0, description="Window for node_failure_limit.")
    in_job: bool = Field(
        True, description="Recover from a rank's death or hang in place: the other ranks "
        "stay alive and roll back to the newest state every rank holds (the memory tier, "
        "else the durable tier), and the failed rank is replaced (by a warm standby where "
        "one is ready), with no health check and no restart of the survivors. Whenever that "
        "cannot be done the job restarts every rank as before; the journal's failure says "
        "which path was taken and why (recovery_path, recovery_reason).")
    in_job_wait_s: float = Field(
        30.0, gt=0, le=3600, description="A rank whose collective failed waits this long "
        "for the in-job recovery's order before it exits (the job then restarts in full).")
    standby: bool = Field(
        True, description="With in_job and job.warm_start: each node keeps one warm standby "
        "per local rank (the trainer imported, on a GPU its device context created and the "
        "compile cache loaded, the rank's memory-tier slots page-locked) to replace a dead "
        "rank. Costs a device context per local rank (about 0.5 GB of GPU memory) and an "
        "interpreter's host memory.")


class StragglerConfig(Section):
    """Naming a rank or node persistently slower than its peers (``supervisor.generation.stragglers``)."""

    enabled: bool = Field(True, description="Compare the ranks' step times and data waits.")
    margin: float = Field(
        0.2, gt=0, le=100,
        description="Slow: a rank's step time or data wait exceeds the median of the other "
        "ranks' by more than this fraction of their step time (0.2: a fifth of a step).")
    min_excess_s: float = Field(
        0.01, ge=0, description="...and by at least this many seconds a step (tiny steps' "
        "jitter is not a straggler).")
    window_s: float = Field(
        120.0, gt=0, description="Persistently: slow at every check for this long before "
        "the node is named (and back within the margin this long before it is cleared).")
    check_every_s: float = Field(
        5.0, gt=0, description="How often the supervisor compares the ranks.")
    action: Literal["record", "exclude"] = Field(
        "record", description="record: journal, metrics, status and alert; exclude: also "
        "take a named node out at the next restart when a spare can take its place.")


class MetricsConfig(Section):
    """The supervisor's HTTP endpoint: control API, /metrics, /healthz."""

    host: str | None = Field(
        None,
        description="Interface the supervisor listens on. Default: the address agents must "
        "reach: loopback (127.0.0.1) for the local launcher, every interface (0.0.0.0) for "
        "agents on other hosts (serve TLS then, see `api.tls_cert`).",
    )
    port: int = Field(
        9410, ge=0, le=65535,
        description="Port (0 picks a free one, written to the run dir). Not 9400: that is the "
                    "DCGM exporter's default on GPU nodes.",
    )
    targets_file: str | None = Field(
        None,
        description="Prometheus file_sd file this supervisor writes its own scrape target "
        "into while it runs and removes once the job has ended (one file per job, e.g. "
        "/etc/prometheus/targets/orchestrator-<job>.json): a free port (0) is found, and a "
        "finished job stops being scraped instead of alerting as a supervisor that is down.",
    )
    linger_s: float = Field(
        0.0, ge=0,
        description="Keep serving /metrics this long after the job has ended, so Prometheus "
        "scrapes the final state and books (set it above the scrape interval).",
    )


class ApiConfig(Section):
    """Bounds and transport of the control API (what one request may cost the supervisor)."""

    max_body_mb: float = Field(
        32, gt=0, le=1024,
        description="Largest request body (a heartbeat of 1,000 step records is ~200 kB).",
    )
    max_json_depth: int = Field(
        32, ge=4, le=200,
        description="Deepest nesting of free-form JSON in a message (health details); typed "
        "fields are bounded by their models, and the parser stops at 200 whatever this says.",
    )
    header_timeout_s: float = Field(
        15, gt=0, le=3600,
        description="A connection that does not finish a request's headers this long after "
        "it opened (or after its last response) is closed.",
    )
    max_nodes: int = Field(
        4096, ge=1,
        description="Nodes that may register; registrations past it are refused.",
    )
    max_step_interval_s: float = Field(
        3600, gt=0, le=7 * 86400,
        description="Largest step interval a rank may report: the hang timeout calibrates "
        "from it, so a larger one is refused rather than believed.",
    )
    max_step_records_per_s: float = Field(
        2000, gt=0, le=1e6,
        description="Rank 0's step records the supervisor takes per second (with a burst of "
        "five seconds' worth): more are dropped and journaled as message_rejected. Each "
        "record is a line of steps.jsonl; the trainer sends one per step.",
    )
    heartbeat_process: bool = Field(
        False,
        description="Serve the agents' heartbeats from a second process (another core), "
        "which answers them and passes them on in batches. For clusters of more than a few "
        "hundred nodes: at 2,048 nodes the heartbeats' HTTP alone keeps one core busy.",
    )
    heartbeat_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the heartbeat process (0: any free one; it is told to agents "
        "when they register). Agents that cannot reach it beat to the API's own port.",
    )
    tls_cert: str | None = Field(
        None, description="PEM certificate: serve the API over HTTPS (with `tls_key`)."
    )
    tls_key: str | None = Field(None, description="PEM private key of `tls_cert`.")
    tls_ca: str | None = Field(
        None,
        description="PEM CA bundle agents verify the supervisor's certificate with (default: "
        "the system's trust store). Handed to agents as ORCH_TLS_CA.",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> ApiConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise FieldError("tls_key" if self.tls_key is None else "tls_cert",
                             "tls_cert and tls_key go together")
        return self


class LeaderConfig(Section):
    """A standby supervisor: leadership of the job held as an etcd lease
    (``orchestrator.supervisor.leader``). Empty ``etcd``: one supervisor, no election."""

    etcd: list[str] = Field(
        default_factory=list,
        description="etcd client URLs (http://host:2379), tried in turn. Set: every `up` of "
        "this job campaigns for its lock first; the winner leads, the others (`up --standby "
        "--run-dir RUN`, the run dir on shared storage) wait and take over when its lease "
        "lapses.")
    lease_ttl_s: int = Field(
        5, ge=2, le=300,
        description="The leader's etcd lease: a standby takes over about this long after the "
        "leader stops refreshing it (dies, or is cut off); the leader stops acting once it "
        "cannot confirm a refresh within it.")
    key: str | None = Field(
        None, max_length=200, pattern=r"^[A-Za-z0-9_./-]+$",
        description="The lock's name in etcd (default: orchestrator/<job.name>).")
    urls: list[str] = Field(
        default_factory=list,
        description="The API URL of every supervisor that may lead (http://head-a:9410, "
        "http://head-b:9410): agents get them all and try them in turn, so they follow a "
        "standby that takes over.")

    @field_validator("etcd", "urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not re.match(r"^https?://[^\s/,]+(:\d+)?/?$", url):
                raise ValueError(f"{url!r}: expected http(s)://host[:port]")
        return v

    def lock_name(self, job: str) -> str:
        return self.key or f"orchestrator/{job}"


class KillSpec(Section):
    """One injected rank kill."""

    step: int = Field(gt=0, description="Kill once the rank has reached this step.")
    rank: int | Literal["random"] = Field("random", description="Rank to kill, or random.")
    signal: Literal["SIGKILL", "SIGTERM", "SIGSEGV", "SIGSTOP"] = Field(
        "SIGKILL", description="Signal sent (SIGSTOP simulates a hang)."
    )


class ChaosConfig(Section):
    """Fault injection for demos and tests. Each injection fires once per job."""

    kill: list[KillSpec] = Field(default_factory=list, description="Kills at given steps.")
    kill_interval_s: float | None = Field(
        None, gt=0, description="Also kill a random rank every N seconds of training."
    )
    seed: int = Field(0, description="Seed for random rank choices.")
    poison_batches: list[int] = Field(
        default_factory=list,
        description="Global batch indices whose gradients the trainer blows up (x1e4).",
    )
    fail_at_start_rank: int | None = Field(None, ge=0, description="This rank exits with "
                                           "code 3 at start-up, every time.")
    fail_rejoin_rank: int | None = Field(
        None, ge=0, description="This rank fails every in-job recovery it survives, after "
        "its new process groups are made (the job falls back to a full restart)."
    )
    slow_checkpoint_s: float = Field(0.0, ge=0, le=3600, description="Every save blocks "
                                     "training this much longer (tests timeouts).")
    slow_first_step_s: float = Field(0.0, ge=0, le=3600, description="Each generation's "
                                     "first step takes this much longer.")
    slow_final_commit_s: float = Field(
        0.0, ge=0, le=3600,
        description="The final save's commit (after the last step) takes this much longer.",
    )
    slow_abort_s: float = Field(0.0, ge=0, le=3600, description="A survivor's abort of its "
        "process groups in an in-job recovery takes this much longer (NCCL's abort takes "
        "about 0.5 s; gloo's none).")
    slow_ranks: dict[int, float] = Field(
        default_factory=dict,
        description="rank -> seconds added to each of its steps (a straggler).",
    )
    slow_steps: dict[int, float] = Field(
        default_factory=dict,
        description="n -> seconds added to each generation's n-th step on every rank (one "
        "slow step that does not recur: a recompile, page-locking).",
    )

    @field_validator("slow_ranks")
    @classmethod
    def _slow_ranks(cls, v: dict[int, float]) -> dict[int, float]:
        for rank, s in v.items():
            if rank < 0 or not math.isfinite(s) or not 0 <= s <= 3600:
                raise ValueError(f"rank {rank}: {s} s (ranks >= 0, seconds in [0, 3600])")
        return v

    @field_validator("slow_steps")
    @classmethod
    def _slow_steps(cls, v: dict[int, float]) -> dict[int, float]:
        for n, s in v.items():
            if n < 1 or not math.isfinite(s) or not 0 <= s <= 3600:
                raise ValueError(f"step {n}: {s} s (steps >= 1, seconds in [0, 3600])")
        return v


class Config(Section):
    """A whole job."""

    job: JobConfig = Field(default_factory=JobConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)
    stragglers: StragglerConfig = Field(default_factory=StragglerConfig)
    stability: StabilityConfig = Field(default_factory=StabilityConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig, description="What `orchestrator "
                                 "deploy` renders (Kubernetes, Slurm, SageMaker); unused by "
                                 "the job itself.")
    leader: LeaderConfig = Field(default_factory=LeaderConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        world = self.cluster.world_size
        for i, spec in enumerate(self.chaos.kill):
            if spec.rank != "random" and spec.rank >= world:
                raise FieldError(
                    f"chaos.kill.{i}.rank", f"rank {spec.rank} is outside world size {world}"
                )
            if spec.step > self.trainer.steps:
                raise FieldError(
                    f"chaos.kill.{i}.step",
                    f"step {spec.step} is past trainer.steps ({self.trainer.steps})",
                )
        tp = self.trainer.parallelism.tensor_parallel
        if world % tp:
            raise FieldError("trainer.parallelism.tensor_parallel",
                             f"{tp} does not divide the world size {world}")
        check_sections(self.trainer, self.checkpoint, self.stability.rule_actions())
        if self.chaos.fail_at_start_rank is not None and self.chaos.fail_at_start_rank >= world:
            raise FieldError("chaos.fail_at_start_rank", f"outside world size {world}")
        if self.cluster.accelerator == "cpu" and self.trainer.parallelism.backend == "nccl":
            raise FieldError(
                "trainer.parallelism.backend", "nccl needs cluster.accelerator: cuda"
            )
        if self.trainer.device == "neuron":
            self._check_torchneuron()
        return self

    def _check_torchneuron(self) -> None:
        """TorchNeuron ranks on nodes the Neuron health checks examine, without the torch-xla
        settings of a configuration written for the NxD backend."""
        if self.cluster.accelerator != "neuron":
            raise FieldError("cluster.accelerator", "trainer.device neuron needs "
                                                    "cluster.accelerator: neuron (the Neuron "
                                                    "health checks run on those nodes)")
        xla = sorted(k for k in self.job.env if k.startswith("XLA_") or k == "PJRT_DEVICE")
        if xla:
            raise FieldError("job.env", f"{', '.join(xla)} configure torch-xla, which "
                                        "TorchNeuron (trainer.device: neuron) does not use; "
                                        "they belong to the NxD backend (trainer.device: xla)")
