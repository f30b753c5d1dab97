"""Step directories made by hand, and damage done to them, for the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import layout, signing

KEY = b"test-key-" + b"k" * 23  # the job's signing key in these tests
TRUST = signing.Trust(KEY)


def make_step(root: Path, step: int, files: dict[str, bytes] | None = None,
              commit: bool = True, key: bytes | None = KEY, **meta) -> str:
    url = layout.step_url(str(root), step)
    d = Path(url)
    d.mkdir(parents=True)
    for name, data in (files or {"__0_0.distcp": bytes(range(256)) * (step + 1),
                                 ".metadata": b"meta" * step}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    if commit:
        layout.write_manifest(url, layout.build_manifest(url, key=key, step=step, **meta))
    return url


def write_default_key(checkpoint_root: Path, key: bytes = KEY) -> Path:
    """``key`` where a process with no key in its environment looks for it: beside the
    checkpoint root (``<root>/../checkpoint.key``), mode 0600."""
    path = checkpoint_root.parent / signing.KEY_FILE_NAME
    path.write_bytes(key)
    path.chmod(0o600)
    return path


def flip_byte(path: Path, offset: int = 17) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
