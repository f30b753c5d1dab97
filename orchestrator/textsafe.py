"""Text from a node or a file, made fit for the operator's terminal.

A rank's error message, a log line, a node's host name, a path from a manifest: none of it
is ours, and a terminal obeys what it is sent. An escape sequence in a rank exit's ``error``
repainted ``orchestrator status``; rich markup in a table cell (``[link=...]``, ``[blink]``)
was interpreted. ``shown`` writes every control character (C0 and C1, DEL, and the Unicode
controls that reorder text) as a visible escape, so the operator sees the bytes that were
sent; the CLI puts the result into rich ``Text`` (never markup) before printing it.
Newlines and tabs stay: messages and tracebacks have them.
"""

from __future__ import annotations

import re

# C0 controls but \t and \n, DEL, C1 controls, and the bidirectional and zero-width
# formatting characters that make a terminal show text in another order than it reads.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\u202a-\u202e"
                     "\u2060-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def shown(value: object, limit: int | None = None) -> str:
    """``value`` as text with every control character escaped (``\\x1b``, ``\\u202e``);
    at most ``limit`` characters of the original (``...`` marks the cut)."""
    text = value if isinstance(value, str) else str(value)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    return _UNSAFE.sub(_escape, text) + ("..." if cut else "")
