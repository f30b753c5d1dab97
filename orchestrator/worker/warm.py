"""A pre-imported spare interpreter: imports the worker's heavy modules ahead of time, then
waits to be told what to run.

The node agent keeps one of these per local rank while a generation trains. When the next
generation starts (after a failure), the agent hands each spare its rank's environment and
argv on stdin instead of starting a fresh interpreter, so a restart does not pay for
importing torch again (6.4 s of a 30 s recovery on an H100, 5.5 s of 8.5 s on a CPU).

    python -u -m orchestrator.worker.warm --preload trainer.main \
        [--prepare trainer.standby:prepare --local-rank 1]

With ``--prepare``, the spare is a warm standby: after the imports it calls the function with
its local rank (our trainer's creates the device context, loads the compile cache and
page-locks the rank's memory-tier slots); a preparation that fails leaves a plain spare.

Protocol: one JSON line on stdin, ``{"env": {...}, "argv": [...], "module": "trainer",
"log": "/path/rank-00001.log"}`` (or ``"path": "train.py"`` for a user's script); the spare
points its stdout and stderr at the log, takes the environment as its own and runs the
module (or the script, its directory first on ``sys.path``) as ``__main__``. End of input without a line
(the agent went away or retired it) exits quietly. Nothing here touches a GPU before the
hand-off, so CUDA_VISIBLE_DEVICES and friends still apply.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import time

from orchestrator.contracts import env as ec
from orchestrator.worker import hook


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.worker.warm")
    parser.add_argument("--preload", action="append", default=[],
                        help="module to import ahead of time (repeatable)")
    parser.add_argument("--prepare", default=None,
                        help="MODULE:FUNCTION called with the local rank after the imports")
    parser.add_argument("--local-rank", type=int, default=0)
    args = parser.parse_args()
    for name in args.preload:
        importlib.import_module(name)
    if args.prepare:
        prepare(args.prepare, args.local_rank)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    spec = json.loads(line)
    handoff = time.time()
    log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(spec["env"])
    # The start-up breakdown counts from here, not from the spare's own start.
    os.environ[ec.WARM_HANDOFF_TS] = repr(handoff)
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    # A fresh rank ran the preload hook at interpreter start; a spare started before it
    # had a rank's environment, so it installs the hook now.
    hook.install()
    if "path" in spec:  # a user's script: run as `python SCRIPT.py` runs it
        script = os.path.abspath(spec["path"])
        sys.argv = [spec["path"], *spec.get("argv", [])]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
        return 0
    sys.argv = [spec["module"], *spec.get("argv", [])]
    runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
    return 0


def prepare(spec: str, local_rank: int) -> None:
    """Run the standby's preparation ``MODULE:FUNCTION(local_rank)``; its failure is
    written to stderr and leaves a plain spare (a rank started in it prepares itself)."""
    module, _, func = spec.partition(":")
    try:
        getattr(importlib.import_module(module), func or "prepare")(local_rank)
    except Exception as exc:  # noqa: BLE001 - a spare still saves the imports
        print(f"standby preparation {spec} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
