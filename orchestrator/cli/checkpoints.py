"""``orchestrator checkpoints list|verify|prune|sign`` and ``orchestrator export``: printing
only.

The work is done by ``trainer.checkpoint.store`` / ``layout`` / ``signing`` (torch-free) and,
for the export, ``trainer.hf``. URLs are local paths or fsspec URLs
(``s3://bucket/prefix/job``); S3 credentials come from the AWS environment chain, the
endpoint from ``--endpoint-url`` or AWS_ENDPOINT_URL_S3. The key that checks signatures is
``--key-file``, else ORCH_CHECKPOINT_KEY / ORCH_CHECKPOINT_KEY_FILE, else ``checkpoint.key``
beside a local checkpoint root (``<root>/<job>`` -> ``<root>/../checkpoint.key``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from orchestrator.textsafe import shown

out = Console(soft_wrap=True)  # long URLs and problems stay on one greppable line
err = Console(stderr=True, soft_wrap=True)


def _s(value: object) -> str:
    """Text from a manifest, a path or an error, for a markup string: control characters
    and markup escaped (``orchestrator.textsafe``)."""
    return escape(shown(value))


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


def _trust(job_root: str, key_file: str | None, trust_unsigned: bool) -> Any:
    """The ``Trust`` to check ``job_root``'s checkpoints with (see the module)."""
    from trainer.checkpoint import signing

    root = job_root.rstrip("/").rsplit("/", 1)[0] if "/" in job_root.rstrip("/") else job_root
    return signing.trust_from(root, key_file=key_file, trust_unsigned=trust_unsigned)


def _signature(outcome: str | None, trust: Any) -> str:
    from trainer.checkpoint import signing

    if outcome == signing.SIGNED:
        return f"signed (key {trust.key_id})"
    if outcome == signing.UNSIGNED:
        return "unsigned" + (" (trusted: --trust-unsigned)" if trust.trust_unsigned else "")
    return outcome or "-"


def missing_extra(urls: list[str], feature: str) -> int | None:
    """Exit code 2 with one line naming the extra to install when a URL needs a module that
    is not installed (``s3://`` without s3fs); None when every URL can be read."""
    from orchestrator.extras import MissingExtra, require_for_url

    try:
        for url in urls:
            require_for_url(url, f"{feature} {url}")
    except MissingExtra as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False, markup=False)
        return 2
    return None


def run_checkpoint_roots(target: Path) -> list[str] | None:
    """The job checkpoint roots (``<root>/<job>``, every tier) of a run directory, or None
    when ``target`` is not one (a checkpoint root is listed as it is)."""
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.journal.status import load_view

    if not (target / "events.jsonl").is_file():
        return None
    run = RunDir(target.resolve())
    view = load_view(run)
    if not view.job:
        return []
    roots = [view.checkpoint_root or run.checkpoint_root(None)]
    try:
        import yaml

        cfg = yaml.safe_load(run.config.read_text())
        local = (cfg.get("checkpoint") or {}).get("local_url") if isinstance(cfg, dict) else None
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        local = None
    if isinstance(local, str) and local:
        roots.insert(0, local)
    return [f"{r.rstrip('/')}/{view.job}" for r in roots]


def list_checkpoints(urls: list[str], checksums: bool, json_out: bool,
                     key_file: str | None = None, trust_unsigned: bool = False) -> int:
    """Exit 0 when every committed checkpoint listed verifies, 1 when one does not or when
    there is none to list. ``urls`` are job checkpoint roots or run directories (default:
    ``runs/latest``)."""
    from trainer.checkpoint import signing
    from trainer.checkpoint.store import describe, resolve

    roots: list[str] = []
    run_roots: set[str] = set()
    for url in urls or [str(Path("runs") / "latest")]:
        from_run = run_checkpoint_roots(Path(url)) if "://" not in url else None
        if from_run is None and not urls:
            err.print(f"[red]error[/red] {url} is not a run directory: name a run directory "
                      "or a job's checkpoint root (<root>/<job>)", highlight=False)
            return 2
        roots += from_run if from_run is not None else [url]
        run_roots.update(from_run or [])
    code = missing_extra(roots, "listing checkpoints at")
    if code is not None:
        return code
    rows = []
    try:
        for url in roots:
            if url in run_roots and "://" not in url and not Path(url).exists():
                continue  # a run that has committed nothing yet has no directory for it
            root, _ = resolve(url)
            rows += describe(root, checksums=checksums,
                             trust=_trust(root, key_file, trust_unsigned))
    except (OSError, ValueError, signing.SigningKeyError) as exc:
        err.print(f"[red]error[/red] {_s(exc)}", highlight=False)
        return 2
    if not rows:
        err.print(f"no checkpoints under {', '.join(roots) or ', '.join(urls)}",
                  highlight=False, markup=False)
        return 1
    urls = roots
    rows.sort(key=lambda r: (r.step, r.tier))
    failing = [r for r in rows if r.committed and not r.verified]
    if json_out:
        print(json.dumps([r.__dict__ for r in rows], indent=2, default=list))
        return 1 if failing else 0
    table = Table(title=Text(shown(", ".join(urls))), title_justify="left")
    for col in ("step", "tier", "size", "age", "signature", "verified"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for r in rows:
        if not r.committed:
            verified = "[yellow]uncommitted[/yellow]"
        elif r.verified:
            verified = "[green]yes[/green]" if checksums else "[green]sizes ok[/green]"
        else:
            verified = f"[red]NO[/red]: {_s(r.problems[0])}" + \
                (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else "")
        sig = r.signature if r.committed else "-"
        table.add_row(str(r.step), r.tier, _size(r.size), _age(r.created), _s(sig or "-"),
                      verified)
    out.print(table)
    if not checksums and rows:
        out.print("sizes and signatures checked; --checksums reads every file and checks its "
                  "digest", style="dim")
    if failing:
        err.print(f"[red]{len(failing)} committed checkpoint(s) fail verification[/red]: "
                  f"steps {', '.join(str(r.step) for r in failing)}", highlight=False)
    return 1 if failing else 0


def verify_checkpoint(url: str, key_file: str | None = None,
                      trust_unsigned: bool = False) -> int:
    from trainer.checkpoint import layout, signing
    from trainer.checkpoint.store import resolve

    code = missing_extra([url], "verifying checkpoints at")
    if code is not None:
        return code
    try:
        root, step = resolve(url)
        if step is None:
            committed = [c for c in layout.list_checkpoints(root) if c.committed]
            if not committed:
                err.print(f"[red]FAILED[/red] {_s(root)}: no committed checkpoint "
                          "(no manifest)")
                return 1
            step = committed[-1].step
        target = layout.step_url(root, step)
        trust = _trust(root, key_file, trust_unsigned)
        result = layout.verify(target, trust=trust)
    except (OSError, ValueError, signing.SigningKeyError) as exc:
        err.print(f"[red]error[/red] {_s(exc)}", highlight=False)
        return 2
    if result.ok:
        files = (result.manifest or {}).get("files", {})
        size = sum(f["size"] for f in files.values())
        out.print(f"[green]OK[/green] {_s(target)}: step {step}, {len(files)} files, "
                  f"{_size(size)}, "
                  f"{_signature(result.signature, trust)}, every size and digest matches the "
                  "manifest", highlight=False)
        return 0
    err.print(f"[red]FAILED[/red] {_s(target)}: {_signature(result.signature, trust)}, "
              f"{len(result.problems)} problem(s)", highlight=False)
    for problem in result.problems:
        err.print(f"  {shown(problem)}", highlight=False, markup=False)
    return 1


def prune_checkpoints(url: str, keep_last: int, keep_every: int | None, dry_run: bool,
                      checksums: bool = True, remove_failing: bool = False,
                      key_file: str | None = None, trust_unsigned: bool = False) -> int:
    """Only checkpoints that verify count toward the rule; failing ones are listed and left
    (``remove_failing`` removes them). Exit 1 when some fail, after pruning."""
    from trainer.checkpoint import layout, signing
    from trainer.checkpoint.store import resolve

    code = missing_extra([url], "pruning checkpoints at")
    if code is not None:
        return code
    try:
        root, step = resolve(url)
        if step is not None:
            err.print("[red]error[/red] prune takes a job root, not one step directory")
            return 2
        plan = layout.plan_prune(root, keep_last, keep_every,
                                 trust=_trust(root, key_file, trust_unsigned),
                                 checksums=checksums, remove_failing=remove_failing)
        if not dry_run:
            layout.execute_prune(plan)
    except (OSError, ValueError, signing.SigningKeyError) as exc:
        err.print(f"[red]error[/red] {_s(exc)}", highlight=False)
        return 2
    verb = "would remove" if dry_run else "removed"
    out.print(f"{_s(root)}: {verb} {len(plan.remove)} checkpoint(s)"
              + (f": steps {', '.join(map(str, plan.remove))}" if plan.remove else "")
              + f"; {'would keep' if dry_run else 'kept'} "
              + (f"steps {', '.join(map(str, plan.keep))}" if plan.keep else "none"),
              highlight=False)
    for s, problems in sorted(plan.failing.items()):
        fate = ("would remove" if dry_run else "removed") if remove_failing else \
            "not counted, left in place (--remove-failing removes it)"
        err.print(f"[red]failing[/red] step {s}: {_s(problems[0])}"
                  + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
                  + f": {_s(fate)}", highlight=False)
    return 1 if plan.failing else 0


def sign_checkpoints(url: str, key_file: str | None, from_key_file: str | None,
                     trust_unsigned: bool) -> int:
    """Re-sign a checkpoint (a step directory) or every committed one of a job root with
    this job's key, each after it verifies in full under the old key (``--from-key-file``)
    or as unsigned (``--trust-unsigned``)."""
    from trainer.checkpoint import layout, signing
    from trainer.checkpoint.store import resolve

    code = missing_extra([url], "signing checkpoints at")
    if code is not None:
        return code
    try:
        root, step = resolve(url)
        new = _trust(root, key_file, False)
        if new.key is None:
            err.print(f"[red]error[/red] no key to sign with: {_s(new.source)} does not exist "
                      f"(pass --key-file or set {signing.KEY_FILE_ENV})", highlight=False)
            return 2
        old = signing.Trust(signing.read_key_file(from_key_file) if from_key_file else None,
                            trust_unsigned, from_key_file or "")
        steps = [step] if step is not None else \
            [c.step for c in layout.list_checkpoints(root) if c.committed]
        failed = 0
        for s in steps:
            target = layout.step_url(root, s)
            result = layout.resign(target, new.key, old)
            if result.ok:
                out.print(f"[green]signed[/green] {_s(target)} with key {new.key_id} (was "
                          f"{result.signature})", highlight=False)
            else:
                failed += 1
                err.print(f"[red]not signed[/red] {_s(target)}: "
                          f"{_s('; '.join(result.problems))}", highlight=False)
    except (OSError, ValueError, signing.SigningKeyError) as exc:
        err.print(f"[red]error[/red] {_s(exc)}", highlight=False)
        return 2
    return 1 if failed or not steps else 0


def export_hf(checkpoint: str, to_hf: Path, dtype: str, tokenizer: str | None,
              key_file: str | None = None, trust_unsigned: bool = False,
              adapter_only: bool = False) -> int:
    from orchestrator.extras import MissingExtra, require
    from trainer.checkpoint import layout, signing
    from trainer.checkpoint.store import resolve

    code = missing_extra([checkpoint], "exporting the checkpoint at")
    if code is not None:
        return code
    try:
        require("safetensors", "the Hugging Face export (model.safetensors)")
    except MissingExtra as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False, markup=False)
        return 2
    try:
        root, step = resolve(checkpoint)
        trust = _trust(root, key_file, trust_unsigned)
        if step is None:
            def skipped(info: layout.CheckpointInfo, problems: list[str]) -> None:
                err.print(f"[yellow]skipped[/yellow] step {info.step}: "
                          f"{_s('; '.join(problems))}", highlight=False)

            found = layout.newest_verified(root, on_skip=skipped, trust=trust)
            if found is None:
                err.print(f"[red]error[/red] {_s(root)}: no committed checkpoint verifies")
                return 1
            target, manifest = found[0].url, found[1]
        else:
            target = layout.step_url(root, step)
            result = layout.verify(target, trust=trust)
            if not result.ok or result.manifest is None:
                err.print(f"[red]error[/red] {_s(target)} fails verification: "
                          f"{_s('; '.join(result.problems))}", highlight=False)
                return 1
            manifest = result.manifest
        if manifest.get("finetune") or adapter_only:  # LoRA/QLoRA: adapters only
            from trainer.hf_adapters import export_adapted as export_checkpoint
            extra = {"adapter_only": adapter_only}
        else:
            from trainer.hf import export_checkpoint
            extra = {}
        from torch.distributed.checkpoint.api import CheckpointException

        from trainer.checkpoint.save_errors import explain_failure

        try:
            export_checkpoint(target, manifest, to_hf, dtype=dtype, tokenizer=tokenizer,
                              log=lambda m: out.print(shown(m), highlight=False,
                                                      markup=False), **extra)
        except CheckpointException as exc:  # a BaseException: DCP's load failed
            raise ValueError(f"{target}: does not load: "
                             f"{explain_failure(exc, target)}") from None
    except (OSError, ValueError, TypeError, KeyError, signing.SigningKeyError) as exc:
        err.print(f"[red]error[/red] {_s(exc)}", highlight=False)
        return 1
    return 0
