"""``orchestrator deploy kubernetes``: a kustomization directory for one job.

- ``supervisor.yaml``: the supervisor as a Job (it runs to completion: a completed run's
  ``up --resume`` exits 0, which a Deployment would restart forever). A crashed supervisor's
  pod is replaced and resumes the run from the journal on its volume (agents keep training);
  a job that ended FAILED fails the Job (exit 3, ``podFailurePolicy``) instead of being
  retried; a node drain does not count against the retries. Its Service fronts the API and
  /metrics and the heartbeat process.
- ``agents.yaml``: an Indexed Job of ``cluster.nodes + cluster.spares`` pods, one agent a
  node (``agent-<index>``), ``--procs`` = ``cluster.procs_per_node``, that many accelerators
  and the EFA devices asked for, the node's own disk for compile caches, and a ``validate``
  init container that checks the pod against the job's config (its index, the pod count it
  was rendered for, the optional modules of the image) before anything starts.
- ``kustomization.yaml``: the namespace, the image, the config as a ConfigMap from
  ``job.yaml`` and the API token as a Secret from ``token`` (which you write; never in git).
- ``job.yaml``: the job's config with the Kubernetes settings set (launcher, the
  supervisor's Service name and ports).
"""

from __future__ import annotations

import shlex
from typing import Any

from orchestrator.config.schema import Config
from orchestrator.contracts.env import NODE_COUNT, TOKEN
from orchestrator.render import dump_yaml, header, job_yaml

API_PORT = 9410
BEATS_PORT = 9411
SUPERVISOR = "orchestrator-supervisor"
AGENTS = "orchestrator-agent"
AGENTS_SERVICE = "orchestrator-agents"
JOB_CONFIGMAP = "orchestrator-job"
TOKEN_SECRET = "orchestrator-token"
RUNS_CLAIM = "orchestrator-runs"
IMAGE = "orchestrator"  # the name kustomization.yaml's `images` replaces
RUN_DIR = "/runs/job"
CONFIG_DIR = "/etc/orchestrator"
CACHE_DIR = "/scratch/cache"  # where the image points its compile caches (Dockerfile)
CREDENTIAL_DIR = "/var/run/orchestrator"
SECRET_DIR = "/var/run/orchestrator-secret"
# The supervisor's exit code for a job that ended FAILED: the Job fails, nothing retries it.
FAILED_EXIT = 3
_USER = 1000  # the image's non-root user
_ACCELERATOR_RESOURCE = {"cuda": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuroncore"}


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "orchestrator", "app.kubernetes.io/component": component}


def _non_root() -> dict[str, Any]:
    return {"runAsUser": _USER, "runAsNonRoot": True, "allowPrivilegeEscalation": False}


def settings(cfg: Config) -> dict[str, Any]:
    """What the job's config must say to run here (set in the rendered job.yaml)."""
    return {"launcher.kind": "kubernetes", "launcher.advertise_host": SUPERVISOR,
            "metrics.port": API_PORT, "api.heartbeat_port": BEATS_PORT}


def render(cfg: Config, data: dict[str, Any], source: str) -> dict[str, str]:
    """File name -> text of the kustomization directory for ``cfg`` (``data``: the config
    file's own mapping, ``source``: its name as given)."""
    head = header("kubernetes", source)
    objects_sup = [_supervisor_service(), *_service_account(cfg), _supervisor_job(cfg),
                   _runs_claim(cfg)]
    return {
        "kustomization.yaml": head + dump_yaml(_kustomization(cfg)),
        "supervisor.yaml": head + dump_yaml(*objects_sup),
        "agents.yaml": head + dump_yaml(_agents_service(), _agents_job(cfg)),
        "job.yaml": job_yaml("kubernetes", source, data, settings(cfg)),
    }


def _image(ref: str) -> dict[str, str]:
    """kustomize's image replacement: name, then tag or digest."""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        return {"name": IMAGE, "newName": name, "digest": digest}
    name, sep, tag = ref.rpartition(":")
    if sep and "/" not in tag:
        return {"name": IMAGE, "newName": name, "newTag": tag}
    return {"name": IMAGE, "newName": ref}


def _kustomization(cfg: Config) -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": cfg.deploy.kubernetes.namespace,
        "labels": [{"pairs": {"app.kubernetes.io/part-of": "orchestrator"}}],
        "resources": ["supervisor.yaml", "agents.yaml"],
        "images": [_image(cfg.deploy.image)],
        # Names carry a hash of the content: a new job's token never reuses an old Secret.
        "configMapGenerator": [{"name": JOB_CONFIGMAP, "files": ["job.yaml"]}],
        "secretGenerator": [{"name": TOKEN_SECRET, "files": ["token"], "type": "Opaque"}],
    }


def _service_account(cfg: Config) -> list[dict[str, Any]]:
    k = cfg.deploy.kubernetes
    if not k.service_account or not k.role_arn:
        return []  # none, or one that exists already
    return [{"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": k.service_account,
                          "annotations": {"eks.amazonaws.com/role-arn": k.role_arn}}}]


def _supervisor_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": SUPERVISOR, "labels": _labels("supervisor")},
        "spec": {"selector": _labels("supervisor"), "ports": [
            {"name": "api", "port": API_PORT, "targetPort": API_PORT},
            # The heartbeat process (api.heartbeat_process: true) on a fixed port, so this
            # Service reaches it; agents are told it when they register.
            {"name": "heartbeats", "port": BEATS_PORT, "targetPort": BEATS_PORT}]},
    }


def supervisor_script() -> str:
    """The supervisor container's command: start the run, or resume it after a pod
    replacement; then exit by the job's state (COMPLETED and STOPPED 0, FAILED 3)."""
    run = shlex.quote(RUN_DIR)
    return "\n".join([
        f"run={run}",
        'if [ -s "$run/events.jsonl" ]; then',
        '  orchestrator up --resume "$run" --log-format json',
        "else",
        f'  orchestrator up {CONFIG_DIR}/job.yaml --run-dir "$run" --log-format json',
        "fi",
        "code=$?",
        # The job's own state (the top-level "state" of status --json), not the exit code
        # alone: a supervisor that crashed is retried, a job that failed is not.
        'state=$(orchestrator status "$run" --json | '
        "sed -n 's/^  \"state\": \"\\([A-Z_]*\\)\",$/\\1/p')",
        'case "$state" in',
        "  COMPLETED|STOPPED) exit 0 ;;",
        f"  FAILED) exit {FAILED_EXIT} ;;",
        '  *) exit "$code" ;;',
        "esac",
    ]) + "\n"


def _supervisor_job(cfg: Config) -> dict[str, Any]:
    k = cfg.deploy.kubernetes
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # each retry is a new pod that resumes the run
        "securityContext": {"runAsUser": _USER, "runAsNonRoot": True, "fsGroup": _USER},
        "containers": [{
            "name": "supervisor",
            "image": IMAGE,
            "command": ["/bin/sh", "-c"],
            "args": [supervisor_script()],
            "env": [{"name": TOKEN, "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET,
                                                                   "key": "token"}}}],
            "ports": [{"name": "api", "containerPort": API_PORT},
                      {"name": "heartbeats", "containerPort": BEATS_PORT}],
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": API_PORT},
                               "periodSeconds": 5},
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
            "securityContext": {"allowPrivilegeEscalation": False},
            "volumeMounts": [{"name": "job", "mountPath": CONFIG_DIR, "readOnly": True},
                             {"name": "runs", "mountPath": "/runs"}],
        }],
        "volumes": [{"name": "job", "configMap": {"name": JOB_CONFIGMAP}},
                    {"name": "runs", "persistentVolumeClaim": {"claimName": RUNS_CLAIM}}],
    }
    if k.service_account:
        pod["serviceAccountName"] = k.service_account
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": SUPERVISOR, "labels": _labels("supervisor")},
        "spec": {
            "backoffLimit": k.supervisor_restarts,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {
                    "containerName": "supervisor", "operator": "In",
                    "values": [FAILED_EXIT]}},
                # A drained or preempted node is no fault of the supervisor's.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                           "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": _labels("supervisor")}, "spec": pod},
        },
    }


def _runs_claim(cfg: Config) -> dict[str, Any]:
    k = cfg.deploy.kubernetes
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": k.runs_storage}}}
    if k.storage_class:
        spec["storageClassName"] = k.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": RUNS_CLAIM}, "spec": spec}


def _agents_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": AGENTS_SERVICE, "labels": _labels("agent")},
        # Headless: ranks reach node rank 0's pod by its IP (MASTER_ADDR).
        "spec": {"clusterIP": "None", "selector": _labels("agent")},
    }


def _index_env() -> dict[str, Any]:
    return {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}


def _agent_resources(cfg: Config) -> dict[str, Any]:
    k, c = cfg.deploy.kubernetes, cfg.cluster
    limits: dict[str, Any] = {}
    resource = k.accelerator_resource or _ACCELERATOR_RESOURCE.get(c.accelerator)
    if resource:
        limits[resource] = c.procs_per_node
    if k.efa:
        limits["vpc.amazonaws.com/efa"] = k.efa
    requests = {key: value for key, value in (("cpu", k.cpu), ("memory", k.memory)) if value}
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _agents_job(cfg: Config) -> dict[str, Any]:
    k, c = cfg.deploy.kubernetes, cfg.cluster
    pods = c.nodes + c.spares
    node_id = "agent-$(JOB_COMPLETION_INDEX)"
    owned = [CACHE_DIR, *sorted(k.host_paths)]
    agent = {
        "name": "agent",
        "image": IMAGE,
        "command": ["orchestrator", "agent"],
        "args": [f"--head=http://{SUPERVISOR}:{API_PORT}", f"--node-id={node_id}",
                 "--addr=$(POD_IP)", f"--procs={c.procs_per_node}", "--run-dir=/scratch/run",
                 f"--token-file={CREDENTIAL_DIR}/token", "--orphan-timeout=600"],
        "env": [_index_env(),
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "securityContext": _non_root(),
        "volumeMounts": [
            {"name": "credential", "mountPath": CREDENTIAL_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_DIR},
            *({"name": _host_volume(i), "mountPath": path}
              for i, path in enumerate(sorted(k.host_paths))),
            {"name": "run", "mountPath": "/scratch/run"},
            {"name": "shm", "mountPath": "/dev/shm"}],
    }
    resources = _agent_resources(cfg)
    if resources:
        agent["resources"] = resources
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # the supervisor restarts ranks; a new pod replaces a lost one
        "subdomain": AGENTS_SERVICE,
        "terminationGracePeriodSeconds": int(cfg.timeouts.stop_grace_s) + 30,
        "securityContext": {"fsGroup": _USER},
        "initContainers": [
            # hostPath directories are created root-owned: hand them to the image's user.
            {"name": "cache-owner", "image": IMAGE,
             "command": ["chown", f"{_USER}:{_USER}", *owned],
             "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
             "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR},
                              *({"name": _host_volume(i), "mountPath": path}
                                for i, path in enumerate(sorted(k.host_paths)))]},
            # This pod against the job's config: its index, the pod count it was rendered
            # for, the optional modules the job needs in this image. One line, then stop.
            {"name": "validate", "image": IMAGE,
             "command": ["orchestrator", "validate", f"{CONFIG_DIR}/job.yaml"],
             "env": [_index_env(), {"name": NODE_COUNT, "value": str(pods)}],
             "securityContext": _non_root(),
             "volumeMounts": [{"name": "job", "mountPath": CONFIG_DIR, "readOnly": True}]},
            # The job secret reaches this init container only: it writes the node's own
            # credential (HMAC of the secret and the node id) into a memory volume, and the
            # agent mounts that alone, so an agent can speak for its own node and no other.
            {"name": "node-credential", "image": IMAGE,
             "command": ["orchestrator", "node-credential"],
             "args": [f"--node-id={node_id}", f"--token-file={SECRET_DIR}/token",
                      f"--out={CREDENTIAL_DIR}/token"],
             "env": [_index_env()],
             "securityContext": _non_root(),
             "volumeMounts": [{"name": "token", "mountPath": SECRET_DIR, "readOnly": True},
                              {"name": "credential", "mountPath": CREDENTIAL_DIR}]},
        ],
        "containers": [agent],
        "volumes": [
            {"name": "token", "secret": {"secretName": TOKEN_SECRET, "defaultMode": 0o400}},
            {"name": "credential", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            {"name": "job", "configMap": {"name": JOB_CONFIGMAP}},
            {"name": "cache", "hostPath": {"path": k.cache_host_path,
                                           "type": "DirectoryOrCreate"}},
            *({"name": _host_volume(i), "hostPath": {"path": k.host_paths[path],
                                                     "type": "DirectoryOrCreate"}}
              for i, path in enumerate(sorted(k.host_paths))),
            {"name": "run", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
        ],
    }
    if k.service_account:
        pod["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        pod["tolerations"] = [t.manifest() for t in k.tolerations]
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": AGENTS, "labels": _labels("agent")},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,  # cluster.nodes + cluster.spares
            "parallelism": pods,  # all at once: the supervisor waits for every node
            "backoffLimitPerIndex": 3,  # a pod that keeps failing on its node stops
            "maxFailedIndexes": c.spares,  # ... and more such indexes than spares fail it
            "template": {"metadata": {"labels": _labels("agent")}, "spec": pod},
        },
    }


def _host_volume(i: int) -> str:
    return f"host-{i}"
