"""``orchestrator checkpoints list|verify|prune`` and ``orchestrator export``: printing only.

The work is done by ``trainer.checkpoint.store`` / ``layout`` (torch-free) and, for the
export, ``trainer.hf``. URLs are local paths or fsspec URLs (``s3://bucket/prefix/job``);
S3 credentials come from the AWS environment chain, the endpoint from ``--endpoint-url``
or AWS_ENDPOINT_URL_S3.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

out = Console(soft_wrap=True)  # long URLs and problems stay on one greppable line
err = Console(stderr=True, soft_wrap=True)


def use_endpoint(endpoint_url: str | None) -> None:
    """Point this process's S3 clients at an S3-compatible endpoint (botocore's variable)."""
    if endpoint_url:
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoint_url


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(created: float | None) -> str:
    if created is None:
        return "-"
    s = max(0.0, time.time() - created)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else \
        f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.1f} d"


def list_checkpoints(urls: list[str], checksums: bool, json_out: bool) -> int:
    from trainer.checkpoint.store import describe, resolve

    rows = []
    for url in urls:
        try:
            root, _ = resolve(url)
            rows += describe(root, checksums=checksums)
        except (OSError, ValueError) as exc:
            err.print(f"[red]error[/red] {exc}", highlight=False)
            return 2
    rows.sort(key=lambda r: (r.step, r.tier))
    if json_out:
        print(json.dumps([r.__dict__ for r in rows], indent=2, default=list))
        return 0
    table = Table(title=", ".join(urls), title_justify="left")
    for col in ("step", "tier", "size", "age", "verified"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for r in rows:
        if not r.committed:
            verified = "[yellow]uncommitted[/yellow]"
        elif r.verified:
            verified = "[green]yes[/green]" if checksums else "[green]sizes ok[/green]"
        else:
            verified = f"[red]NO[/red]: {r.problems[0]}" + \
                (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else "")
        table.add_row(str(r.step), r.tier, _size(r.size), _age(r.created), verified)
    out.print(table)
    if not checksums and rows:
        out.print("sizes checked; --checksums reads every file and checks its checksum",
                  style="dim")
    return 0


def verify_checkpoint(url: str) -> int:
    from trainer.checkpoint import layout
    from trainer.checkpoint.store import resolve

    try:
        root, step = resolve(url)
        if step is None:
            committed = [c for c in layout.list_checkpoints(root) if c.committed]
            if not committed:
                err.print(f"[red]FAILED[/red] {root}: no committed checkpoint (no manifest)")
                return 1
            step = committed[-1].step
        target = layout.step_url(root, step)
        result = layout.verify(target)
    except (OSError, ValueError) as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False)
        return 2
    if result.ok:
        files = (result.manifest or {}).get("files", {})
        size = sum(f["size"] for f in files.values())
        out.print(f"[green]OK[/green] {target}: step {step}, {len(files)} files, {_size(size)}, "
                  "every size and checksum matches the manifest", highlight=False)
        return 0
    err.print(f"[red]FAILED[/red] {target}: {len(result.problems)} problem(s)", highlight=False)
    for problem in result.problems:
        err.print(f"  {problem}", highlight=False, markup=False)
    return 1


def prune_checkpoints(url: str, keep_last: int, keep_every: int | None, dry_run: bool) -> int:
    from trainer.checkpoint import layout
    from trainer.checkpoint.store import resolve

    try:
        root, step = resolve(url)
        if step is not None:
            err.print("[red]error[/red] prune takes a job root, not one step directory")
            return 2
        removed = layout.prune(root, keep_last, keep_every, dry_run=dry_run)
    except (OSError, ValueError) as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False)
        return 2
    verb = "would remove" if dry_run else "removed"
    out.print(f"{root}: {verb} {len(removed)} checkpoint(s)"
              + (f": steps {', '.join(map(str, removed))}" if removed else ""), highlight=False)
    return 0


def export_hf(checkpoint: str, to_hf: Path, dtype: str, tokenizer: str | None,
              adapter_only: bool = False) -> int:
    from trainer.checkpoint import layout
    from trainer.checkpoint.store import resolve

    try:
        root, step = resolve(checkpoint)
        if step is None:
            def skipped(info: layout.CheckpointInfo, problems: list[str]) -> None:
                err.print(f"[yellow]skipped[/yellow] step {info.step}: {'; '.join(problems)}",
                          highlight=False)

            found = layout.newest_verified(root, on_skip=skipped)
            if found is None:
                err.print(f"[red]error[/red] {root}: no committed checkpoint verifies")
                return 1
            target, manifest = found[0].url, found[1]
        else:
            target = layout.step_url(root, step)
            result = layout.verify(target)
            if not result.ok or result.manifest is None:
                err.print(f"[red]error[/red] {target} fails verification: "
                          f"{'; '.join(result.problems)}", highlight=False)
                return 1
            manifest = result.manifest
        if manifest.get("finetune") or adapter_only:  # LoRA/QLoRA: adapters only
            from trainer.hf_adapters import export_adapted as export_checkpoint
            extra = {"adapter_only": adapter_only}
        else:
            from trainer.hf import export_checkpoint
            extra = {}
        export_checkpoint(target, manifest, to_hf, dtype=dtype, tokenizer=tokenizer,
                          log=lambda m: out.print(m, highlight=False), **extra)
    except (OSError, ValueError) as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False)
        return 1
    return 0
