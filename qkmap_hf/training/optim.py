"""Optimizer parameter groups, with QK-MAP's frequencies and gains in a group of their own.

Why a separate group (see docs/training.md for the measurements):

- Scale. ``log_frequency`` is a logarithm and the gains are O(1) multipliers of whole feature blocks; a weight
  matrix entry is O(1/sqrt(width)). Adam moves every entry by about the learning rate per step, so at the
  weight-matrix learning rate the frequencies of a converted model (``omega_0 = 1e-3``, log -6.9) would need
  thousands of steps to reach the nonlinear regime (omega ~ 1, log 0). Their own learning rate sets that speed.
- Weight decay. Decay pulls a parameter towards 0: for a gain that means switching its feature block off, for
  ``log_frequency`` it means pulling every omega towards 1 regardless of the data. Neither is a regulariser of
  capacity the way decay on a weight matrix is, so the group gets ``weight_decay=0`` (like norms and biases).

The other groups follow transformers' Trainer: weight matrices and embeddings are decayed; biases and the
weights of normalisation layers (RMSNorm, QK-Norm's ``q_norm``/``k_norm``) are not.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import Trainer

# Default learning rate of the QK-MAP group as a multiple of the base learning rate, chosen with the comparison
# harness (docs/compare.md, "Choosing the defaults").
QKMAP_LR_MULTIPLIER = 10.0
QKMAP_MODULE_CLASS = "QKMapFeatureMap"
# Query/key-side parameters that share the QK-MAP group: the position-prior ablation's constant blocks always,
# QK-Norm's q_norm/k_norm weights only when asked (``qk_norm_in_qk_group``: equal tuning in ``qkmap compare``).
QK_GROUP_MODULE_CLASSES = (QKMAP_MODULE_CLASS, "QKPositionPrior")
QK_NORM_MODULE_NAMES = ("q_norm", "k_norm")
GROUP_NAMES = ("decay", "no_decay", "qkmap")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("Norm", "RMSNorm"))


def _is_decayed_gain(module: nn.Module, param_name: str) -> bool:
    """A QK-MAP gain under ``qkmap_gain_treatment="decayed"``: trained like a weight matrix (base rate, decay)."""
    config = getattr(module, "config", None)
    return (
        type(module).__name__ == QKMAP_MODULE_CLASS
        and param_name.endswith("_gain")
        and getattr(config, "qkmap_gain_treatment", "learned") == "decayed"
    )


def classify_parameters(
    model: nn.Module, *, qk_norm_in_qk_group: bool = False
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by group name (``decay``, ``no_decay``, ``qkmap``), each tied tensor once.

    Ownership decides, not shape: the owning module's class name finds QK-MAP parameters in this package's
    model, in a trust_remote_code copy of it and inside peft's ``modules_to_save`` wrappers alike, and it still
    works under FSDP, where flattened shards no longer show a parameter's dimensions.
    """
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name in GROUP_NAMES}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            is_qk_norm = qk_norm_in_qk_group and module_name.rsplit(".", 1)[-1] in QK_NORM_MODULE_NAMES
            if _is_decayed_gain(module, param_name):
                group = "decay"
            elif type(module).__name__ in QK_GROUP_MODULE_CLASSES or is_qk_norm:
                group = "qkmap"
            elif param_name.endswith("bias") or _is_norm(module):
                group = "no_decay"
            else:
                group = "decay"
            groups[group].append((full_name, param))
    return groups


def parameter_groups(
    model: nn.Module,
    *,
    learning_rate: float,
    weight_decay: float,
    qkmap_learning_rate: float | None = None,
    qkmap_weight_decay: float = 0.0,
    qk_norm_in_qk_group: bool = False,
) -> list[dict]:
    """torch optimizer groups; each carries a ``name`` key and its own ``lr`` and ``weight_decay``.

    ``qkmap_learning_rate`` defaults to ``QKMAP_LR_MULTIPLIER * learning_rate``. Empty groups are left out.
    """
    if qkmap_learning_rate is None:
        qkmap_learning_rate = QKMAP_LR_MULTIPLIER * learning_rate
    settings = {
        "decay": (learning_rate, weight_decay),
        "no_decay": (learning_rate, 0.0),
        "qkmap": (qkmap_learning_rate, qkmap_weight_decay),
    }
    result = []
    for name, members in classify_parameters(model, qk_norm_in_qk_group=qk_norm_in_qk_group).items():
        if members:
            lr, decay = settings[name]
            result.append({"name": name, "params": [p for _, p in members], "lr": lr, "weight_decay": decay})
    return result


class QKMapTrainer(Trainer):
    """transformers' ``Trainer`` with QK-MAP parameter groups and eval perplexity in the logs.

    Args (beyond ``Trainer``'s):
        qkmap_learning_rate: learning rate of the QK-MAP group; ``None`` means ``QKMAP_LR_MULTIPLIER`` x the base.
        qkmap_weight_decay: weight decay of the QK-MAP group (default 0).
        qk_norm_in_qk_group: put QK-Norm's q_norm/k_norm weights in that group (``qkmap compare`` does, so that
            ``qk_lr_multiplier`` tunes every mode's query/key-side parameters alike).
    The learning-rate schedule scales every group's own rate by the same factor.
    """

    def __init__(
        self,
        *args,
        qkmap_learning_rate: float | None = None,
        qkmap_weight_decay: float = 0.0,
        qk_norm_in_qk_group: bool = False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.qk_norm_in_qk_group = qk_norm_in_qk_group
        self.qkmap_learning_rate = (
            qkmap_learning_rate if qkmap_learning_rate is not None else QKMAP_LR_MULTIPLIER * self.args.learning_rate
        )
        self.qkmap_weight_decay = qkmap_weight_decay

    def create_optimizer(self, model=None):
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            return self.optimizer
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        is_optimizer_class = isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        if not is_optimizer_class or any(key in optimizer_kwargs for key in ("params", "model", "optimizer_dict")):
            # Optimizers that build their own groups (GaLore, LOMO, layer-wise, factories): keep Trainer's logic.
            return super().create_optimizer(model)
        groups = parameter_groups(
            opt_model,
            learning_rate=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
            qkmap_learning_rate=self.qkmap_learning_rate,
            qkmap_weight_decay=self.qkmap_weight_decay,
            qk_norm_in_qk_group=self.qk_norm_in_qk_group,
        )
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint save; a failure (a full disk) becomes one line naming the checkpoint folder and the
        space it needs (``guards.save_failed``). ``--resume`` skips the incomplete folder."""
        from pathlib import Path

        from safetensors import SafetensorError

        from .guards import save_failed, state_bytes

        try:
            super()._save_checkpoint(model, trial)
        except (OSError, SafetensorError) as error:
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            raise save_failed(folder, error, state_bytes(self.model, self.optimizer)) from error

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``eval_perplexity = exp(eval_loss)`` next to every eval loss."""
        for key in [k for k in logs if k.endswith("eval_loss")]:
            logs[key.replace("eval_loss", "eval_perplexity")] = math.exp(min(logs[key], 50.0))
        super().log(logs, start_time)


__all__ = ["QKMAP_LR_MULTIPLIER", "QKMapTrainer", "classify_parameters", "parameter_groups"]
