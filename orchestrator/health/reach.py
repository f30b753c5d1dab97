"""The network test's first part: can each pair of nodes around the ring reach each other?

A partitioned network (a switch port down, a firewall rule, a node whose NIC to the fabric
died) makes a process group impossible to form: torch's collectives connect every rank to
every other at start-up and hang or fail as a whole, which names no node. So before the
bandwidth test, every rank probes its ring partners (``network.ring_links``, the same local
rank on the partner node) with a plain TCP connection, through addresses and ports
exchanged in the rendezvous store, and publishes what it found. A pair that cannot connect
before the deadline is *unreachable*; a rank that never showed up in the store (it cannot
reach the rendezvous either) makes its links unreachable too. Every rank merges what all
ranks published, so each report carries the whole table; only when every link is reachable
does the bandwidth test (all-reduce, pairwise exchanges) run.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from orchestrator.health.network import ring_links

# One connection attempt; a dropped SYN is retried until the probe's deadline.
_CONNECT_S = 1.0
_HELLO = b"orch-netcheck\n"


def _accept(server: socket.socket, stop: threading.Event) -> None:
    """Answer every probe: read the hello, send it back."""
    server.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except OSError:
            continue
        with conn:
            try:
                conn.settimeout(_CONNECT_S)
                if conn.recv(len(_HELLO)) == _HELLO:
                    conn.sendall(_HELLO)
            except OSError:
                pass


def _connect(addr: str, port: int, deadline: float) -> str | None:
    """None once a hello went there and back; the last error when the deadline passes."""
    error = "no attempt"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=_CONNECT_S) as conn:
                conn.settimeout(_CONNECT_S)
                conn.sendall(_HELLO)
                if conn.recv(len(_HELLO)) == _HELLO:
                    return None
                error = "no answer to the probe"
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.1)
    return error


def probe(store: Any, spec: dict[str, Any], rank: int, world: int, local: int,
          arrival_s: float, connect_s: float = 5.0) -> dict[str, Any]:
    """Probe this rank's ring partners, publish the result, merge every rank's.

    Ranks start seconds apart (a Python with torch to import on every node): a partner
    that has not reached the rendezvous within ``arrival_s`` of the first rank that did is
    taken as cut off; one that did gets ``connect_s`` more for its probes to go through.
    Returns ``{"links": [{"a", "b", "reachable", "error"}], "missing": [ranks]}`` (node
    ids in ``a``/``b``); ``missing`` are ranks that published nothing in time."""
    nodes: list[str] = spec["nodes"]
    addrs: list[str] = spec["addrs"]
    ppn = int(spec["ppn"])
    me = rank // ppn
    first = float(store.compare_set("reach/t0", "", repr(time.time())).decode())
    arrive_by = time.monotonic() + max(0.0, first + arrival_s - time.time())
    connect_by = arrive_by + connect_s
    server = socket.create_server(("", 0), family=socket.AF_INET, backlog=16)
    stop = threading.Event()
    thread = threading.Thread(target=_accept, args=(server, stop), daemon=True)
    thread.start()
    try:
        store.set(f"reach/port/{rank}", str(server.getsockname()[1]))
        mine = []
        for a, b in ring_links(len(nodes)):
            if me not in (a, b):
                continue
            peer_node = b if me == a else a
            peer = peer_node * ppn + local
            port = _wait_get(store, f"reach/port/{peer}", arrive_by)
            error = "the partner never reached the rendezvous" if port is None else \
                _connect(addrs[peer_node], int(port),
                         max(connect_by, time.monotonic() + connect_s))
            mine.append({"a": a, "b": b, "rank": rank, "error": error})
        store.set(f"reach/result/{rank}", json.dumps(mine))
        # Every rank that arrived is done probing (us too) by then.
        gather_by = max(connect_by, time.monotonic()) + 2 * connect_s
        published: dict[int, list[dict[str, Any]]] = {}
        for r in range(world):
            raw = _wait_get(store, f"reach/result/{r}", gather_by)
            if raw is not None:
                published[r] = json.loads(raw)
    finally:
        stop.set()
        thread.join(2.0)
        server.close()
    return merge(published, nodes, ppn, world)


def _wait_get(store: Any, key: str, deadline: float) -> str | None:
    """The key's value, waiting for it until ``deadline`` (one that is there already is
    taken even when the deadline has passed: a wait on a missing partner used it up)."""
    from datetime import timedelta

    try:
        if not store.check([key]):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            store.wait([key], timedelta(seconds=left))
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 - the store's timeout (its error type varies by version)
        return None


def merge(published: dict[int, list[dict[str, Any]]], nodes: list[str], ppn: int,
          world: int) -> dict[str, Any]:
    """One table from what every rank published: a link is reachable only when every rank
    that probed it reached its partner, and unreachable when one did not or when neither
    of its ranks published anything."""
    verdict: dict[tuple[int, int], str | None] = {}
    for entries in published.values():
        for e in entries:
            key = (e["a"], e["b"])
            if e["error"] is not None or key not in verdict:
                verdict[key] = e["error"] if e["error"] is not None else verdict.get(key)
    links = []
    for a, b in ring_links(len(nodes)):
        error = verdict.get((a, b), "neither end published a probe")
        links.append({"a": nodes[a], "b": nodes[b], "reachable": error is None,
                      "error": None if error is None else error[:300]})
    return {"links": links, "missing": sorted(set(range(world)) - set(published))}
