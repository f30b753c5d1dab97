"""The training worker's entry point: parse, build, run, close (in ``try/finally``).

Runs under the orchestrator (one process per rank, started by the node agent) or on its own
under torchrun: ``torchrun --nproc-per-node 2 -m trainer --config configs/local.yaml``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import orchestrator.worker as ow
from orchestrator.contracts import chaos
from orchestrator.contracts import env as ec


def _log(rank: int):
    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} rank {rank}] {msg}", flush=True)
    return log


def process_start_time() -> float | None:
    """Wall time this process was created (Linux /proc), for the start-up breakdown.

    Its age is /proc/uptime (centiseconds) minus its start in clock ticks since boot;
    /proc/stat's btime is whole seconds, too coarse for a sub-second launch.
    """
    try:
        import os

        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    import os

    handoff = ec.handoff_ts(os.environ)  # started in a pre-imported spare
    startup = {"process_start": handoff if handoff is not None else process_start_time(),
               "main": time.time(), "warm": handoff is not None}
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("--config", help=f"Job YAML (default: {ec.CONFIG} from the agent).")
    args = parser.parse_args(argv)

    # FSDP2 on a CPU mesh warns that DTensor's RNG tracker is incomplete there; our init
    # draws from the global generator on purpose (identical on every rank), so the warning
    # is noise in every rank's log.
    warnings.filterwarnings("ignore", message="DTensor random operators may not have")
    worker = ow.init()
    ctx = worker.ctx
    log = _log(ctx.rank)
    code = chaos.start_exit_code(ctx.chaos, ctx.rank)
    if code is not None:
        log(chaos.START_FAILURE)
        return code

    from trainer.build import build_parts, digest_ahead
    from trainer.distributed import init_distributed, teardown
    from trainer.loop import train
    from trainer.settings import load_settings

    startup["imports_done"] = time.time()

    settings = load_settings(args.config or ctx.config_path, job=ctx.job if ctx.managed else None,
                             checkpoint_root=ctx.checkpoint_root)
    # What this rank writes (its checkpoint files) may be read as checkpoint.mode says.
    os.umask(settings.checkpoint.umask)
    if settings.trainer.parallelism.compile and ctx.managed:
        load_compile_cache(startup)
    startup.update(standby_figures())
    ahead = digest_ahead(settings, ctx)  # overlaps the process groups' set-up
    dctx = init_distributed(settings.trainer, marks=startup)
    startup["dist_ready"] = time.time()
    parts = None
    trained = False
    try:
        parts = build_parts(settings, dctx, ctx, worker, log, marks=startup, ahead=ahead)
        startup["built"] = time.time()  # model, optimizer, data, and the checkpoint restore
        parts.startup = startup
        train(parts)  # returns in the ``finishing`` phase
        trained = True
        log(f"done: step {parts.progress.step}, {parts.progress.tokens} tokens")
    finally:
        if parts is not None:
            parts.checkpointer.close()
            if parts.memory is not None:
                parts.memory.close()
        # After a completed run every rank leaves together (as NCCL's teardown does anyway);
        # after an error, a peer may be gone: no collective then.
        teardown(dctx if trained else None)
        ow.shutdown()
    return 0


def standby_figures() -> dict[str, float]:
    """What this process's warm standby preparation did ahead (seconds, graphs compiled,
    the compile copy's peak MiB), for the ``startup`` event; nothing for a cold start."""
    from trainer.standby import PREPARED

    return {f"standby_{k}": float(v) for k, v in PREPARED.items()
            if k.endswith(("_s", "_graphs", "_mib")) and isinstance(v, int | float)
            and not isinstance(v, bool) and 0 <= v < 1e9}


def load_compile_cache(startup: dict) -> None:
    """The job's compile artifacts, unless this process's warm standby loaded them."""
    import os

    from trainer.standby import PREPARED, compile_cache_path, load_compile_cache

    if "compile_cache" in PREPARED:
        return
    path = compile_cache_path(os.environ)
    if path is not None and path.is_file():
        try:
            load_compile_cache(path)
        except (OSError, RuntimeError, ValueError):  # stale or torn: compile afresh
            return
        startup["compile_cache_loaded"] = time.time()


def cli() -> int:
    """``python -m trainer``: :func:`main`, then its released process groups freed before
    the interpreter's finalization (``orchestrator.worker.exitgc``)."""
    from orchestrator.worker.exitgc import collect_released_groups

    code = main()
    collect_released_groups()
    return code


if __name__ == "__main__":
    sys.exit(cli())
