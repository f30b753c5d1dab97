"""Real servers started by tests: sshd (openssh-server), a one-node Slurm with munge, etcd."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require(*paths: str) -> None:
    missing = [p for p in paths if not (shutil.which(p) or Path(p).exists())]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (.ci/run installs them)")


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _stop_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(path.read_text().strip()), signal.SIGTERM)


@dataclass(frozen=True)
class Sshd:
    port: int
    identity: Path
    user: str = "root"


@contextlib.contextmanager
def sshd(workdir: Path) -> Iterator[Sshd]:
    """An sshd on 127.0.0.1 with its own config, host key and authorized key."""
    _require("/usr/sbin/sshd", "ssh", "ssh-keygen")
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                        str(workdir / name)], check=True)
    auth = workdir / "authorized_keys"
    shutil.copy(workdir / "id.pub", auth)
    auth.chmod(0o600)
    port = free_port()
    conf = workdir / "sshd_config"
    conf.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {workdir / 'host_key'}",
        f"AuthorizedKeysFile {auth}", f"PidFile {workdir / 'sshd.pid'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", ""]))
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation dir
    subprocess.run(["/usr/sbin/sshd", "-f", str(conf), "-E", str(workdir / "sshd.log")],
                   check=True)
    try:
        _wait_port(port)
        yield Sshd(port, workdir / "id")
    finally:
        _stop_pidfile(workdir / "sshd.pid")


@contextlib.contextmanager
def slurm(workdir: Path) -> Iterator[dict[str, str]]:
    """munged + slurmctld + slurmd for this one machine; yields the env to use it."""
    _require("munged", "slurmctld", "slurmd", "salloc", "srun")
    host = socket.gethostname()
    for sub in ("state", "spool", "log", "munge"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    munge = workdir / "munge"
    munge.chmod(0o700)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = munge / "sock"
    subprocess.run(["munged", "--force", "-S", str(sock), f"--key-file={key}",
                    f"--pid-file={munge / 'pid'}", f"--log-file={munge / 'log'}",
                    f"--seed-file={munge / 'seed'}"], check=True)
    ctl_port, d_port = free_port(), free_port()
    conf = workdir / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=orchtest", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctl_port}", f"SlurmdPort={d_port}", "AuthType=auth/munge",
        f"AuthInfo=socket={sock}", "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={workdir / 'state'}", f"SlurmdSpoolDir={workdir / 'spool'}",
        f"SlurmctldPidFile={workdir / 'slurmctld.pid'}",
        f"SlurmdPidFile={workdir / 'slurmd.pid'}",
        f"SlurmctldLogFile={workdir / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={workdir / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
        "MpiDefault=none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} RealMemory=2000 "
        "State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES", ""]))
    env = {"SLURM_CONF": str(conf)}
    full_env = {**os.environ, **env}
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=full_env)
        subprocess.run(["slurmd", "-f", str(conf)], check=True, env=full_env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                 env=full_env)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed"):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"slurm did not come up: {out.stdout} {out.stderr}")
        yield env
    finally:
        for pidfile in ("slurmd.pid", "slurmctld.pid"):
            _stop_pidfile(workdir / pidfile)
        _stop_pidfile(munge / "pid")
        time.sleep(0.5)


@contextlib.contextmanager
def etcd(workdir: Path) -> Iterator[str]:
    """A one-member etcd (Debian's etcd-server) on 127.0.0.1; yields its client URL."""
    _require("etcd")
    workdir.mkdir(parents=True, exist_ok=True)
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with open(workdir / "etcd.log", "ab") as log:
        proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(workdir / "data"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"t={peer_url}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_port(client)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
