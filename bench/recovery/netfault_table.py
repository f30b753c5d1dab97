"""The fault campaign's results table, from what the tests measured.

The network-fault tests (``tests/integration/test_netfaults*.py``) append one row per fault
to the JSON file named by ``NETFAULT_RESULTS``; this renders it as the markdown table of
``docs/reliability.md`` (between its ``results`` markers), figures as measured::

    NETFAULT_RESULTS=bench/results/netfaults-cpu.json python -m pytest --long \\
        tests/integration/test_netfaults.py tests/integration/test_netfaults_long.py
    python bench/recovery/netfault_table.py bench/results/netfaults-cpu.json docs/reliability.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"
COLUMNS = ("fault", "injected", "detected in", "recovered in", "data lost", "bit-exact")
# The campaign's order (a row for a fault not measured yet is left out).
ORDER = ("node cut from everything", "node cut from everything, back", "split brain",
         "partition between", "supervisor host", "5 % packet loss", "30 % packet loss",
         "checkpoint filesystem")


def _seconds(value: object) -> str:
    return "-" if value is None else f"{float(value):.1f} s"  # type: ignore[arg-type]


def _rank(row: dict) -> int:
    fault = row.get("fault", "")
    matches = [i for i, prefix in enumerate(ORDER) if fault.startswith(prefix)]
    return max(matches, default=len(ORDER))


def render(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in sorted(rows, key=_rank):
        cells = [r["fault"], r.get("injected", ""), _seconds(r.get("detected_s")),
                 _seconds(r.get("recovered_s")), r.get("data_lost", ""),
                 "yes" if r.get("bit_exact") else "no"]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    notes = [f"- **{r['fault']}**: {r['notes']} (measured {r.get('measured_at', '?')})"
             for r in sorted(rows, key=_rank) if r.get("notes")]
    return "\n".join(lines + [""] + notes)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    rows = json.loads(Path(argv[1]).read_text())
    doc = Path(argv[2])
    text = doc.read_text()
    if START not in text or END not in text:
        print(f"{doc} has no {START} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{render(rows)}\n{END}{tail}")
    print(f"{len(rows)} row(s) written to {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
