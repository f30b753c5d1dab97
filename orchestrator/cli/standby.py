"""``orchestrator up`` with ``leader.etcd``: campaign first, then lead or take over the run.

Every supervisor of a job with ``leader.etcd`` set campaigns for its etcd lock before it does
anything (``supervisor.leader``). The first one (`up CONFIG --run-dir RUN`) wins at once and
starts the job. A standby (`up CONFIG --run-dir RUN --standby`, on another host, the run
directory on shared storage) waits; when it wins, the run directory's journal is the job:
it resumes it with the run's own config, as `up --resume` would, and agents find it through
the supervisor URLs they were given (``leader.urls``).
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import Config
from orchestrator.config.loader import read_yaml, validate_data
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.state import JobState
from orchestrator.supervisor.leader import Leadership


class NothingToLead(Exception):
    """The job of the run directory has ended (or was stopped): a standby does not revive it."""

    def __init__(self, state: JobState) -> None:
        super().__init__(state.value)
        self.state = state


def standby_problem(config: Path | None, run_dir: Path | None, resume: Path | None,
                    detach: bool) -> str | None:
    """Why `up --standby` cannot run with these arguments (None: it can)."""
    if resume is not None:
        return "--standby takes the run directory with --run-dir (it resumes it on its own)"
    if run_dir is None or config is None:
        return "--standby needs the job's config and --run-dir (the run directory on " \
               "shared storage, the leader's)"
    if detach:
        return "--standby runs in the foreground (a systemd unit or a pod keeps it)"
    return None


def _has_job(run: RunDir) -> bool:
    return run.journal.exists() and run.journal.stat().st_size > 0


async def lead(cfg: Config, run: RunDir, resumed: bool, standby: bool,
               ) -> tuple[Leadership | None, Config, bool]:
    """Campaign when the job has a leader election; returns (leadership, the config and
    whether the run is resumed), the lease kept from a thread from the moment it is won.
    Without ``leader.etcd``: nothing to do."""
    if not cfg.leader.etcd:
        return None, cfg, resumed
    from orchestrator.logs import get_logger

    leadership = Leadership(cfg.leader.etcd, cfg.leader.lock_name(cfg.job.name),
                            cfg.leader.lease_ttl_s, get_logger("orchestrator.leader"))
    await leadership.campaign()
    leadership.start_keeping()
    if standby and _has_job(run):
        from orchestrator.journal.status import load_view

        # The run's own config, as `up --resume` takes it (the standby's copy may differ).
        cfg = validate_data(read_yaml(run.config), str(run.config))
        state = load_view(run).state
        if state.terminal or state is JobState.STOPPED:
            await leadership.resign()
            raise NothingToLead(state)
        resumed = True
    elif standby:
        run.root.mkdir(parents=True, exist_ok=True)
    return leadership, cfg, resumed
