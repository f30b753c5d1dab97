"""A surviving rank 0 serves the next generation's rendezvous store from the order's arrival
(``trainer.distributed.host_store_ahead``), and the group made later reuses that server."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.servers import free_port
from trainer.distributed import host_store_ahead, store_spec

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
