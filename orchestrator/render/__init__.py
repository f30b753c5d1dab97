"""``orchestrator deploy``: what a platform needs to run a job, rendered from its job.yaml.

One config decides every size (``cluster.nodes``, ``spares``, ``procs_per_node``); the
``deploy:`` section adds what only the platform needs (image, resources, placement). Each
renderer returns files (name -> text); nothing here talks to a cluster.
"""

from __future__ import annotations

from typing import Any

import yaml


def header(platform: str, source: str) -> str:
    """The first lines of every rendered file: where it came from and how to change it."""
    return (f"# Rendered by: orchestrator deploy {platform} {source}\n"
            "# Change the config (its cluster and deploy sections) and render again rather\n"
            "# than editing this file.\n")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a container's shell script) as literal blocks, readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(*docs: Any) -> str:
    """YAML documents in the order given, keys in insertion order."""
    return "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100)
                         for d in docs)


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data`` with ``a.b.c`` set to ``value`` (mappings created as needed)."""
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


def job_yaml(platform: str, source: str, data: dict[str, Any], overrides: dict[str, Any]
             ) -> str:
    """The job's own config as the platform runs it: the file's mapping with the settings
    the platform needs (the launcher, where the supervisor listens) set."""
    out = yaml.safe_load(yaml.safe_dump(data, sort_keys=False))  # a copy, in the file's order
    for dotted, value in overrides.items():
        set_path(out, dotted, value)
    return header(platform, source) + yaml.safe_dump(out, sort_keys=False, width=100)
