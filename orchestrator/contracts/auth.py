"""Who is speaking to the supervisor: the operator (job secret) or one node (its credential).

The job secret (``<run dir>/token``, 0600) authorises the operator's routes (``/v1/stop``,
``/v1/status``). Each agent gets its own credential instead, derived from the secret and its
node id with HMAC-SHA256, so the supervisor needs to store nothing per node and a node's
credential says nothing about any other node's::

    orch-node-v1.<node id>.<64 hex digits of HMAC-SHA256(job secret, node id)>

The node id travels inside the credential, so the agent needs nothing besides it and the
supervisor learns *which* node is speaking from the credential alone. A message whose
``node_id`` differs from the credential's node is a forgery (403, journaled).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Literal

PREFIX = "orch-node-v1"
# The node ids a credential can name: what `protocol.NodeId` accepts (printable ASCII, no dot
# ambiguity is possible since the MAC is the last dot-separated part).
_CREDENTIAL = re.compile(r"^orch-node-v1\.([A-Za-z0-9_.:-]{1,128})\.([0-9a-f]{64})$")


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: the operator, or one node."""

    kind: Literal["operator", "node"]
    node_id: str | None = None


def node_credential(secret: str, node_id: str) -> str:
    """The credential the agent of ``node_id`` presents (hand it over as the token)."""
    if not secret:
        raise ValueError("the job secret is empty")
    return f"{PREFIX}.{node_id}.{_mac(secret, node_id)}"


def is_node_credential(token: str) -> bool:
    return token.startswith(PREFIX + ".")


def authenticate(secret: str, bearer: str) -> Principal | None:
    """The principal ``bearer`` proves, or None (compared in constant time)."""
    if not secret or not bearer:
        return None
    m = _CREDENTIAL.match(bearer)
    if m is not None:
        node_id, given = m.group(1), m.group(2)
        if hmac.compare_digest(given.encode("ascii"), _mac(secret, node_id).encode("ascii")):
            return Principal("node", node_id)
        return None
    # "replace": a header may carry lone surrogates (undecodable bytes); they match nothing.
    if hmac.compare_digest(bearer.encode("utf-8", "replace"), secret.encode()):
        return Principal("operator")
    return None


def bearer_of(header: str) -> str:
    """The token of an ``Authorization: Bearer ...`` header ('' when absent or malformed)."""
    scheme, _, given = header.partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


# Every request of a node checks its credential: at 2,048 nodes that is 2,048 HMACs a second
# on the supervisor's loop. Cached per (secret, node id); a flood of made-up node ids only
# evicts, and the comparison stays in constant time.
@functools.lru_cache(maxsize=8192)
def _mac(secret: str, node_id: str) -> str:
    return hmac.new(secret.encode(), node_id.encode(), hashlib.sha256).hexdigest()
