"""deploy/kubernetes validated offline: every object the kustomization lists against the
Kubernetes OpenAPI schema (kubernetes-validate ships the schemas; nothing is downloaded),
strictly (an unknown field is an error), for the oldest and newest versions EKS runs here,
and the wiring between the objects (image, token Secret, config, caches, selectors). The
directory is `orchestrator deploy kubernetes configs/llama2-7b-trn1-128.yaml`'s output
(tests/integration/test_deploy_render.py holds it to that)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
DOCKERFILE = K8S.parent / "container" / "Dockerfile"
VERSIONS = ["1.31.0", "1.37.0"]


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _objects() -> list[dict[str, Any]]:
    out = []
    for name in _kustomization()["resources"]:
        out += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return out


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in _objects() if o["kind"] == kind]


def _pod_specs() -> list[dict[str, Any]]:
    return [o["spec"]["template"]["spec"] for o in _objects()
            if o["kind"] in ("Deployment", "Job", "StatefulSet")]


def _job(name: str) -> dict[str, Any]:
    return next(o for o in _by_kind("Job") if o["metadata"]["name"] == name)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_openapi_schema(version: str) -> None:
    objects = _objects()
    assert {o["kind"] for o in objects} == {"Service", "Job", "PersistentVolumeClaim",
                                            "ServiceAccount"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_what_kubernetes_would() -> None:
    """The check above can fail: a typo'd field, a wrong type, a missing required field."""
    job = _job("orchestrator-agent")
    broken = []
    typo = copy.deepcopy(job)
    typo["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    broken.append(typo)
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "seventeen"
    broken.append(wrong_type)
    no_image_name = copy.deepcopy(job)
    del no_image_name["spec"]["template"]["spec"]["containers"][0]["name"]
    broken.append(no_image_name)
    for obj in broken:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)


def test_the_manifests_use_the_image_the_kustomization_names() -> None:
    image_names = {i["name"] for i in _kustomization()["images"]}
    used = {c["image"] for spec in _pod_specs()
            for c in spec.get("initContainers", []) + spec["containers"]}
    assert used == image_names == {"orchestrator"}


def test_the_token_is_a_per_job_generated_secret_both_sides_read() -> None:
    k = _kustomization()
    assert [g["name"] for g in k["secretGenerator"]] == ["orchestrator-token"]
    assert [g["name"] for g in k["configMapGenerator"]] == ["orchestrator-job"]
    assert not _by_kind("Secret")  # never a token committed in a manifest
    supervisor = _job("orchestrator-supervisor")["spec"]["template"]["spec"]["containers"][0]
    token_env = [e for e in supervisor["env"] if e["name"] == "ORCH_TOKEN"]
    assert token_env[0]["valueFrom"]["secretKeyRef"] == {"name": "orchestrator-token",
                                                         "key": "token"}
    job = _job("orchestrator-agent")
    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes["token"]["secret"]
    assert secret["secretName"] == "orchestrator-token" and secret["defaultMode"] == 0o400
    assert volumes["credential"]["emptyDir"]["medium"] == "Memory"
    # The agent holds its node's credential only; the init container that derives it is
    # the one container of the pod that mounts the job secret.
    agent = pod["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert "token" not in mounts and f"--token-file={mounts['credential']}/token" in agent["args"]
    init = {c["name"]: c for c in pod["initContainers"]}["node-credential"]
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert init["command"] == ["orchestrator", "node-credential"]
    assert f"--token-file={init_mounts['token']}/token" in init["args"]
    assert f"--out={init_mounts['credential']}/token" in init["args"]
    node_arg = next(a for a in agent["args"] if a.startswith("--node-id="))
    assert node_arg in init["args"]  # the credential names the node the agent registers as
    assert [c for c in pod["containers"] if "token" in {m["name"] for m in c["volumeMounts"]}] \
        == []
    assert [c["name"] for c in pod["initContainers"]
            if "token" in {m["name"] for m in c["volumeMounts"]}] == ["node-credential"]


def test_node_credential_writes_a_credential_the_supervisor_accepts(tmp_path: Path) -> None:
    """The init container's command, run for real: a 0400 file whose credential authenticates
    as that node and no other; bad input is refused with a clear error."""
    import subprocess
    import sys

    from orchestrator.contracts.auth import authenticate

    secret = tmp_path / "secret" / "token"
    secret.parent.mkdir()
    secret.write_text("s3cret-of-the-job\n")
    out = tmp_path / "cred" / "token"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", "node-credential", *args],
                              capture_output=True, text=True, timeout=120)

    done = run("--node-id=agent-3", f"--token-file={secret}", f"--out={out}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.stat().st_mode & 0o777 == 0o400
    credential = out.read_text().strip()
    assert "s3cret" not in credential
    principal = authenticate("s3cret-of-the-job", credential)
    assert principal is not None and (principal.kind, principal.node_id) == ("node", "agent-3")
    assert authenticate("another-job", credential) is None
    again = run("--node-id=agent-3", f"--token-file={secret}", f"--out={out}")  # a restart
    assert again.returncode == 0 and out.read_text().strip() == credential
    for args, says in [(["--node-id=agent 3"], "node id"), (["--node-id=-x"], "node id"),
                       (["--node-id=agent-3"], "cannot read")]:
        bad = run(*args, f"--token-file={tmp_path / 'missing' if says == 'cannot read' else secret}",
                  f"--out={tmp_path / 'x'}")
        assert bad.returncode == 2 and says in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    secret.write_text("  \n")
    empty = run("--node-id=agent-3", f"--token-file={secret}", f"--out={tmp_path / 'y'}")
    assert empty.returncode == 2 and "empty" in empty.stdout + empty.stderr


def test_agents_are_an_indexed_job_with_node_local_caches() -> None:
    job = _job("orchestrator-agent")["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "hostPath" in volumes["cache"]  # the node's own disk, not a shared filesystem
    agent = pod["containers"][0]
    cache_mount = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}["cache"]
    # Every compile cache the image points at lies inside that mount.
    caches = re.findall(r"(?:NEURON_COMPILE_CACHE_URL|TORCHINDUCTOR_CACHE_DIR|TRITON_CACHE_DIR"
                        r"|TORCH_EXTENSIONS_DIR)=(\S+)", DOCKERFILE.read_text())
    assert len(caches) == 4 and all(c.startswith(cache_mount + "/") for c in caches)
    assert "--node-id=agent-$(JOB_COMPLETION_INDEX)" in agent["args"]
    assert agent["securityContext"]["runAsNonRoot"] is True


def test_services_select_the_pods_they_front() -> None:
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
            for o in _objects() if o["kind"] in ("Deployment", "Job")}
    for svc in _by_kind("Service"):
        selector = svc["spec"]["selector"]
        matched = [n for n, labels in pods.items() if selector.items() <= labels.items()]
        assert len(matched) == 1, (svc["metadata"]["name"], matched)
    job_pod = _job("orchestrator-agent")["spec"]["template"]["spec"]
    assert job_pod["subdomain"] == "orchestrator-agents"
