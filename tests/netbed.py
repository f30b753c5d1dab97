"""A multi-host test bed in network namespaces: real addresses, real network faults.

``Bed`` makes one network namespace per simulated host, each with an ``eth0`` on one bridge
(the bridge in a namespace of its own: nothing is added to the machine's own network), and
runs processes in them (``ip netns exec``). Faults are nftables rules inside a host's
namespace (``cut``, ``partition``, ``loss``: ``numgen random`` drops); this kernel has no
``tc netem``, so delay is left out. Only the bed's own namespaces and addresses are ever
targets.

Processes started in a host (sshd, etcd, agents, supervisors, and whatever they start: ranks,
ssh sessions) are found with ``ip netns pids`` and killed when the bed closes, then the
namespaces are deleted (their veths go with them), whatever the test's outcome. A bed left
behind by a killed pytest (its pid no longer lives) is removed by the next one.

The filesystem is shared by every host, as a cluster's shared filesystem (FSx, EFS) is:
the run directory and the checkpoint root are plain directories.

Root only: ``require_root_bed`` skips a test elsewhere, with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

_PREFIX = "orchbed"
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")
# The bed's own subnet: the addresses exist only inside its namespaces.
SUBNET = "10.213.7"


def require_root_bed() -> None:
    """Skip unless this process may create namespaces and nftables rules."""
    if os.geteuid() != 0:
        pytest.skip("the multi-host bed needs root (network namespaces, nftables)")
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (.ci/run installs iproute2 and "
                    "nftables)")
    probe = f"{_PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_beds() -> list[str]:
    """Namespaces of beds whose pytest is gone (killed before it could clean up)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{_PREFIX}-(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_ns(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_ns(ns: str) -> list[int]:
    """SIGKILL every process in the namespace (ranks, agents, sshd and its sessions)."""
    killed = []
    for _ in range(5):
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.1)
    return killed


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    addr: str


@dataclass
class Bed:
    """Hosts on one bridge (see the module). Use as a context manager, or ``close()``."""

    names: Sequence[str]
    tag: str = field(default_factory=lambda: f"{_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        remove_stale_beds()
        self.switch = f"{self.tag}-sw"
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names, start=1):
            ns = f"{self.tag}-{name}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{i}"
            # Both ends made inside namespaces: the machine's own has no new interface.
            _ip("link", "add", port, "netns", self.switch, "type", "veth", "peer", "name",
                "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            addr = f"{SUBNET}.{i}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = Host(name, ns, addr)
            self._nft(name, "add table inet orchfault")
            for hook in ("input", "output"):
                self._nft(name, f"add chain inet orchfault {hook} {{ type filter hook {hook} "
                                "priority 0; policy accept; }")

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- processes -------------------------------------------------------------------------
    def command(self, name: str, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].ns, *cmd]

    def popen(self, name: str, cmd: Sequence[str], *, log: Path | None = None,
              env: dict[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
        """Start ``cmd`` on host ``name`` in a session of its own (output to ``log``)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(self.command(name, cmd), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def run(self, name: str, cmd: Sequence[str],
            timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, cmd), capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, name: str) -> list[int]:
        return _ns_pids(self.hosts[name].ns)

    def wait_port(self, name: str, port: int, timeout: float = 30.0) -> None:
        """Until something listens on host ``name``'s address and ``port``."""
        addr = self.hosts[name].addr
        code = ("import socket,sys,time\n"
                f"d=time.monotonic()+{timeout}\n"
                "while time.monotonic()<d:\n"
                "    try:\n"
                f"        socket.create_connection(('{addr}',{port}),0.5).close(); sys.exit(0)\n"
                "    except OSError: time.sleep(0.1)\n"
                "sys.exit(1)\n")
        import sys

        if self.run(name, [sys.executable, "-c", code], timeout=timeout + 10).returncode:
            raise AssertionError(f"nothing listens on {addr}:{port} after {timeout} s")

    # -- faults ----------------------------------------------------------------------------
    def _nft(self, name: str, rule: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.hosts[name].ns, "nft", rule], check=True,
                       capture_output=True, text=True)

    def _rule(self, name: str, hook: str, match: str) -> None:
        self._nft(name, f"add rule inet orchfault {hook} {match}")

    def cut(self, name: str) -> float:
        """Drop everything host ``name`` sends or receives on its network (not loopback).
        Returns the wall time of the cut."""
        self._rule(name, "input", 'iifname "eth0" drop')
        self._rule(name, "output", 'oifname "eth0" drop')
        return time.time()

    def partition(self, name: str, peers: Sequence[str]) -> float:
        """Drop what host ``name`` exchanges with ``peers`` (both directions, one side)."""
        addrs = ", ".join(self.hosts[p].addr for p in peers)
        self._rule(name, "input", f"ip saddr {{ {addrs} }} drop")
        self._rule(name, "output", f"ip daddr {{ {addrs} }} drop")
        return time.time()

    def loss(self, name: str, peers: Sequence[str], percent: int) -> float:
        """Drop ``percent`` % of the packets host ``name`` exchanges with ``peers``, at
        random, each direction."""
        addrs = ", ".join(self.hosts[p].addr for p in peers)
        self._rule(name, "input", f"ip saddr {{ {addrs} }} numgen random mod 100 < {percent} "
                                  "drop")
        self._rule(name, "output", f"ip daddr {{ {addrs} }} numgen random mod 100 < {percent} "
                                   "drop")
        return time.time()

    def heal(self, name: str) -> float:
        """Remove every fault rule of host ``name``."""
        for hook in ("input", "output"):
            self._nft(name, f"flush chain inet orchfault {hook}")
        return time.time()

    def inside(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread that has joined host ``name``'s network namespace: the
        sockets it opens (a server's) live there, and so do the threads it starts (they
        inherit it). This process's own threads stay where they are."""
        import ctypes
        import threading

        out: list[Any] = []

        def run() -> None:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = os.open(f"/run/netns/{self.hosts[name].ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            finally:
                os.close(fd)
            out.append(fn())

        t = threading.Thread(target=run, name=f"netns-{name}")
        t.start()
        t.join(60)
        if not out:
            raise AssertionError(f"could not run {fn!r} inside host {name}")
        return out[0]

    # -- servers ---------------------------------------------------------------------------
    def sshd(self, name: str, workdir: Path, identity: Path) -> None:
        """An sshd on host ``name``'s address, port 22, taking ``identity``'s public key."""
        host = self.hosts[name]
        d = workdir / f"sshd-{name}"
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                        str(d / "host_key")], check=True)
        auth = d / "authorized_keys"
        shutil.copy(f"{identity}.pub", auth)
        auth.chmod(0o600)
        conf = d / "sshd_config"
        conf.write_text("\n".join([
            "Port 22", f"ListenAddress {host.addr}", f"HostKey {d / 'host_key'}",
            f"AuthorizedKeysFile {auth}", f"PidFile {d / 'sshd.pid'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", ""]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        subprocess.run(self.command(name, ["/usr/sbin/sshd", "-f", str(conf), "-E",
                                           str(d / "sshd.log")]), check=True)
        self.wait_port(name, 22)

    def etcd(self, name: str, workdir: Path, port: int = 2379) -> str:
        """An etcd on host ``name``; returns its client URL."""
        host = self.hosts[name]
        url = f"http://{host.addr}:{port}"
        d = workdir / f"etcd-{name}"
        self.popen(name, ["etcd", "--name", name, "--data-dir", str(d / "data"),
                          "--listen-client-urls", url, "--advertise-client-urls", url,
                          "--listen-peer-urls", "http://127.0.0.1:2380",
                          "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                          "--initial-cluster", f"{name}=http://127.0.0.1:2380"],
                   log=workdir / f"etcd-{name}.log")
        self.wait_port(name, port)
        return url

    # -- end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process of every host, then delete the namespaces."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for ns in self._made:
            _kill_ns(ns)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)


def identity(workdir: Path) -> Path:
    """An ssh key pair for the bed's hosts (``<workdir>/id`` and ``id.pub``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    key = workdir / "id"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
    return key


@contextlib.contextmanager
def bed(names: Sequence[str]) -> Iterator[Bed]:
    require_root_bed()
    b = Bed(names)
    try:
        yield b
    finally:
        b.close()


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
