"""The Kubernetes manifests parse and wire agents to the supervisor's Service and token."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_supervisor_and_agents_fit_together() -> None:
    sup = {d["kind"]: d for d in _docs("supervisor.yaml")}
    agents = {d["kind"]: d for d in _docs("agents.yaml")}
    service = sup["Service"]
    port = service["spec"]["ports"][0]["port"]
    container = agents["Job"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert f"--head=http://{service['metadata']['name']}:{port}" in args
    assert "--token-file=/var/run/orchestrator/token" in args
    assert not any("token=" in a and "file" not in a for a in args)  # never on a command line
    sup_container = sup["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    secret_ref = sup_container["env"][0]["valueFrom"]["secretKeyRef"]
    volume = next(v for v in agents["Job"]["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "token")
    assert volume["secret"]["secretName"] == secret_ref["name"]
    assert volume["secret"]["defaultMode"] == 0o400
    assert sup["Deployment"]["spec"]["strategy"]["type"] == "Recreate"
    # The heartbeat process listens where the Service sends its second port.
    beats = next(p for p in service["spec"]["ports"] if p["name"] == "heartbeats")
    assert f"--set api.heartbeat_port={beats['targetPort']}" in sup_container["args"][0]
    assert {"name": "heartbeats", "containerPort": beats["targetPort"]} in \
        sup_container["ports"]
    selector = service["spec"]["selector"]
    labels = sup["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
