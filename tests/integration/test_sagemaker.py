"""The SageMaker launcher: two "hosts" of a training job on this machine, and submit.

Each host is `orchestrator sagemaker host` with the environment and files SageMaker gives
a training container (resourceconfig.json, the config channel, /opt/ml/model,
/opt/ml/checkpoints), every /opt/ml path pointed at a temporary directory. The hosts are
127.0.0.1 and 127.0.0.2 (both this machine's loopback), so each binds its own address.
`submit` runs against moto's SageMaker and S3.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from jobs import env, journal, status, write_config
from servers import free_port

from orchestrator.launchers.sagemaker import (
    SageMakerEnvError,
    leader_overrides,
    parse_resource_config,
    read_env,
)
from orchestrator.launchers.sagemaker_submit import SubmitSpec, training_job_request

HOSTS = ["127.0.0.1", "127.0.0.2"]
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/orchestrator:0.1.0"


def _host_env(root: Path, host: str, token: str) -> dict[str, str]:
    base = root / host
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
        {"current_host": host, "hosts": HOSTS, "network_interface_name": "lo"}))
    return {**env(), "ORCH_TOKEN": token,
            "SM_INPUT_CONFIG_DIR": str(base / "input" / "config"),
            "SM_CHANNEL_CONFIG": str(root / "channel"),  # both hosts get the same copy
            "SM_MODEL_DIR": str(base / "model"),
            # SageMaker syncs each host's own dir with S3; the leader's is what this job
            # writes, so one shared directory stands for the S3 prefix here.
            "SM_CHECKPOINT_DIR": str(root / "checkpoints"),
            "SM_OUTPUT_DIR": str(base / "output"),
            "SM_OUTPUT_DATA_DIR": str(base / "output" / "data")}


@pytest.mark.slow
def test_two_hosts_train_recover_and_export_the_model(tmp_path: Path, dataset_dir: Path) -> None:
    (tmp_path / "channel").mkdir()
    write_config(tmp_path / "channel" / "job.yaml", dataset_dir, trainer={"steps": 25},
                 chaos={"kill": [{"step": 14, "rank": 1}]},
                 launcher={"python": sys.executable, "sagemaker": {"port": free_port()}})
    token = secrets.token_urlsafe(16)
    procs = {}
    try:
        # The second host first: its agent waits for the supervisor, as on SageMaker.
        for host in reversed(HOSTS):
            with open(tmp_path / f"{host}.log", "wb") as log:
                procs[host] = subprocess.Popen(
                    [sys.executable, "-m", "orchestrator", "sagemaker", "host"],
                    env=_host_env(tmp_path, host, token), stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)
        # The leader first: when it fails, the other host's agent would wait out its orphan
        # timeout (300 s) for a supervisor that is gone.
        codes = {HOSTS[0]: procs[HOSTS[0]].wait(timeout=300)}
        if codes[HOSTS[0]] == 0:
            codes[HOSTS[1]] = procs[HOSTS[1]].wait(timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {h: (tmp_path / f"{h}.log").read_text()[-3000:] for h in HOSTS}
    assert codes == {h: 0 for h in HOSTS}, logs
    run = tmp_path / HOSTS[0] / "output" / "data" / "run"
    st_ = status(run)
    assert st_["state"] == "COMPLETED" and st_["last_step"] == 25, st_
    assert sorted(st_["nodes"]) == HOSTS
    assert [r["cause"] for r in st_["restarts"]] == ["worker_exit"]
    launches = [e for e in journal(run) if e["kind"] == "generation_launched"]
    assert launches and all(sorted(e["nodes"]) == HOSTS for e in launches)
    # Checkpoints under the SageMaker checkpoint dir, the model under the model dir.
    assert (tmp_path / "checkpoints" / "t" / "step-00000020" / "manifest.json").exists()
    model = tmp_path / HOSTS[0] / "model"
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    assert list(model.glob("*.safetensors"))
    assert not (tmp_path / HOSTS[0] / "output" / "failure").exists()
    # The second host's agent ran rank 1 and logged under its own output dir.
    assert list((tmp_path / HOSTS[1] / "output" / "data" / "run").rglob("*"))
    assert token not in (run / "config.yaml").read_text()


def test_the_first_host_leads_and_the_instance_count_sets_the_nodes(tmp_path: Path) -> None:
    environ = {"SM_HOSTS": json.dumps(["algo-1", "algo-2", "algo-3"]),
               "SM_CURRENT_HOST": "algo-2", "SM_CHECKPOINT_DIR": str(tmp_path / "ck")}
    sm = read_env(environ)
    assert sm.leader == "algo-1" and not sm.is_leader
    assert sm.head_url(9410) == "http://algo-1:9410"
    assert sm.model_dir == Path("/opt/ml/model")  # the real default, never written here
    sets = leader_overrides(sm, port=9410, spares=1, checkpoint_url=None)
    assert "cluster.nodes=2" in sets and f"checkpoint.url={tmp_path / 'ck'}" in sets
    s3 = leader_overrides(sm, port=9410, spares=0, checkpoint_url="s3://b/ck")
    assert not any(s.startswith("checkpoint.url") for s in s3)
    with pytest.raises(SageMakerEnvError):
        leader_overrides(sm, port=9410, spares=3, checkpoint_url=None)
    with pytest.raises(SageMakerEnvError, match="not inside a SageMaker"):
        read_env({"SM_INPUT_CONFIG_DIR": str(tmp_path / "none")})


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=200),
    st.builds(lambda c, h: json.dumps({"current_host": c, "hosts": h}),
              st.one_of(st.text(max_size=20), st.integers(), st.none()),
              st.one_of(st.lists(st.text(max_size=12), max_size=5), st.text(max_size=5),
                        st.none())),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                     max_size=3),
                 max_leaves=8).map(json.dumps)))
def test_resourceconfig_fuzz_parses_or_says_why(text: str) -> None:
    """Any resourceconfig.json is either a valid host list or SageMakerEnvError."""
    try:
        current, hosts = parse_resource_config(text)
    except SageMakerEnvError:
        return
    assert current in hosts and len(set(hosts)) == len(hosts)
    assert all(h and set(h) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                    "0123456789.-_") for h in hosts)


def test_submit_creates_the_training_job_on_moto(tmp_path: Path, dataset_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from moto import mock_aws

    from orchestrator.config import load_config
    from orchestrator.launchers.sagemaker_submit import submit

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    cfg_path = write_config(tmp_path / "job.yaml", dataset_dir)
    cfg = load_config(cfg_path, [])
    spec = SubmitSpec(job_name="llama-1", image=IMAGE, instance_type="ml.p5.48xlarge",
                      instance_count=2, role_arn=ROLE, output_s3="s3://jobs/out",
                      checkpoint_s3="s3://jobs/ck/llama-1", max_runtime_s=3600, volume_gb=100)
    request = training_job_request(spec, "tok")
    with mock_aws():
        import boto3

        boto3.client("s3").create_bucket(Bucket="jobs")
        body = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        arn = submit(request, spec, body, region="us-east-1")
        assert arn.endswith(":training-job/llama-1")
        job = boto3.client("sagemaker").describe_training_job(TrainingJobName="llama-1")
        assert job["AlgorithmSpecification"]["TrainingImage"] == IMAGE
        assert job["ResourceConfig"]["InstanceType"] == "ml.p5.48xlarge"
        assert job["ResourceConfig"]["InstanceCount"] == 2
        assert job["RoleArn"] == ROLE
        assert job["CheckpointConfig"] == {"S3Uri": "s3://jobs/ck/llama-1",
                                           "LocalPath": "/opt/ml/checkpoints"}
        uri = job["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"]
        assert uri == "s3://jobs/out/llama-1/config"
        got = boto3.client("s3").get_object(Bucket="jobs", Key="out/llama-1/config/job.yaml")
        uploaded = tmp_path / "uploaded.yaml"
        uploaded.write_bytes(got["Body"].read())
    assert load_config(uploaded, []) == cfg  # the uploaded config is the validated one


def test_submit_dry_run_prints_the_request_without_the_token(tmp_path: Path,
                                                             dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir)
    cmd = [sys.executable, "-m", "orchestrator", "sagemaker", "submit", str(cfg),
           "--image", IMAGE, "--instance-type", "ml.trn1.32xlarge", "--instance-count", "2",
           "--role", ROLE, "--output-s3", "s3://jobs/out", "--job-name", "dry-1", "--dry-run"]
    # No AWS credentials at all: a dry run must not reach for them.
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in env().items() if not k.startswith("AWS_")})
    assert out.returncode == 0, out.stderr
    request = json.loads(out.stdout)
    assert request["TrainingJobName"] == "dry-1"
    assert request["ResourceConfig"]["InstanceType"] == "ml.trn1.32xlarge"
    assert request["AlgorithmSpecification"]["ContainerEntrypoint"] == \
        ["orchestrator", "sagemaker", "host"]
    assert request["Environment"]["ORCH_TOKEN"] == "***"
    bad = subprocess.run([*cmd[:-1], "--instance-type", "p5.48xlarge", "--dry-run"],
                         capture_output=True, text=True, timeout=60, env=env())
    assert bad.returncode == 2 and "instance_type" in bad.stderr


def test_submit_dry_run_refuses_what_cannot_run_and_says_where_checkpoints_go(
        tmp_path: Path, dataset_dir: Path) -> None:
    """--instance-count 1 with spares: 1 leaves no node (validate refuses 0 nodes): an error,
    not exit 0. Several instances with a local checkpoint directory: a warning. An s3://
    checkpoint.url: no CheckpointConfig pointing somewhere else, and the reason said."""
    def dry(cfg: Path, count: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "orchestrator", "sagemaker", "submit", str(cfg),
               "--image", IMAGE, "--instance-type", "ml.p5.48xlarge", "--instance-count",
               count, "--role", ROLE, "--output-s3", "s3://jobs/out", "--job-name", "j-1",
               "--dry-run", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              env={**env(), "COLUMNS": "250"})

    spare = write_config(tmp_path / "spare.yaml", dataset_dir, cluster={"nodes": 2,
                                                                        "spares": 1})
    none_left = dry(spare, "1")
    assert none_left.returncode == 2, none_left.stdout
    assert "leaves no node" in none_left.stderr and not none_left.stdout
    # A count the config's own rules refuse (a chaos kill of rank 3 in a 2-rank world).
    killed = write_config(tmp_path / "kill.yaml", dataset_dir,
                          chaos={"kill": [{"step": 5, "rank": 3}]})
    refused = dry(killed, "2")
    assert refused.returncode == 2 and "chaos.kill.0.rank" in refused.stderr
    assert dry(killed, "4").returncode == 0

    local = dry(write_config(tmp_path / "local.yaml", dataset_dir), "2")
    assert local.returncode == 0, local.stderr
    said = " ".join(local.stderr.split())
    assert "warning: 2 instances each keep their own /opt/ml/checkpoints" in said
    assert json.loads(local.stdout)["CheckpointConfig"]["S3Uri"] == "s3://jobs/out/j-1/checkpoints"

    on_s3 = write_config(tmp_path / "s3.yaml", dataset_dir,
                         checkpoint={"url": "s3://ckpts/llama"})
    remote = dry(on_s3, "2", "--checkpoint-s3", "s3://elsewhere/x")
    assert remote.returncode == 0, remote.stderr
    request = json.loads(remote.stdout)
    assert "CheckpointConfig" not in request
    said = " ".join(remote.stderr.split())
    assert "checkpoints: s3://ckpts/llama/t (checkpoint.url)" in said
    assert "--checkpoint-s3 s3://elsewhere/x is not used" in said
    assert "warning" not in said
