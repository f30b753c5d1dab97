"""What the agent takes from the job config: per-node working directory, rendezvous port
from a fixed value or a range, torchrun's restart budget; and the config's checks."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.agent.nodeconfig import (
    PRELOAD_DIR,
    NodeConfig,
    _bindable,
    preload_pythonpath,
)
from orchestrator.config.schema import Config, JobConfig


def _cfg(**job: object) -> dict:
    cfg = Config().model_dump(mode="json")
    cfg["job"].update(job)
    cfg["restart"]["max_restarts"] = 7
    return cfg


def test_workdir_is_per_node_and_absolute(tmp_path: Path) -> None:
    nc = NodeConfig.from_config(_cfg(workdir=str(tmp_path / "w" / "{node_id}")), "local-1")
    assert nc.workdir == tmp_path / "w" / "local-1" and nc.max_restarts == 7


def test_a_fixed_master_port_is_offered_as_is() -> None:
    assert NodeConfig.from_config(_cfg(master_port=29555), "n").free_port() == 29555


def test_a_port_range_offers_a_free_port_inside_it() -> None:
    # A two-port range whose upper port we hold: the lower one (free) is always offered. Both
    # lie below the kernel's ephemeral range, so no other process on a busy host is handed the
    # free one between our check and the offer (ports from bind(0) raced it before).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(low - 10_000, 1100), low), 200):
        taken = socket.socket()
        try:
            taken.bind(("", port))
        except OSError:
            taken.close()
            continue
        taken.listen()
        if _bindable(port - 1):
            break
        taken.close()
    else:
        pytest.fail("no free port next to a taken one")
    with taken:
        nc = NodeConfig.from_config(_cfg(master_port_range=[port - 1, port]), "n")
        assert {nc.free_port() for _ in range(20)} == {port - 1}


@pytest.mark.parametrize(("job", "field"), [
    ({"master_port": 29500, "master_port_range": [30000, 30010]}, "master_port_range"),
    ({"master_port_range": [30010, 30000]}, "master_port_range"),
    ({"master_port_range": [80, 90]}, "master_port_range"),
    ({"workdir": "w/{rank}"}, "workdir"),
    ({"workdir": " "}, "workdir"),
])
def test_bad_job_settings_name_their_field(job: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        JobConfig.model_validate(job)


def test_the_preload_directory_leads_pythonpath_once() -> None:
    first = preload_pythonpath("/a:/b")
    assert first == f"{PRELOAD_DIR}:/a:/b"
    assert preload_pythonpath(first) == first
    assert (PRELOAD_DIR / "sitecustomize.py").exists()


def test_the_default_offer_lies_below_the_ephemeral_range() -> None:
    # A port the OS hands out as free (bind to 0) is in the ephemeral range, where any
    # outgoing connection on the host may take it before the rank binds it (EADDRINUSE).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    nc = NodeConfig.from_config(_cfg(), "n")
    ports = {nc.free_port() for _ in range(50)}
    assert all(20000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # a random start: nodes sharing a host rarely offer the same
