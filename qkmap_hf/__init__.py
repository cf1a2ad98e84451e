"""qkmap-hf: QK-MAP attention for Hugging Face transformers.

Importing the package registers ``model_type="qkmap"`` with the Auto classes, so
``AutoModelForCausalLM.from_config(QKMapConfig(...))`` and ``from_pretrained(dir)`` work without
``trust_remote_code``; saved checkpoints also carry the model files and load with it, without this package. It also
loads the fused CPU kernels where this machine has built it (``qkmap_hf.kernels``).
"""

from __future__ import annotations

import importlib.util
from importlib import import_module
from typing import TYPE_CHECKING, Any

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import moved
from .kernels import load_fused_kernel
from .modeling.configuration_qkmap import QK_MODES, QKMapConfig
from .modeling.modeling_qkmap import (
    QKMapForCausalLM,
    QKMapForQuestionAnswering,
    QKMapForSequenceClassification,
    QKMapForTokenClassification,
    QKMapModel,
    QKMapPreTrainedModel,
    qkmap_features,
)
from .version import __version__

AutoConfig.register("qkmap", QKMapConfig, exist_ok=True)
AutoModel.register(QKMapConfig, QKMapModel, exist_ok=True)
AutoModelForCausalLM.register(QKMapConfig, QKMapForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(QKMapConfig, QKMapForSequenceClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(QKMapConfig, QKMapForQuestionAnswering, exist_ok=True)
AutoModelForTokenClassification.register(QKMapConfig, QKMapForTokenClassification, exist_ok=True)
# save_pretrained copies the modeling files into the checkpoint for classes registered for an Auto class.
QKMapConfig.register_for_auto_class("AutoConfig")
QKMapModel.register_for_auto_class("AutoModel")
QKMapForCausalLM.register_for_auto_class("AutoModelForCausalLM")
QKMapForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
QKMapForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")
QKMapForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")

# Old names of the modules that moved to the research lab (qkmap_lab) keep importing for one release.
moved.install()

# The fused CPU kernels (feature map, wide-key attention), where this machine has built them (``qkmap kernels``):
# loading never compiles.
load_fused_kernel(build=False)

# peft's per-model-type defaults (LoRA target modules, ...) get a "qkmap" entry, as peft does for llama.
if importlib.util.find_spec("peft") is not None:
    from .training import peft_support  # noqa: F401

# Heavier parts load on first use so that `import qkmap_hf` stays fast.
_LAZY = {
    "convert_model": "qkmap_hf.conversion",
    "convert_checkpoint": "qkmap_hf.packaging",
    "verify_conversion": "qkmap_hf.verify",
}

if TYPE_CHECKING:  # pragma: no cover
    from .conversion import convert_model
    from .packaging import convert_checkpoint
    from .verify import verify_conversion


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qkmap_hf' has no attribute {name!r}")


__all__ = [
    "QK_MODES",
    "QKMapConfig",
    "QKMapForCausalLM",
    "QKMapForQuestionAnswering",
    "QKMapForSequenceClassification",
    "QKMapForTokenClassification",
    "QKMapModel",
    "QKMapPreTrainedModel",
    "__version__",
    "convert_checkpoint",
    "convert_model",
    "qkmap_features",
    "verify_conversion",
]
