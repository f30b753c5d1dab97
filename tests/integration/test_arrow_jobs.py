"""Training from an Arrow file end to end: tokenized and packed online, killed and resumed
at the exact token (every rank's loader state in the checkpoint), bit-identical to a clean run.

Real supervisor, agents and two gloo ranks on the CPU; the Arrow file is written by the test
with pyarrow from the standard library's own source (one row per module).
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pyarrow as pa
import pytest
from jobs import assert_bit_identical, final_state_dict, status, up, write_config

pytestmark = pytest.mark.slow

STEPS = 20


@pytest.fixture(scope="module")
def arrow_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:120]]
    table = pa.table({"text": texts})
    out = tmp_path_factory.mktemp("arrow") / "stdlib.arrow"
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=32):
            writer.write_batch(batch)
    return out


def _config(tmp: Path, arrow_file: Path, **sections: object) -> Path:
    return write_config(tmp / "job.yaml", arrow_file,
                        trainer={"steps": STEPS, "data": {"format": "arrow"}}, **sections)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory, arrow_file: Path) -> Path:
    tmp = tmp_path_factory.mktemp("arrow-clean")
    result = up(_config(tmp, arrow_file), tmp / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    return tmp / "run"


def test_arrow_run_trains_and_checkpoints_each_ranks_position(clean_run: Path) -> None:
    assert status(clean_run)["state"] == "COMPLETED"
    sd = final_state_dict(clean_run / "checkpoints" / "t" / f"step-{STEPS:08d}")
    positions = {k: v for k, v in sd.items() if k.startswith("data_rank")}
    # Each rank: epoch, cursor, offset, next batch, world; the two ranks read different rows.
    assert sorted(positions) == sorted(f"data_rank{r:05d}.{k}" for r in (0, 1) for k in
                                       ("cursor", "dp_world", "epoch", "next_index", "offset"))
    assert positions["data_rank00000.next_index"] == positions["data_rank00001.next_index"] \
        == STEPS
    records = [json.loads(line) for line in (clean_run / "steps.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    # A deterministic run: 20 steps of the tiny model on Python source always learn.
    assert len(losses) >= STEPS and losses[-1] < losses[0] - 0.5


def test_arrow_kill_resumes_at_the_exact_token(tmp_path: Path, arrow_file: Path,
                                               clean_run: Path) -> None:
    kill = random.Random().randrange(15, 19)  # the step-10 commit lands first, even loaded
    print(f"chaos kill at step {kill}")
    result = up(_config(tmp_path, arrow_file, chaos={"kill": [{"step": kill}], "seed": kill}),
                tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED" and [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    step = f"step-{STEPS:08d}"
    a = final_state_dict(clean_run / "checkpoints" / "t" / step)
    b = final_state_dict(tmp_path / "run" / "checkpoints" / "t" / step)
    assert assert_bit_identical(a, b, ("app.model.", "app.optim.", "progress.", "data_rank",
                                       "schedule.")) > 40
