"""Preloaded into every rank the agent starts (this directory leads the rank's PYTHONPATH).

Python imports ``sitecustomize`` at start-up, before the user's script: this one installs
the orchestrator's hook (heartbeats, optimizer-step counting, stack dumps, the collective
timeout) without a line of the script changing, then runs the ``sitecustomize`` it shadows,
if any. When the hook cannot load, the rank stops here with the reason on stderr, exit code
3, so the agent reports the import error as the failure's cause at once instead of a rank
that trains unseen.
"""

import sys


def _chain() -> None:
    """Run the sitecustomize this file shadows (a distribution's or a virtualenv's)."""
    import importlib.machinery
    import importlib.util
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _install() -> None:
    try:
        from orchestrator.worker.hook import install

        install()
    except BaseException as exc:  # noqa: BLE001 - any failure here is the rank's cause
        import os
        import traceback

        traceback.print_exc()
        print(f"orchestrator preload hook failed: {type(exc).__name__}: {exc} "
              f"(sys.path={sys.path})", file=sys.stderr, flush=True)
        os._exit(3)


_install()
_chain()
