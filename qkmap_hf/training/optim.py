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

Which parameter joins which group is each query/key construction's answer (``QueryKeyConstruction.parameter_group``,
through ``qkmap_hf.modeling.qk_registry``), asked with the model's config: the same answer for this package's
model, a trust_remote_code copy of it, and peft's ``modules_to_save`` wrappers around its modules.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import Trainer

from ..modeling.qk_registry import constructions_for
from ..modeling.query_key import QUERY_KEY_GROUP

# Default learning rate of the QK-MAP group as a multiple of the base learning rate, chosen with the comparison
# harness (docs/compare.md, "Choosing the defaults").
QKMAP_LR_MULTIPLIER = 10.0
GROUP_NAMES = ("decay", "no_decay", "qkmap")
# A construction's group names (``qkmap_hf.modeling.query_key``) as this module's: the query/key group is "qkmap".
CONSTRUCTION_GROUPS = {QUERY_KEY_GROUP: "qkmap", "decay": "decay"}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("Norm", "RMSNorm"))


def query_key_groups(model: nn.Module, *, qk_norm_in_qk_group: bool = False) -> dict[int, str]:
    """``id(parameter) -> group`` for every parameter a query/key construction owns, as its construction says.

    A parameter its construction leaves to transformers' rule (a norm weight) joins the query/key group only with
    ``qk_norm_in_qk_group``. Attention layers are the modules with a ``config`` and ``q_proj``/``k_proj``.
    """
    groups: dict[int, str] = {}
    for attention in model.modules():
        config = getattr(attention, "config", None)
        if config is None or not all(hasattr(attention, n) for n in ("q_proj", "k_proj")):
            continue
        for construction in constructions_for(config):
            for module_name in construction.modules:
                module = getattr(attention, module_name, None)
                for full_name, param in module.named_parameters() if module is not None else ():
                    parameter_name = full_name.rsplit(".", 1)[-1]  # under peft: modules_to_save.default.<name>
                    group = construction.parameter_group(config, module_name, parameter_name)
                    if group is None and qk_norm_in_qk_group:
                        group = QUERY_KEY_GROUP
                    if group is not None:
                        groups[id(param)] = CONSTRUCTION_GROUPS[group]
    return groups


def classify_parameters(
    model: nn.Module, *, qk_norm_in_qk_group: bool = False
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by group name (``decay``, ``no_decay``, ``qkmap``), each tied tensor once.

    Ownership decides, not shape: the query/key constructions name their parameters (``query_key_groups``) in this
    package's model, in a trust_remote_code copy of it and inside peft's ``modules_to_save`` wrappers alike.
    """
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name in GROUP_NAMES}
    owned = query_key_groups(model, qk_norm_in_qk_group=qk_norm_in_qk_group)
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in owned:
                group = owned[id(param)]
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

    def _get_train_sampler(self, *args, **kwargs):
        """Trainer's sampler, except in order for a dataset whose order is its curriculum (``ordered``: a synthetic
        task with ``copy_warmup``), so training step ``s`` sees examples ``s * batch ...``."""
        dataset = args[0] if args else kwargs.get("train_dataset")
        dataset = self.train_dataset if dataset is None else dataset
        if getattr(dataset, "ordered", False):
            return torch.utils.data.SequentialSampler(dataset)
        return super()._get_train_sampler(*args, **kwargs)

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


__all__ = ["QKMAP_LR_MULTIPLIER", "QKMapTrainer", "classify_parameters", "parameter_groups", "query_key_groups"]
