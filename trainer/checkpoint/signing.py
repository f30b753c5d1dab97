"""Who may have written a checkpoint: the manifest's HMAC signature and the key behind it.

Rank 0 signs every manifest it commits with HMAC-SHA256 over the manifest's canonical JSON
(everything but the signature itself: step, tokens, world size, meta and every file's size
and BLAKE3 digest). A restore checks the signature, then every digest, before anything in
the checkpoint is unpickled or loaded, so a writer without the key cannot make a restart
run code: changing a file changes its digest, changing a digest changes the signed bytes.

The key never lives in a config file. Where a process finds it, in order:

1. ``ORCH_CHECKPOINT_KEY``: the key itself (at least 16 bytes; a secret manager's env).
2. ``ORCH_CHECKPOINT_KEY_FILE``: a file holding it (a mounted secret, or the key the
   supervisor generated into the run directory, ``generation_env``). It must exist.
3. Neither set (a direct ``python -m trainer`` run, or the CLI on a local root):
   ``checkpoint.key`` beside the checkpoint root (``<root>/../checkpoint.key``; for a
   supervisor's default root ``<run dir>/checkpoints`` that is ``<run dir>/checkpoint.key``),
   created 0600 by the first writer when missing. A root that is not a local path has no
   such place: ``$ORCH_RUN_DIR/checkpoint.key``, else ``~/.config/orchestrator/checkpoint.key``.

A manifest records the key's id (a hash of it, not the key), so a checkpoint signed with
another key says so instead of merely "forged".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orchestrator.contracts import env as ec
from orchestrator.contracts.rundir import is_remote

KEY_ENV = ec.CHECKPOINT_KEY
KEY_FILE_ENV = ec.CHECKPOINT_KEY_FILE
KEY_FILE_NAME = "checkpoint.key"
SIGNATURE = "signature"
MAC = "hmac_sha256"
MIN_KEY_BYTES = 16
_DOMAIN = b"orchestrator-checkpoint-manifest\x00"

# Verification outcomes (``Verification.signature``, ``orchestrator checkpoints verify``).
SIGNED = "signed"  # the signature matches this key
UNSIGNED = "unsigned"  # no signature: written before signing existed, or imported
FORGED = "forged"  # a signature that this key does not produce
NO_KEY = "no key"  # signed, but no key was given to check it with
UNCHECKED = "unchecked"  # integrity only: the caller asked for no authenticity check


class SigningKeyError(RuntimeError):
    """The key named by the environment cannot be read, or is too short."""


class Signer(Protocol):
    """Who holds the key when this process does not: a managed rank's node agent
    (``orchestrator.worker.keyclient.AgentSigner``)."""

    @property
    def key_id(self) -> str | None: ...

    def signature(self, manifest: dict[str, Any], scope: str) -> dict[str, str]: ...

    def check(self, manifest: dict[str, Any]) -> tuple[str, str]: ...


@dataclass(frozen=True)
class Trust:
    """What a verification accepts: checkpoints signed with ``key``, and unsigned ones too
    when ``trust_unsigned`` (the operator's ``--trust-unsigned``). A managed rank holds no
    key: its ``signer`` (the node agent) signs and checks for it."""

    key: bytes | None
    trust_unsigned: bool = False
    source: str = ""  # where the key came from, for messages
    signer: Signer | None = None

    @property
    def key_id(self) -> str | None:
        if self.key is not None:
            return key_id(self.key)
        return self.signer.key_id if self.signer is not None else None

    @property
    def can_sign(self) -> bool:
        return self.key is not None or self.signer is not None

    def sign(self, manifest: dict[str, Any], scope: str = "manifest") -> dict[str, Any]:
        """``manifest`` signed (a new dict); unsigned when there is no key at all."""
        if self.key is not None:
            return sign(manifest, self.key)
        out = {k: v for k, v in manifest.items() if k != SIGNATURE}
        if self.signer is not None:
            out[SIGNATURE] = self.signer.signature(out, scope)
        return out

    def check(self, manifest: dict[str, Any]) -> tuple[str, str]:
        """``check`` with this trust's key, wherever it is held."""
        if self.key is None and self.signer is not None and manifest.get(SIGNATURE) is not None:
            return self.signer.check(manifest)
        return check(manifest, self.key)


def key_id(key: bytes) -> str:
    """A short public name of a key (16 hex digits of a hash of it)."""
    return hashlib.sha256(b"orchestrator-checkpoint-key-id\x00" + key).hexdigest()[:16]


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest without its signature, as sorted compact
    JSON (floats round-trip exactly through Python's json)."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def _mac(manifest: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _DOMAIN + canonical(manifest), hashlib.sha256).hexdigest()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``manifest`` with its signature (a new dict)."""
    out = {k: v for k, v in manifest.items() if k != SIGNATURE}
    out[SIGNATURE] = {MAC: _mac(out, key), "key_id": key_id(key)}
    return out


def check(manifest: dict[str, Any], key: bytes | None) -> tuple[str, str]:
    """(outcome, message): ``SIGNED``, ``UNSIGNED``, ``FORGED`` or ``NO_KEY``."""
    sig = manifest.get(SIGNATURE)
    if sig is None:
        return UNSIGNED, "unsigned (written before checkpoints were signed, or imported)"
    if not isinstance(sig, dict) or not isinstance(sig.get(MAC), str):
        return FORGED, f"forged: malformed signature {str(sig)[:80]!r}"
    if key is None:
        return NO_KEY, (f"signed with key {sig.get('key_id')}, but no key to check it: set "
                        f"{KEY_FILE_ENV} (or pass --key-file)")
    if hmac.compare_digest(sig[MAC], _mac(manifest, key)):
        return SIGNED, f"signed (key {key_id(key)})"
    if sig.get("key_id") != key_id(key):
        return FORGED, (f"forged, or signed with another job's key: key {sig.get('key_id')} "
                        f"signed it, this key is {key_id(key)}")
    return FORGED, f"forged: the signature does not match the manifest (key {key_id(key)})"


# -- keys ----------------------------------------------------------------------------------
def _checked(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(f"the checkpoint signing key from {where} has {len(key)} bytes; "
                              f"at least {MIN_KEY_BYTES} are needed")
    return key


def read_key_file(path: str | Path) -> bytes:
    """The key in ``path`` (its bytes, surrounding whitespace stripped); a regular file only."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SigningKeyError(f"cannot read the checkpoint signing key {path}: "
                              f"{exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SigningKeyError(f"the checkpoint signing key {path} is not a regular file")
        return _checked(f.read(4096).strip(), str(path))


def write_key_file(path: str | Path) -> Path:
    """Create ``path`` with a fresh random key, mode 0600; an existing file is kept (two
    ranks or a supervisor restart racing to create it end with the same key)."""
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        read_key_file(path)  # exists: it must hold a usable key
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def ensure_job_key(run_dir: str | Path) -> Path:
    """The job's generated key, ``<run dir>/checkpoint.key`` (0600), created when missing."""
    return write_key_file(Path(run_dir) / KEY_FILE_NAME)


def generation_env(run_dir: str | Path, job_env: dict[str, str] | None = None,
                   environ: dict[str, str] | None = None) -> dict[str, str]:
    """What the supervisor adds to a generation's environment so rank 0 signs and verifies
    with the job's key.

    The operator's choice wins: a key or key file named in ``job.env`` or in the
    supervisor's own environment is used as it is (a key file's path is passed on, made
    absolute; a key itself is never copied into the assignment, which the journal records:
    the ranks read it from the environment they inherit). Otherwise the key generated into
    the run directory is created once and its path passed as ``ORCH_CHECKPOINT_KEY_FILE``.
    """
    environ = os.environ if environ is None else environ
    job_env = job_env or {}
    if KEY_ENV in job_env or KEY_FILE_ENV in job_env:
        return {}
    if environ.get(KEY_FILE_ENV):
        return {KEY_FILE_ENV: str(Path(environ[KEY_FILE_ENV]).expanduser().absolute())}
    if environ.get(KEY_ENV):
        return {}
    return {KEY_FILE_ENV: str(ensure_job_key(run_dir))}


def default_key_path(root: str | None) -> Path:
    """Where a process with no key in its environment keeps one (see the module)."""
    # A local root (a path or file:// URL).
    if root and not is_remote(root):
        local = root.removeprefix("file://") if "://" in root else os.path.expanduser(root)
        return Path(os.path.abspath(local)).parent / KEY_FILE_NAME
    if os.environ.get(ec.RUN_DIR):
        return Path(os.environ[ec.RUN_DIR]) / KEY_FILE_NAME
    return Path("~/.config/orchestrator").expanduser() / KEY_FILE_NAME


def load_key(root: str | None = None, *, create: bool = False,
             environ: dict[str, str] | None = None) -> tuple[bytes | None, str]:
    """(key, where it came from) by the module's order. ``root`` is the checkpoint root the
    default key sits beside; ``create`` makes that default key when it is missing (a
    writer), else a missing default is (None, its path)."""
    environ = os.environ if environ is None else environ
    if environ.get(KEY_ENV):
        return _checked(environ[KEY_ENV].encode(), f"${KEY_ENV}"), f"${KEY_ENV}"
    if environ.get(KEY_FILE_ENV):
        path = Path(environ[KEY_FILE_ENV]).expanduser()
        return read_key_file(path), f"{path} (${KEY_FILE_ENV})"
    path = default_key_path(root)
    if create:
        write_key_file(path)
    elif not path.is_file():
        return None, str(path)
    return read_key_file(path), str(path)


def trust_from(root: str | None, *, key_file: str | Path | None = None,
               trust_unsigned: bool = False, create: bool = False) -> Trust:
    """A ``Trust`` for a process working on checkpoints under ``root``: ``key_file`` (the
    CLI's ``--key-file``) or the environment's key, or the default beside the root."""
    if key_file is not None:
        return Trust(read_key_file(key_file), trust_unsigned, str(key_file))
    key, source = load_key(root, create=create)
    return Trust(key, trust_unsigned, source)
