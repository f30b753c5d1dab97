"""No rank holds the signing key, and the run directory is private: a
real local job whose ranks are a probe script (``scripts/key_probe.py``).

Before, ``ORCH_CHECKPOINT_KEY_FILE`` was in every rank's environment, so any rank could sign a
pickle into ``.metadata``; the run directory's journal, steps, config and logs were 0644 in
0755 directories. Now the key stays in the node agent, which signs a durable manifest for
rank 0 only and a memory copy only for the rank it names, answers only the asking rank's own
process, and is closed to ``/proc`` reads by its ranks; every file the job writes is 0600 in
0700 directories.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from jobs import up, write_config

from trainer.checkpoint import signing

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "key_probe.py"


def test_ranks_never_hold_the_key_and_the_run_directory_is_private(
        tmp_path: Path, dataset_dir: Path) -> None:
    key = signing.write_key_file(tmp_path / "job.key")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": [sys.executable, str(SCRIPT)],
                            # The operator names the key for the job: still not the ranks'.
                            "env": {signing.KEY_FILE_ENV: str(key)}},
                       # Both ranks under one agent: each may try to pass for the other.
                       cluster={"nodes": 1, "procs_per_node": 2},
                       health={"preflight": "off"})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    job_key = signing.read_key_file(key)
    for rank in (0, 1):
        probe = json.loads((run / f"probe-{rank}.json").read_text())
        secret = {"ORCH_CHECKPOINT_KEY", "ORCH_CHECKPOINT_KEY_FILE", "ORCH_TOKEN"}
        assert not secret & set(probe["env"]), probe["env"]
        # The agent answers its own rank with the key's public id, never the key.
        assert probe["key_id"] == {"ok": signing.key_id(job_key)}
        # Only rank 0 commits a checkpoint's manifest; each rank signs its own memory copy.
        manifest = {"format": "orchestrator-checkpoint/2", "step": 7, "files": {}}
        if rank == 0:
            signed = {**manifest, signing.SIGNATURE: probe["sign_manifest"]["ok"]}
            assert signing.check(signed, job_key)[0] == signing.SIGNED
        else:
            assert "rank 0's" in probe["sign_manifest"]["refused"]
        assert "ok" in probe["sign_own_memory"]
        assert "only its own" in probe["sign_other_memory"]["refused"]
        # Another rank's number, from this process: refused.
        assert "not rank" in probe["as_other_rank"]["refused"]
        assert "does not run here" in probe["as_rank_9"]["refused"]
        # The agent (its parent) is closed to its user's processes: no environment, no
        # memory (root reads them anyway: the check needs a test run as another user;
        # tests/unit/orchestrator/test_keyservice.py checks the flag itself).
        if os.geteuid() != 0:
            assert probe["agent_environ"] == "PermissionError", probe
            assert probe["agent_mem"] == "PermissionError", probe
    # Everything the job wrote is its operator's alone.
    loose = []
    for path in [run, *run.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_IMODE(st.st_mode) & ~want or (stat.S_ISDIR(st.st_mode) and
                                                 stat.S_IMODE(st.st_mode) != 0o700):
            loose.append(f"{path.relative_to(run)} {oct(stat.S_IMODE(st.st_mode))}")
    assert not loose, loose
    assert os.stat(run).st_mode & 0o077 == 0
