"""Python stacks of a rank, from inside (faulthandler on SIGUSR1) or from outside (py-spy).

The preload hook and the SDK install faulthandler on SIGUSR1, but a rank may not have it:
the hook was bypassed, or the script reset or replaced the handler. SIGUSR1's default action
kills the process, so the agent asks ``/proc`` first and, where no handler would run (none
installed, or the process is stopped), reads the stacks from outside with ``py-spy dump --nonblocking`` (a PyPI dependency), which works
on a running or a stopped process and never pauses or kills it.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
from pathlib import Path

_PYSPY_TIMEOUT_S = 10.0


def _status_field(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def catches(pid: int, sig: signal.Signals) -> bool | None:
    """Whether ``pid`` has a handler for ``sig`` (None: /proc cannot tell, not Linux)."""
    mask = _status_field(pid, "SigCgt")
    if mask is None:
        return None
    try:
        return bool(int(mask, 16) >> (int(sig) - 1) & 1)
    except ValueError:
        return None


def stopped(pid: int) -> bool:
    """True when ``pid`` is stopped (state T: SIGSTOP, or t: a tracer)."""
    state = _status_field(pid, "State")
    return bool(state) and state[0] in "Tt"


def needs_outside_dump(pid: int, sig: signal.Signals = signal.SIGUSR1) -> bool:
    """Take ``pid``'s stacks from outside: the signal would kill it (no handler), or it is
    stopped. A stopped rank stays stopped: it was judged hung, and waking it so its handler
    could answer would let it train on, and commit checkpoints, until its kill."""
    return stopped(pid) or catches(pid, sig) is False


def pyspy() -> str | None:
    """The py-spy executable: beside this interpreter (a virtualenv), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


async def dump_outside(pid: int, out: Path, *, label: str) -> bool:
    """Append ``py-spy dump`` of ``pid`` to ``out``; False (with the reason in ``out``) when
    py-spy is missing or fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    exe = pyspy()
    if exe is None:
        with out.open("a") as f:
            f.write(f"{label}: no stack dump: the rank has no SIGUSR1 handler and py-spy is "
                    "not installed\n")
        return False
    why = "stopped" if stopped(pid) else "no SIGUSR1 handler"
    proc = await asyncio.create_subprocess_exec(
        exe, "dump", "--pid", str(pid), "--nonblocking",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL)
    try:
        text, _ = await asyncio.wait_for(proc.communicate(), _PYSPY_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        text = f"py-spy dump timed out after {_PYSPY_TIMEOUT_S:.0f} s".encode()
    header = f"{label}: stacks read from outside by py-spy (pid {pid}, " \
             f"{why})\n"
    with out.open("a") as f:
        f.write(header + text.decode(errors="replace"))
    return proc.returncode == 0
