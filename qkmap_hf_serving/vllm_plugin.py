"""vLLM plugin of qkmap-hf (entry point ``vllm.general_plugins``): sizes QK-MAP attention for vLLM.

Why a plugin at all: vLLM's Transformers backend runs a folder's own remote code (``modeling_qkmap.py`` and its
siblings) but sizes its attention layers and KV cache from ``config.head_dim`` before any of that code runs, and
QK-MAP keys are ``2 F m`` wide (``query_key_dim``), not ``head_dim``. The plugin registers a model-architecture
convertor for ``model_type: qkmap`` whose head size is the key width; values are padded to it by vLLM's own
attention function (its CPU backend keeps one head size for keys and values). Nothing else is replaced: the
folder's code runs, and when it differs from this package's copy the plugin says so (and refuses code too old to
dispatch through vLLM).
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("qkmap_hf_serving.vllm_plugin")

MODEL_TYPE = "qkmap"


def query_key_width(config: Any) -> int:
    """Width of QK-MAP queries and keys (the attention head size vLLM must allocate), from the config's fields."""
    if getattr(config, "query_key_dim", None) is not None:  # QKMapConfig's property
        return int(config.query_key_dim)
    missing = [name for name in ("qk_mode", "head_dim") if getattr(config, name, None) is None]
    if missing:
        raise ValueError(
            f"config.json: QK-MAP field(s) {', '.join(missing)} missing, so vLLM cannot size the attention layers; "
            "re-save the folder with qkmap-hf (qkmap convert / save_pretrained)."
        )
    if config.qk_mode == "qk_map":
        m = getattr(config, "qkmap_input_dim", None) or config.head_dim
        return 2 * int(config.qkmap_num_frequencies) * int(m)
    return (
        2 * int(config.head_dim) if getattr(config, "qk_position_prior", None) == "constant" else int(config.head_dim)
    )


def package_modeling_dir() -> Path | None:
    """This package's modeling files (found without importing ``qkmap_hf``, see the package docstring)."""
    spec = importlib.util.find_spec("qkmap_hf")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "modeling"


def forward_dispatches(attention_source: str) -> bool:
    """Whether ``QKMapAttention.forward`` looks up ``ALL_ATTENTION_FUNCTIONS`` itself, which vLLM reads to find
    each layer's attention call (older copies did the lookup in a helper)."""
    for node in ast.walk(ast.parse(attention_source)):
        if isinstance(node, ast.ClassDef) and node.name == "QKMapAttention":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    return "ALL_ATTENTION_FUNCTIONS" in (ast.get_source_segment(attention_source, item) or "")
    return False


def check_folder_code(folder: str | os.PathLike) -> list[str]:
    """Names of the folder's modeling files that differ from this package's copy (a warning says which run).

    Raises a one-line ValueError when the folder's attention cannot dispatch through vLLM.
    """
    folder = Path(folder)
    attention = folder / "attention_qkmap.py"
    if not attention.is_file():
        return []  # a Hub id or a folder without code: transformers reports what is missing
    if not forward_dispatches(attention.read_text()):
        raise ValueError(
            f"{attention}: QKMapAttention.forward predates vLLM support (it does not look up "
            "ALL_ATTENTION_FUNCTIONS itself); re-save the folder with this qkmap-hf (qkmap convert, or "
            "QKMapForCausalLM.from_pretrained(folder).save_pretrained(new_folder)) to serve it with vLLM."
        )
    package = package_modeling_dir()
    if package is None:
        return []
    differing = [
        name
        for name in sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")  # the copied files
        if (folder / name).is_file()
        and (package / name).is_file()
        and (folder / name).read_bytes() != (package / name).read_bytes()
    ]
    if differing:
        logger.warning(
            "%s: its %s differ from qkmap-hf's copy in %s; vLLM runs the folder's own code (the plugin only sizes "
            "the attention heads).",
            folder,
            ", ".join(differing),
            package,
        )
    return differing


def register() -> None:
    """Entry point: register the ``qkmap`` architecture convertor with vLLM (idempotent, as vLLM asks)."""
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    if MODEL_TYPE in convertors.MODEL_ARCH_CONFIG_CONVERTORS:
        return

    class QKMapArchConfigConvertor(convertors.ModelArchConfigConvertorBase):
        """Head size = QK-MAP's key width; the folder's code is checked once, when vLLM reads the config."""

        def get_head_size(self) -> int:
            name = getattr(self.hf_config, "_name_or_path", "") or ""
            if os.path.isdir(name):
                check_folder_code(name)
            return query_key_width(self.hf_text_config)

    convertors.MODEL_ARCH_CONFIG_CONVERTORS[MODEL_TYPE] = QKMapArchConfigConvertor


__all__ = ["check_folder_code", "forward_dispatches", "query_key_width", "register"]
