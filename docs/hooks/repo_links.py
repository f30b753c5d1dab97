"""MkDocs hook: the docs link to the benchmarks (``bench/``: scripts, results, the index) with
paths relative to the repository, which work when the markdown is read in a checkout or on a
forge. The site has no such files, so this hook adds every file of ``bench/`` to it under
``repo/bench/`` and points those links there (and the carried pages' links back into
``docs/`` at the site's pages); MkDocs then checks each one like any other link, and the
strict build fails on a result file that does not exist.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("bench",)  # top-level folders of the repository the site carries
PREFIX = "repo"
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for folder in SHARED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                rel = path.relative_to(ROOT).as_posix()
                files.append(File.generated(config, f"{PREFIX}/{rel}",
                                            abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    site_path = page.file.src_uri
    carried = site_path.startswith(f"{PREFIX}/")
    # Where the page lives in the repository, which its relative links are written against.
    repo_path = site_path[len(PREFIX) + 1:] if carried else f"docs/{site_path}"
    here = posixpath.dirname(site_path)

    def rewrite(match: re.Match[str]) -> str:
        target = match[2]
        if "://" in target or target.startswith(("/", "mailto:")):
            return match[0]
        in_repo = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), target))
        top = in_repo.split("/", 1)[0]
        if top == "docs":
            in_site = in_repo[len("docs/"):]
        elif top in SHARED:
            in_site = f"{PREFIX}/{in_repo}"
        else:
            return match[0]
        new = posixpath.relpath(in_site, here or ".")
        return f"{match[1]}{new}{match[3] or ''}{match[4]}"

    return _LINK.sub(rewrite, markdown)
