"""`orchestrator deploy kubernetes|slurm|sagemaker`: every size from the one config, the
shipped examples are exactly the command's output for configs/llama2-7b-trn1-128.yaml, and
the output is checked against the real schemas (Kubernetes' OpenAPI for 1.31 and 1.37,
botocore's model of CreateTrainingJob, bash's parser); the supervisor pod's script is run
for real against a FAILED and a COMPLETED run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from jobs import env, up, write_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = "configs/llama2-7b-trn1-128.yaml"
VERSIONS = ["1.31.0", "1.37.0"]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def deploy(platform: str, config: str | Path, out: Path, *sets: str, cwd: Path = ROOT
           ) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "orchestrator", "deploy", platform,
                           str(config), "--out", str(out), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**env(), "COLUMNS": "250"})


def _objects(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"]
            for d in yaml.safe_load_all((directory / name).read_text()) if d]


@pytest.mark.parametrize(("platform", "shipped"), [
    ("kubernetes", ROOT / "deploy" / "kubernetes"),
    ("slurm", ROOT / "deploy" / "slurm"),
    ("sagemaker", ROOT / "deploy" / "sagemaker" / "llama2-7b-trn1"),
])
def test_the_shipped_examples_are_the_commands_output(platform: str, shipped: Path,
                                                      tmp_path: Path) -> None:
    done = deploy(platform, SHIPPED, tmp_path)
    assert done.returncode == 0, done.stderr
    rendered = sorted(p.name for p in tmp_path.iterdir())
    assert rendered
    for name in rendered:
        assert (shipped / name).read_text() == (tmp_path / name).read_text(), \
            f"deploy/{shipped.relative_to(ROOT / 'deploy')}/{name} is not the output of " \
            f"`orchestrator deploy {platform} {SHIPPED} --out ...`: render it again"


@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_renders_manifests_kubernetes_accepts(config: str,
                                                                   tmp_path: Path) -> None:
    done = deploy("kubernetes", f"configs/{config}", tmp_path)
    assert done.returncode == 0, done.stderr
    objects = _objects(tmp_path)
    for version in VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)
    cfg = yaml.safe_load((ROOT / "configs" / config).read_text())
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert job["launcher"]["kind"] == "kubernetes"
    cluster = {"nodes": 2, "spares": 0, "procs_per_node": 1, **(cfg.get("cluster") or {})}
    agents = next(o for o in objects if o["kind"] == "Job"
                  and o["metadata"]["name"] == "orchestrator-agent")
    pods = cluster["nodes"] + cluster["spares"]
    assert agents["spec"]["completions"] == agents["spec"]["parallelism"] == pods
    pod = agents["spec"]["template"]["spec"]
    assert f"--procs={cluster['procs_per_node']}" in pod["containers"][0]["args"]
    validate = {c["name"]: c for c in pod["initContainers"]}["validate"]
    assert {"name": "ORCH_NODE_COUNT", "value": str(pods)} in validate["env"]
    limits = pod["containers"][0].get("resources", {}).get("limits", {})
    accelerators = {k: v for k, v in limits.items() if k != "vpc.amazonaws.com/efa"}
    if cluster.get("accelerator", "cpu") == "cpu":
        assert accelerators == {}
    else:
        assert list(accelerators.values()) == [cluster["procs_per_node"]]


def test_deploy_settings_reach_the_pods(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "cluster": {"nodes": 3, "spares": 1, "procs_per_node": 8, "accelerator": "cuda"},
        "trainer": {"device": "cuda", "parallelism": {"backend": "nccl"}},
        "deploy": {"image": "registry.example/orchestrator@sha256:" + "a" * 64,
                   "kubernetes": {"efa": 32, "cpu": 90, "memory": "1000Gi",
                                  "service_account": "trainer", "namespace": "ml",
                                  "node_selector": {"node.kubernetes.io/instance-type":
                                                    "p5.48xlarge"},
                                  "tolerations": [{"key": "nvidia.com/gpu",
                                                   "operator": "Exists",
                                                   "effect": "NoSchedule"}]}}}))
    assert deploy("kubernetes", cfg, tmp_path / "out").returncode == 0
    objects = _objects(tmp_path / "out")
    for obj in objects:
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)
    agents = next(o for o in objects if o["metadata"]["name"] == "orchestrator-agent")
    pod = agents["spec"]["template"]["spec"]
    assert agents["spec"]["completions"] == 4 and agents["spec"]["maxFailedIndexes"] == 1
    assert pod["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32},
        "requests": {"cpu": "90", "memory": "1000Gi"}}
    assert pod["serviceAccountName"] == "trainer"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]  # no role: it exists
    kustomization = yaml.safe_load((tmp_path / "out" / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "ml"
    assert kustomization["images"] == [{"name": "orchestrator",
                                        "newName": "registry.example/orchestrator",
                                        "digest": "sha256:" + "a" * 64}]


def test_bad_deploy_settings_name_their_field(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("{}")
    bad = deploy("kubernetes", cfg, tmp_path / "out", "deploy.kubernetes.memory=lots",
                 "deploy.kubernetes.host_paths={/dev/shm: /x}", "deploy.kubernetes.efaa=2")
    assert bad.returncode == 2
    said = " ".join(bad.stderr.split())
    for field in ("deploy.kubernetes.memory", "deploy.kubernetes.host_paths",
                  "deploy.kubernetes.efaa"):
        assert field in said, said
    assert "did you mean efa?" in said
    assert not (tmp_path / "out").exists()


def _supervisor_script(tmp_path: Path) -> str:
    """The supervisor pod's command with its paths pointed into ``tmp_path``."""
    from orchestrator.render.kubernetes import CONFIG_DIR, RUN_DIR, supervisor_script

    return supervisor_script().replace(RUN_DIR, str(tmp_path / "runs" / "job")).replace(
        CONFIG_DIR, str(tmp_path / "etc"))


def _run_pod(tmp_path: Path, extra_env: dict[str, str]) -> int:
    bin_dir = Path(sys.executable).parent  # the `orchestrator` console script
    base = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "SM_"))}
    out = subprocess.run(["/bin/sh", "-c", _supervisor_script(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={**base, **extra_env,
                              "PATH": f"{bin_dir}:{base.get('PATH', '')}"})
    return out.returncode


def test_the_supervisor_pod_exits_by_the_jobs_state(tmp_path: Path, dataset_dir: Path) -> None:
    """FAILED: exit 3 (the Job fails, no retry); run again (a replaced pod): the same, no
    second run. COMPLETED: exit 0 (the Job completes; a Deployment restarted it forever)."""
    (tmp_path / "etc").mkdir()
    failing = tmp_path / "etc" / "job.yaml"
    write_config(failing, dataset_dir, launcher={"kind": "slurm"})
    misfit = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}
    assert _run_pod(tmp_path, misfit) == 3
    assert _run_pod(tmp_path, misfit) == 3
    events = (tmp_path / "runs" / "job" / "events.jsonl").read_text().splitlines()
    kinds = [json.loads(e)["kind"] for e in events]
    assert kinds.count("job_created") == 1 and kinds.count("supervisor_started") == 2

    done = tmp_path / "done"
    (done / "etc").mkdir(parents=True)
    write_config(done / "etc" / "job.yaml", dataset_dir, trainer={"steps": 5},
                 checkpoint={"interval_steps": 5})
    assert _run_pod(done, {}) == 0
    assert _run_pod(done, {}) == 0  # a replaced pod of a completed run: nothing to do


def test_the_sagemaker_request_fits_botocores_model(tmp_path: Path) -> None:
    import botocore.session
    from botocore.validate import validate_parameters

    request = json.loads((ROOT / "deploy" / "sagemaker" / "llama2-7b-trn1" /
                          "request.json").read_text())
    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.operation_model("CreateTrainingJob").input_shape
    validate_parameters(request, shape)  # raises ParamValidationError naming the field
    assert request["ResourceConfig"]["InstanceCount"] == 128 + 2
    broken = {**request, "ResourceConfig": {**request["ResourceConfig"], "InstanceCount": "x"}}
    with pytest.raises(Exception, match="InstanceCount"):
        validate_parameters(broken, shape)


def test_sagemaker_render_needs_its_settings_and_enough_instances(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"cluster": {"nodes": 2, "spares": 1}}))
    missing = deploy("sagemaker", cfg, tmp_path / "out")
    assert missing.returncode == 2 and "deploy.sagemaker.role_arn: not set" in missing.stderr
    sets = ["deploy.sagemaker.instance_type=ml.p5.48xlarge",
            "deploy.sagemaker.role_arn=arn:aws:iam::123456789012:role/R",
            "deploy.sagemaker.output_s3=s3://jobs/out"]
    ok = deploy("sagemaker", cfg, tmp_path / "out", *sets)
    assert ok.returncode == 0, ok.stderr
    request = json.loads((tmp_path / "out" / "request.json").read_text())
    assert request["ResourceConfig"]["InstanceCount"] == 3
    assert "3 instances each keep their own /opt/ml/checkpoints" in " ".join(ok.stderr.split())
    assert yaml.safe_load((tmp_path / "out" / "job.yaml").read_text())["launcher"]["kind"] \
        == "sagemaker"


def test_the_shipped_sbatch_parses_and_asks_for_the_configs_sizes() -> None:
    path = ROOT / "deploy" / "slurm" / "llama2-7b-trn1.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert os.access(path, os.X_OK)
    text = path.read_text()
    assert "#SBATCH --nodes=130\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --requeue\n" in text and "--gpus-per-node" not in text  # Trainium
    embedded = text.split("<<'ORCHESTRATOR_JOB_YAML'\n", 1)[1].split(
        "\nORCHESTRATOR_JOB_YAML\n", 1)[0]
    job = yaml.safe_load(embedded)
    assert job["launcher"]["kind"] == "slurm" and job["cluster"]["nodes"] == 128


def test_a_gpu_sbatch_asks_for_its_gpus(tmp_path: Path) -> None:
    done = deploy("slurm", "configs/llama3-8b-p5-fsdp2.yaml", tmp_path)
    assert done.returncode == 0, done.stderr
    (sbatch,) = tmp_path.iterdir()
    cfg = yaml.safe_load((ROOT / "configs" / "llama3-8b-p5-fsdp2.yaml").read_text())
    text = sbatch.read_text()
    c = cfg["cluster"]
    assert f"#SBATCH --nodes={c['nodes'] + c.get('spares', 0)}\n" in text
    assert f"#SBATCH --gpus-per-node={c['procs_per_node']}\n" in text
    assert subprocess.run(["bash", "-n", str(sbatch)], capture_output=True).returncode == 0


def test_a_job_whose_pods_were_rendered_for_another_size_fails_validate(
        tmp_path: Path) -> None:
    """The agents' validate init container: its pod count against the config it mounts."""
    done = deploy("kubernetes", SHIPPED, tmp_path)
    assert done.returncode == 0
    agents = next(o for o in _objects(tmp_path)
                  if o["metadata"]["name"] == "orchestrator-agent")
    init = {c["name"]: c for c in agents["spec"]["template"]["spec"]["initContainers"]}
    validate = init["validate"]
    pod_env = {e["name"]: e.get("value", "") for e in validate["env"]}
    pod_env.update(JOB_COMPLETION_INDEX="0", KUBERNETES_SERVICE_HOST="10.0.0.1")
    config = tmp_path / "job.yaml"

    def run(extra: dict[str, str]) -> subprocess.CompletedProcess:
        base = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "SM_"))}
        return subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(config)],
                              capture_output=True, text=True, timeout=120,
                              env={**base, **pod_env, **extra, "COLUMNS": "250"})

    assert run({}).returncode == 0
    edited = yaml.safe_load(config.read_text())
    edited["cluster"]["nodes"] = 64  # the ConfigMap changed, the pods were not re-rendered
    config.write_text(yaml.safe_dump(edited))
    bad = run({})
    assert bad.returncode == 1 and "rendered for 130 pod(s)" in bad.stderr, bad.stderr
