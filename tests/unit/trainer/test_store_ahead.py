"""A surviving rank 0 serves the next generation's rendezvous store from the order's arrival
(``trainer.distributed.host_store_ahead``), and the group made later reuses that server. A
rank that does not host the store waits for the host's port with a short probe
(``await_store_host``) instead of TCPStore's growing retry delay."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.servers import free_port
from trainer.distributed import await_store_host, host_store_ahead, store_spec

ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_only_the_hosting_rank_serves_the_store() -> None:
    assert host_store_ahead({**ENV, "RANK": "1"}) is None
    assert host_store_ahead({**ENV, "TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
    for bad in ({"MASTER_PORT": "70000"}, {"MASTER_PORT": "x"}, {"MASTER_ADDR": ""},
                {"WORLD_SIZE": "0"}, {"RANK": "-1"}):
        assert host_store_ahead({**ENV, **bad}) is None, bad
    assert host_store_ahead({k: v for k, v in ENV.items() if k != "MASTER_PORT"}) is None


_VALUE = st.one_of(st.text(max_size=12), st.integers(-5, 70000).map(str),
                   st.sampled_from(["0", "1", "2", "65535", "65536", "true", "True", " 0"]))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                        "TORCHELASTIC_USE_AGENT_STORE", "OTHER"]), _VALUE))
def test_any_order_environment_gives_a_bounded_spec_or_none(env: dict[str, str]) -> None:
    spec = store_spec(env)
    if spec is not None:
        addr, port, world = spec
        assert addr and 1 <= port <= 65535 and world >= 1
        assert int(env["RANK"]) == 0
        assert env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() not in ("1", "true")


# Rank 0 serves the store at once, then (1.5 s later, as a survivor after its abort) makes
# the group through env://; rank 1 arrived first and connected to the server already up.
# Without the reuse, rank 0's own bind of the port fails (address in use).
SCRIPT = textwrap.dedent("""
    import datetime, os, sys, time
    import torch.distributed as dist
    from trainer.distributed import host_store_ahead
    rank, port = int(sys.argv[1]), sys.argv[2]
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}
    os.environ.update(env)
    store = host_store_ahead(env)
    assert (store is not None) == (rank == 0)
    if rank == 0:
        time.sleep(1.5)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    store = None
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank)
""")


def test_the_group_reuses_the_store_served_ahead(tmp_path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-3000:]


def test_a_client_rank_waits_for_the_host_then_connects() -> None:
    """Rank 1 arrives first; the host's store comes up 0.3 s later. The wait returns once
    the port accepts, and the probes were no worker to the store: a real client then
    joins, and the host counts exactly that one."""
    port = free_port()
    env = {**ENV, "RANK": "1", "MASTER_PORT": str(port)}
    served: list[tuple[float, dist.TCPStore]] = []

    def host() -> None:
        time.sleep(0.3)
        binding = time.monotonic()  # the server listens before its constructor returns
        store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        served.append((binding, store))

    thread = threading.Thread(target=host)
    thread.start()
    try:
        await_store_host(env, 30.0)
        returned = time.monotonic()
    finally:
        thread.join()
    (up, server), = served
    assert returned >= up
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert server.get("k") == b"v"
    assert server.num_keys() >= 1


def test_a_host_that_never_comes_is_a_clear_timeout() -> None:
    port = free_port()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port} did not accept"):
        await_store_host({**ENV, "RANK": "1", "MASTER_PORT": str(port)}, 0.2)


def test_the_host_and_an_agent_store_do_not_probe() -> None:
    port = str(free_port())  # nobody listens: a probe would time out
    await_store_host({**ENV, "MASTER_PORT": port}, 0.0)  # rank 0 hosts it itself
    await_store_host({**ENV, "RANK": "1", "MASTER_PORT": port,
                      "TORCHELASTIC_USE_AGENT_STORE": "True"}, 0.0)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["RANK", "WORLD_SIZE", "MASTER_PORT",
                                        "TORCHELASTIC_USE_AGENT_STORE", "OTHER"]), _VALUE))
def test_any_environment_waits_or_times_out_and_nothing_else(env: dict[str, str]) -> None:
    """Loopback only (a fuzzed host name would be a DNS lookup): the wait returns, or says
    the store did not come up; no other error for any value."""
    env = {**env, "MASTER_ADDR": "127.0.0.1"}
    try:
        await_store_host(env, 0.02)
    except TimeoutError as exc:
        assert "did not accept a connection" in str(exc)
