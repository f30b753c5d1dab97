"""Step directories made by hand, and damage done to them, for the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import layout


def make_step(root: Path, step: int, files: dict[str, bytes] | None = None,
              commit: bool = True, **meta) -> str:
    url = layout.step_url(str(root), step)
    d = Path(url)
    d.mkdir(parents=True)
    for name, data in (files or {"__0_0.distcp": bytes(range(256)) * (step + 1),
                                 ".metadata": b"meta" * step}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    if commit:
        layout.write_manifest(url, layout.build_manifest(url, step=step, **meta))
    return url


def flip_byte(path: Path, offset: int = 17) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
