"""The supervisor's gateway: what reaches it from outside, parsed and admitted.

- ``server``: the HTTP API (agents' and operator's routes, /metrics, /healthz, /v1/status);
- ``admission``: which node may say what about which rank;
- ``httpbody``: bounded request bodies parsed straight into the protocol's models;
- ``beatfront``, ``beatlink``, ``beatwire``: the optional heartbeat process, its link to the
  supervisor and the wire between them.

The judgement of what a message means for the job (``intake``, the generation) is not here.
"""
