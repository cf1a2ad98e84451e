"""lm-eval integration: the ``qkmap`` model type (an ``HFLM`` subclass) and the bundled offline task pack.

lm-eval has no entry-point discovery, so importing this module is what registers ``--model qkmap``;
``qkmap eval`` imports it and then hands over to lm-eval's own CLI (``run_lm_eval_cli``). From Python::

    import lm_eval, qkmap_hf.lm_eval
    lm_eval.simple_evaluate(model="qkmap", model_args={"pretrained": "path/or/repo"}, tasks=["qkmap_next_line"],
                           task_manager=qkmap_hf.lm_eval.task_manager())

What ``qkmap`` adds to ``hf``:

- QK-MAP checkpoints load without ``trust_remote_code`` (the installed package provides the classes); pass
  ``trust_remote_code=True`` to run the modeling files saved with the checkpoint instead (what a downloader
  without qkmap-hf runs). Plain ``transformers`` would keep using the registered package classes in that case.
- ``attn_implementation`` (eager, sdpa, flash_attention_2/3, flex_attention, or a Hub kernel ``org/name``) and
  ``dtype`` (``torch_dtype`` accepted as an alias) are checked before loading.
- Keys that would otherwise travel silently into ``from_pretrained`` and from there into the model config are
  refused with an error naming them; ``qk_mode`` and the ``qkmap_*`` config fields are properties of the trained
  weights, not evaluation options.
- The device defaults to CUDA when available, else CPU (``hf`` defaults to ``cuda`` unconditionally).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (registers lm-eval's own models lazily before ours is added)
import torch
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM

import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the transformers Auto classes)

from .modeling.configuration_qkmap import QKMapConfig
from .tasks import TAG, TASK_NAMES, task_pack_dir

logger = logging.getLogger(__name__)

MODEL_NAME = "qkmap"
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# Extra keyword arguments forwarded to `from_pretrained` (HFLM's own parameters are accepted as well).
FROM_PRETRAINED_KWARGS = frozenset(
    {
        "attn_implementation",
        "device_map",
        "max_memory",
        "offload_buffers",
        "cache_dir",
        "local_files_only",
        "token",
        "use_safetensors",
        "variant",
        "key_mapping",
        "use_kernels",
        "disable_mmap",
        "weights_only",
        "load_in_8bit",
        "load_in_4bit",
        "bnb_4bit_compute_dtype",
        "bnb_4bit_quant_type",
        "bnb_4bit_use_double_quant",
    }
)
_HFLM_PARAMETERS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}
_CONFIG_FIELDS = frozenset({"qk_mode"} | {name for name in vars(QKMapConfig) if name.startswith("qkmap_")})


def task_manager(**kwargs: Any):
    """An lm-eval ``TaskManager`` that also knows the bundled tasks (``include_path`` = ``task_pack_dir()``)."""
    from lm_eval.tasks import TaskManager

    extra = kwargs.pop("include_path", None)
    extra = [] if extra is None else list(extra) if isinstance(extra, (list, tuple)) else [extra]
    return TaskManager(include_path=[str(task_pack_dir()), *(str(p) for p in extra)], **kwargs)


def run_lm_eval_cli(argv: list[str]) -> int:
    """lm-eval's command line on ``argv`` (``run ...``, ``ls ...``, ``validate ...``), with ``--model qkmap``
    registered and the bundled task pack on ``--include_path``; returns the exit code.

    It calls ``lm_eval.__main__.cli_evaluate``, the function behind lm-eval's ``lm-eval`` console script (its one
    public command-line API; it reads ``sys.argv``). That CLI takes one ``--include_path``: a user's own folder is
    combined with the task pack in a temporary folder of links (``linked_task_folder``).
    """
    import sys
    import tempfile

    from lm_eval.__main__ import cli_evaluate

    argv, user_path = _take_include_path(list(argv))
    with tempfile.TemporaryDirectory(prefix="qkmap-tasks-") as scratch:
        include = str(task_pack_dir())
        if user_path:
            include = str(linked_task_folder([task_pack_dir(), Path(user_path)], Path(scratch)))
        saved_argv = sys.argv
        sys.argv = ["lm-eval", *argv, "--include_path", include]
        try:
            cli_evaluate()
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        finally:
            sys.argv = saved_argv
    return 0


def _take_include_path(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--include_path DIR`` / ``--include_path=DIR``, and that DIR (None when absent)."""
    path = None
    for index, arg in enumerate(argv):
        if arg == "--include_path" and index + 1 < len(argv):
            path = argv[index + 1]
            return argv[:index] + argv[index + 2 :], path
        if arg.startswith("--include_path="):
            return argv[:index] + argv[index + 1 :], arg.partition("=")[2]
    return argv, path


def linked_task_folder(sources: list[Path], into: Path) -> Path:
    """One folder holding every source's task files as links, one subfolder per source (layouts kept).

    lm-eval scans with ``glob("**/*.yaml")``, which does not enter linked folders, so folders are made and only
    files are linked; a YAML's ``!function utils.f`` finds ``utils.py`` beside its link.
    """
    for number, source in enumerate(sources):
        if not source.is_dir():
            raise FileNotFoundError(f"--include_path {source}: no such task folder.")
        for folder, files in _walk(source):
            target = into / f"source{number}" / Path(folder).relative_to(source)
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                (target / name).symlink_to(Path(folder, name).resolve())
    return into


def _walk(source: Path):
    import os

    for folder, dirs, files in os.walk(source, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        yield folder, files


def split_model_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``model_args`` into (HFLM arguments, ``from_pretrained`` extras); raise on keys that fit neither."""
    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs:
        if "dtype" in kwargs:
            raise ValueError("model_args has both dtype and torch_dtype; pass only dtype.")
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    config_fields = sorted(_CONFIG_FIELDS & kwargs.keys())
    if config_fields:
        raise ValueError(
            f"model_args {', '.join(config_fields)}: QK-MAP config fields are fixed by the trained weights, not "
            "evaluation options; evaluate a checkpoint that was converted or trained with the settings you want."
        )
    unknown = sorted(kwargs.keys() - _HFLM_PARAMETERS - FROM_PRETRAINED_KWARGS)
    if unknown:
        raise ValueError(
            f"model_args {', '.join(unknown)} are not understood by the qkmap model type and would reach the model "
            f"config unchecked. Accepted: lm-eval's hf arguments ({', '.join(sorted(_HFLM_PARAMETERS))}) and "
            f"from_pretrained options ({', '.join(sorted(FROM_PRETRAINED_KWARGS))})."
        )
    implementation = kwargs.get("attn_implementation")
    if implementation is not None and implementation not in ATTN_IMPLEMENTATIONS and "/" not in str(implementation):
        raise ValueError(
            f"model_args attn_implementation={implementation!r} is unknown; use one of "
            f"{', '.join(ATTN_IMPLEMENTATIONS)} or a Hub kernel such as kernels-community/flash-attn."
        )
    hflm = {k: v for k, v in kwargs.items() if k in _HFLM_PARAMETERS}
    extras = {k: v for k, v in kwargs.items() if k not in _HFLM_PARAMETERS}
    return hflm, extras


class _CheckpointClass:
    """Stands in for ``AutoModelForCausalLM`` in HFLM's loader: ``from_pretrained`` of one given class."""

    def __init__(self, model_class: type) -> None:
        self.model_class = model_class

    def from_pretrained(self, *args: Any, trust_remote_code: bool = True, **kwargs: Any):
        return self.model_class.from_pretrained(*args, **kwargs)


class QKMapLM(HFLM):
    """lm-eval's ``hf`` model with QK-MAP defaults and strict options (see module docstring)."""

    def __init__(self, pretrained: str | Any, **kwargs: Any) -> None:
        hflm_kwargs, extras = split_model_kwargs(kwargs)
        if hflm_kwargs.get("trust_remote_code") is None:
            hflm_kwargs["trust_remote_code"] = False  # the installed package provides the QK-MAP classes
        if hflm_kwargs.get("device") is None:
            hflm_kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(pretrained, Path):
            pretrained = str(pretrained)
        super().__init__(pretrained, **hflm_kwargs, **extras)
        model = self.model
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) == "qkmap":
            source = (
                "checkpoint files (trust_remote_code)"
                if type(model).__module__.startswith("transformers_modules")
                else "qkmap_hf"
            )
            logger.info(
                "Evaluating a QK-MAP checkpoint: qk_mode=%s, attn_implementation=%s, dtype=%s, code from %s",
                config.qk_mode,
                getattr(config, "_attn_implementation", None),
                next(model.parameters()).dtype,
                source,
            )

    def _create_model(self, pretrained: str, **kwargs: Any) -> None:
        """With ``trust_remote_code=True``, load a QK-MAP checkpoint through its own modeling files."""
        auto_map = getattr(self.config, "auto_map", None) or {}
        if not (
            kwargs.get("trust_remote_code") and self.config.model_type == "qkmap" and "AutoModelForCausalLM" in auto_map
        ):
            return super()._create_model(pretrained, **kwargs)
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        # transformers prefers registered classes over remote code; ask for the checkpoint's class explicitly.
        remote_class = get_class_from_dynamic_module(
            auto_map["AutoModelForCausalLM"],
            pretrained,
            revision=kwargs.get("revision"),
            subfolder=kwargs.get("subfolder") or "",
        )
        auto_class = self.AUTO_MODEL_CLASS
        self.AUTO_MODEL_CLASS = _CheckpointClass(remote_class)
        try:
            super()._create_model(pretrained, **kwargs)
        finally:
            self.AUTO_MODEL_CLASS = auto_class

    def _get_backend(self, config, backend="default", trust_remote_code=False) -> None:
        # "qkmap" is registered with AutoModelForCausalLM at runtime, not in transformers' static name tables.
        if backend == "default" and getattr(config, "model_type", None) == "qkmap":
            backend = "causal"
        super()._get_backend(config=config, backend=backend, trust_remote_code=trust_remote_code)


if MODEL_NAME not in model_registry:
    register_model(MODEL_NAME)(QKMapLM)


__all__ = [
    "MODEL_NAME",
    "QKMapLM",
    "TAG",
    "TASK_NAMES",
    "split_model_kwargs",
    "task_manager",
    "task_pack_dir",
]
