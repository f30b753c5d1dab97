"""Optional dependencies: which ``pip install 'orchestrator[EXTRA]'`` brings each module, and
the one-line error a command gives when one is missing.

The Quickstart installs the core only (``pip install -e .``). A feature that needs more (an
``s3://`` path, the Hugging Face export, SageMaker, Arrow data, DeepSpeed, adapters) names
the extra that installs it, before a job starts (``validate``, ``health``) and when a
command meets it (never a ``ModuleNotFoundError`` traceback). The extras themselves are
defined in ``pyproject.toml``; this table says which extra holds which module.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config.schema import Config

# Top-level import name -> the extra (pyproject's optional-dependencies) that installs it.
EXTRA_OF: dict[str, str] = {
    "s3fs": "s3",
    "aiobotocore": "s3",
    "botocore": "s3",
    "boto3": "s3",
    "safetensors": "hf",
    "tokenizers": "hf",
    "deepspeed": "deepspeed",
    "peft": "finetune",
    "torchao": "finetune",
    "pyarrow": "arrow",
    "pynvml": "gpu",
}

# fsspec protocol -> the module that implements it (fsspec's own registry names the same).
_PROTOCOL_MODULE = {"s3": "s3fs", "s3a": "s3fs"}


class MissingExtra(ImportError):
    """An optional dependency is not installed; ``str()`` is the one line to print."""

    def __init__(self, module: str, feature: str) -> None:
        self.module = module
        self.extra = EXTRA_OF.get(module)
        self.feature = feature
        install = f"pip install 'orchestrator[{self.extra}]'" if self.extra \
            else f"pip install {module}"
        super().__init__(f"{feature} needs the Python module {module!r}, which is not "
                         f"installed here: {install}")


def installed(module: str) -> bool:
    """True when ``module`` can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken parent package
        return False


def require(module: str, feature: str) -> None:
    """Raise :class:`MissingExtra` unless ``module`` is installed."""
    if not installed(module):
        raise MissingExtra(module, feature)


def module_for_url(url: str | None) -> str | None:
    """The optional module an fsspec URL needs (``s3://`` -> s3fs), None for a path."""
    if not url or "://" not in url:
        return None
    return _PROTOCOL_MODULE.get(url.split("://", 1)[0].lower())


def require_for_url(url: str | None, feature: str) -> None:
    module = module_for_url(url)
    if module is not None:
        require(module, feature)


def from_import_error(exc: BaseException) -> MissingExtra | None:
    """The :class:`MissingExtra` a ``ModuleNotFoundError`` (or fsspec's "Install s3fs to
    access S3") stands for, when its module belongs to an extra; None otherwise."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:  # fsspec chains the original error
        seen.add(id(cur))
        if isinstance(cur, MissingExtra):
            return cur
        if isinstance(cur, ModuleNotFoundError) and cur.name:
            top = cur.name.split(".", 1)[0]
            if top in EXTRA_OF:
                return MissingExtra(top, "this command")
        cur = cur.__cause__ or cur.__context__
    return None


@dataclass(frozen=True)
class Need:
    """A module the config needs, the dotted field that needs it, and why."""

    field: str
    module: str
    feature: str

    @property
    def problem(self) -> str:
        return str(MissingExtra(self.module, self.feature))


def needs(cfg: Config) -> list[Need]:
    """Every optional module ``cfg``'s job needs on the nodes that run it."""
    out: list[Need] = []
    ckpt, data, tr = cfg.checkpoint, cfg.trainer.data, cfg.trainer
    for field, url in (("checkpoint.url", ckpt.url), ("checkpoint.local_url", ckpt.local_url),
                       ("trainer.data.path", data.path)):
        module = module_for_url(url)
        if module:
            out.append(Need(field, module, f"{field} {url}"))
    own_script = cfg.job.entrypoint is not None
    if not own_script:
        if data.tokenizer != "byte":
            out.append(Need("trainer.data.tokenizer", "tokenizers", "a tokenizer.json"))
        if data.format == "arrow":
            out.append(Need("trainer.data.format", "pyarrow", "trainer.data.format arrow"))
        if tr.parallelism.strategy == "deepspeed":
            out.append(Need("trainer.parallelism.strategy", "deepspeed",
                            "trainer.parallelism.strategy deepspeed"))
        if tr.model.init_from_hf:
            out.append(Need("trainer.model.init_from_hf", "safetensors",
                            "loading Hugging Face weights (trainer.model.init_from_hf)"))
        if tr.finetune is not None:
            out.append(Need("trainer.finetune", "peft", f"finetune.method {tr.finetune.method}"))
            if tr.finetune.method == "qlora":
                out.append(Need("trainer.finetune", "torchao", "finetune.method qlora (NF4)"))
        if tr.precision.fp8:
            out.append(Need("trainer.precision.fp8", "torchao", "trainer.precision.fp8"))
        if cfg.launcher.kind == "sagemaker":  # the final model is exported to /opt/ml/model
            out.append(Need("launcher.kind", "safetensors",
                            "launcher.kind sagemaker (the Hugging Face export of the model)"))
    return out


def missing(cfg: Config, is_installed: Callable[[str], bool] = installed) -> list[Need]:
    """What :func:`needs` lists that is not installed here."""
    return [n for n in needs(cfg) if not is_installed(n.module)]
