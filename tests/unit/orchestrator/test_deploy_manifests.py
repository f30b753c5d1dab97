"""The shipped Kubernetes example parses and wires agents to the supervisor's Service and
token; the supervisor runs to completion (a Job), never restarted after it ended."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_supervisor_and_agents_fit_together() -> None:
    sup = {d["kind"]: d for d in _docs("supervisor.yaml")}
    agents = {d["kind"]: d for d in _docs("agents.yaml")}
    job = yaml.safe_load((K8S / "job.yaml").read_text())
    service = sup["Service"]
    port = service["spec"]["ports"][0]["port"]
    container = agents["Job"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert f"--head=http://{service['metadata']['name']}:{port}" in args
    assert job["launcher"] == {**job["launcher"], "kind": "kubernetes",
                               "advertise_host": service["metadata"]["name"]}
    assert job["metrics"]["port"] == port
    assert "--token-file=/var/run/orchestrator/token" in args
    assert not any("token=" in a and "file" not in a for a in args)  # never on a command line
    sup_pod = sup["Job"]["spec"]["template"]["spec"]
    sup_container = sup_pod["containers"][0]
    secret_ref = sup_container["env"][0]["valueFrom"]["secretKeyRef"]
    volume = next(v for v in agents["Job"]["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "token")
    assert volume["secret"]["secretName"] == secret_ref["name"]
    assert volume["secret"]["defaultMode"] == 0o400
    # Run to completion: a crashed supervisor is a new pod resuming the run; a job that
    # ended FAILED (exit 3) fails the Job instead of being retried.
    assert "Deployment" not in sup and sup_pod["restartPolicy"] == "Never"
    rules = sup["Job"]["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "FailJob", "onExitCodes": {
        "containerName": "supervisor", "operator": "In", "values": [3]}}
    script = sup_container["args"][0]
    assert 'up --resume "$run"' in script and "FAILED) exit 3" in script
    # The heartbeat process listens where the Service sends its second port.
    beats = next(p for p in service["spec"]["ports"] if p["name"] == "heartbeats")
    assert job["api"]["heartbeat_port"] == beats["targetPort"]
    assert {"name": "heartbeats", "containerPort": beats["targetPort"]} in \
        sup_container["ports"]
    selector = service["spec"]["selector"]
    labels = sup["Job"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert "annotations" not in service["metadata"]  # no scrape annotations nothing reads
