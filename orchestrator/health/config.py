"""The ``health`` config section: when checks run, their floors and timeouts, and test knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.health.base import Level
from orchestrator.health.catalog import BY_NAME
from trainer.config import FieldError

LevelSetting = Literal["off", "quick", "full"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class HealthFloors(_Section):
    """What a healthy node must reach. ``null`` floors only report the measured value."""

    disk_gib: float = Field(
        1.0, ge=0, description="Free GiB on the checkpoint directory and on the scratch "
                               "directory (a full disk fails; size it to a checkpoint).")
    memory_gib: float = Field(1.0, ge=0, description="Available host memory, GiB.")
    clock_skew_s: float = Field(
        5.0, gt=0, description="Largest difference between a node's wall clock and the "
                               "supervisor's (s3 rejects requests beyond 15 min; the books "
                               "mix node and head timestamps).")
    matmul_tflops: float | None = Field(
        None, gt=0, description="bf16 matmul TFLOP/s every device must reach (e.g. 600 on "
                                "H100 SXM with 8192^3).")
    matmul_relative: float = Field(
        0.8, gt=0, le=1, description="A device slower than this fraction of the node's "
                                     "fastest device fails (finds one slow GPU without a "
                                     "hardware-specific floor).")
    allreduce_gbps: float | None = Field(
        None, gt=0, description="All-reduce bus bandwidth, GB/s, across every rank.")
    link_gbps: float | None = Field(
        None, gt=0, description="Node-to-node bandwidth, GB/s per direction; a link below it "
                                "fails both ends when no single node explains it.")
    link_relative: float = Field(
        0.5, gt=0, le=1, description="A link slower than this fraction of the fastest link is "
                                     "slow; a node whose every link is slow is named.")
    nccom_busbw_gbps: float | None = Field(
        None, gt=0, description="nccom-test all-reduce bus bandwidth within a Neuron node.")
    retired_pages: int = Field(
        60, gt=0, description="Retired GPU memory pages (DBE + SBE) at which a device counts "
                              "as worn out (NVIDIA's replacement threshold).")


class NetworkTestConfig(_Section):
    """Sizes of the network test's transfers."""

    allreduce_mib: float = Field(64, gt=0, description="All-reduce tensor size, MiB.")
    pairwise_mib: float = Field(16, gt=0, description="Pairwise exchange size, MiB.")
    iters: int = Field(5, gt=0, description="Timed iterations of each measurement.")
    warmup: int = Field(1, ge=0, description="Untimed iterations first (connection set-up).")


class HealthChaos(_Section):
    """Fault injection for tests and demos, by node id."""

    fail: dict[str, list[str]] = Field(
        default_factory=dict, description="node_id -> checks forced to fail on that node.")
    hang: dict[str, list[str]] = Field(
        default_factory=dict, description="node_id -> checks that hang there (to show the "
                                          "timeout cuts them).")
    slow_network: dict[str, float] = Field(
        default_factory=dict, description="node_id -> seconds its ranks add to every timed "
                                          "transfer of the network test (a slow link).")


class HealthConfig(_Section):
    """Health checks before the first launch and after every failure."""

    preflight: LevelSetting = Field(
        "full", description="Checks before the first launch: off, quick, full (full adds the "
                            "memory, matmul and network tests).")
    after_failure: LevelSetting = Field(
        "quick", description="Checks before each relaunch after a failure.")
    on_insufficient: Literal["fail", "wait"] = Field(
        "fail", description="When too few healthy nodes remain: fail the job naming each bad "
                            "node, or wait and re-check them every retry_interval_s.")
    retry_interval_s: float = Field(60.0, gt=0, description="Re-check interval when waiting.")
    report_grace_s: float = Field(
        60.0, gt=0, description="Beyond the checks' own timeouts, how long a node's report may "
                                "take (process start, imports) before the node counts as "
                                "failing agent.report.")
    scratch_dir: str | None = Field(
        None, description="Local scratch directory checked for free space and writability; "
                          "{node_id} is replaced per node. Default: the system temp dir.")
    expect_device_name: str | None = Field(
        None, description="Text every accelerator's name must contain (e.g. 'H100', "
                          "'Trainium'); null accepts any model.")
    memtest_gib: float = Field(1.0, gt=0, description="Device memory tested per device, GiB.")
    matmul_size: int = Field(8192, ge=64, description="Square matmul size for throughput.")
    floors: HealthFloors = Field(default_factory=HealthFloors)
    network: NetworkTestConfig = Field(default_factory=NetworkTestConfig)
    timeouts: dict[str, float] = Field(
        default_factory=dict, description="Per-check timeout overrides, seconds, by check name.")
    chaos: HealthChaos = Field(default_factory=HealthChaos)

    @field_validator("preflight", "after_failure", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        # YAML 1.1 reads a bare `off` as false: take it for what the operator wrote.
        return "off" if v is False else v

    @model_validator(mode="after")
    def _known_checks(self) -> HealthConfig:
        for name, seconds in self.timeouts.items():
            if name not in BY_NAME:
                raise FieldError(f"timeouts.{name}", f"unknown health check {name!r}")
            if seconds <= 0:
                raise FieldError(f"timeouts.{name}", "must be > 0")
        for kind in ("fail", "hang"):
            for node, names in getattr(self.chaos, kind).items():
                for name in names:
                    if name not in BY_NAME:
                        raise FieldError(f"chaos.{kind}.{node}",
                                         f"unknown health check {name!r}")
        return self

    def timeout_of(self, name: str) -> float:
        return self.timeouts.get(name, BY_NAME[name].timeout_s)

    def level(self, setting: LevelSetting) -> Level | None:
        return None if setting == "off" else Level(setting)
