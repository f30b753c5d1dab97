"""Why a checkpoint save or load failed: the errors a worker stops with, and one line that
names a save's cause (a full disk is named as such)."""

from __future__ import annotations

import errno
import shutil
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint import layout

# DCP's CheckpointException derives from BaseException, so ``except Exception`` misses it.
SaveErrors = (Exception, CheckpointException)
LoadErrors = (Exception, CheckpointException)


class CheckpointSaveError(RuntimeError):
    """Too many saves in a row failed: the worker stops so the restart policy applies."""


class CheckpointLoadError(RuntimeError):
    """Every checkpoint tried verified but failed to load (each is rejected): the rank stops
    rather than train from a state that is partly overwritten."""


class CheckpointTrustError(RuntimeError):
    """No checkpoint verifies and some were refused for their key (unsigned, signed with
    another key): the job stops instead of starting over from scratch."""


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception, DCP's per-rank failures, and what each was raised while handling."""
    out: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo and len(out) < 32:
        e = todo.pop(0)
        e = e[0] if isinstance(e, tuple) else e
        if not isinstance(e, BaseException) or e in out:
            continue
        out.append(e)
        todo.extend(getattr(e, "failures", {}).values())
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return out


def explain_failure(exc: BaseException, url: str) -> str:
    """One line saying why a save failed; a full disk is named as such.

    torch.save into a full disk surfaces as ``RuntimeError: unexpected pos``, with the
    ENOSPC only in its context, so the whole chain is searched.
    """
    causes = _causes(exc)
    for e in causes:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"disk full (ENOSPC) writing {url}: {e}"
    if not layout.is_remote(url):
        try:
            free = shutil.disk_usage(layout.filesystem(url)[1].rsplit("/", 1)[0]).free
            if free < 2**20:
                return f"disk full ({free} bytes free) writing {url}: {causes[-1]}"
        except OSError:
            pass
    leaf = next((e for e in reversed(causes) if not getattr(e, "failures", None)), exc)
    return f"{type(leaf).__name__}: {leaf}"[:1000]
