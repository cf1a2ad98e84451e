"""The attention kernel's own time in a training step, replayed alone (issue 23: "is it the kernel?").

The arithmetic floor of ``shape_grid.py`` weighs every matmul FLOP alike, but the fused attention kernel runs at
fewer FLOP/s than the projections' and MLP's GEMMs: on this CPU, with the attention kernel a fifth of a training
step's time, doubling its width costs more of the step than its share of the FLOPs says. This module records the
``scaled_dot_product_attention`` calls one training step makes (shapes, strides, dtype, mask and keywords, through
a ``TorchFunctionMode``), then replays them, forward and backward, on fresh tensors of the same layout: the
kernel's time per step without the model around it. ``shape_grid.py --kernel-time`` times the replay inside each
repeat, interleaved with the training steps, and turns it into a measured floor (``kernel_floor_ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class TensorLayout:
    """What a replay needs of one kernel input: its size, strides (the model feeds transposed views), dtype and
    device, and whether autograd asked for its gradient."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, tensor.requires_grad)

    def fresh(self) -> torch.Tensor:
        """A tensor of this layout, filled with normal noise (the kernel's time does not depend on the values)."""
        tensor = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device).normal_()
        return tensor.requires_grad_(self.requires_grad)


@dataclass(frozen=True)
class AttentionCall:
    """One recorded ``scaled_dot_product_attention`` call: its three inputs' layouts, the mask tensor itself (or
    None) and its keywords."""

    query: TensorLayout
    key: TensorLayout
    value: TensorLayout
    attn_mask: torch.Tensor | None
    keywords: tuple[tuple[str, object], ...]


class _RecordAttention(TorchFunctionMode):
    """Records every ``F.scaled_dot_product_attention`` call and runs it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key, value, *rest = args
            keywords = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), rest, strict=False))
            keywords |= kwargs
            mask = keywords.pop("attn_mask", None)
            layouts = (TensorLayout.of(query), TensorLayout.of(key), TensorLayout.of(value))
            self.calls.append(AttentionCall(*layouts, mask, tuple(sorted(keywords.items()))))
        return func(*args, **kwargs)


def record_training_calls(model: torch.nn.Module, ids: torch.Tensor) -> list[AttentionCall]:
    """The attention kernel calls of one training step of ``model`` on ``ids`` (the step runs, its gradients are
    dropped). Empty when the model does not attend through ``scaled_dot_product_attention`` (eager, flex)."""
    recorder = _RecordAttention()
    with recorder:
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return recorder.calls


class KernelReplay:
    """The recorded calls, ready to run forward and backward: one set of input tensors per distinct layout (the
    layers of a model call the kernel alike), made once, so the replay allocates what the kernel allocates."""

    def __init__(self, calls: list[AttentionCall]):
        self.calls = calls
        self._inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for call in calls:
            layouts = (call.query, call.key, call.value)
            if layouts not in self._inputs:
                self._inputs[layouts] = tuple(layout.fresh() for layout in layouts)

    def __call__(self) -> None:
        """Every call's forward, then its backward against a gradient of ones (as the layer's output gradient
        arrives, dense), in the order the step made them."""
        for call in self.calls:
            inputs = self._inputs[(call.query, call.key, call.value)]
            output = F.scaled_dot_product_attention(*inputs, attn_mask=call.attn_mask, **dict(call.keywords))
            wanted = [tensor for tensor in inputs if tensor.requires_grad]
            if wanted:
                torch.autograd.grad(output, wanted, torch.ones_like(output))
