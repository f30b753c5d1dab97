"""What `orchestrator status` prints for stragglers and profiles."""

from __future__ import annotations

import time

from rich.console import Console

from orchestrator.cli.views import profiles_table, straggler_line


def test_a_straggler_line_names_node_ranks_and_how_much_slower() -> None:
    ts = time.mktime((2026, 11, 22, 21, 31, 7, 0, 0, -1))
    line = straggler_line({"node_id": "local-1", "ranks": [1], "excess_s": 0.148,
                           "step_time_s": 0.21, "peer_step_time_s": 0.062,
                           "data_wait_s": 0.001, "peer_data_wait_s": 0.001, "ts": ts})
    assert line == ("local-1 (rank 1): +0.148 s a step (step 0.21 s vs 0.062 s, data wait "
                    "0.001 s vs 0.001 s) since 21:31:07")
    two = straggler_line({"node_id": "n3", "ranks": [6, 7], "excess_s": 1.5,
                          "step_time_s": 2.5, "peer_step_time_s": 1.0})
    assert two.startswith("n3 (ranks 6, 7): +1.5 s a step (step 2.5 s vs 1 s) since ?")


def test_the_profiles_table_shows_steps_state_size_and_where() -> None:
    table = profiles_table([
        {"id": 1, "start_step": 120, "steps": 5, "state": "written", "ranks": 2, "written": 2,
         "bytes": 3 * 2**20, "dir": "/r/profiles/120", "failed": {}, "late_ranks": [1]},
        {"id": 2, "start_step": 300, "steps": 2, "state": "failed", "ranks": 1, "written": 0,
         "bytes": 0, "dir": "/r/profiles/300", "failed": {"0": "OSError: disk full"},
         "late_ranks": []}])
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "120-124" in text and "written (late: 1)" in text and "2 / 2" in text
    assert "3.0 MiB" in text and "/r/profiles/120" in text
    assert "300-301" in text and "rank 0: OSError: disk full" in text
