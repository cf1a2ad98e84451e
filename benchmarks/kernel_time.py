"""The attention kernel's own time in a training step, replayed alone (issue 23: "is it the kernel?").

The arithmetic floor of ``shape_grid.py`` weighs every matmul FLOP alike, but the fused attention kernel runs at
fewer FLOP/s than the projections' and MLP's GEMMs: on this CPU, with the attention kernel a fifth of a training
step's time, doubling its width costs more of the step than its share of the FLOPs says. This module records the
``scaled_dot_product_attention`` calls one training step makes (shapes, strides, dtype, mask and keywords, through
a ``TorchFunctionMode``), and the fused CPU attention's (``qkmap_v1.causal_attention``, where the wide layout runs
it), then replays them, forward and backward, on fresh tensors of the same layout: the kernel's time per step
without the model around it. ``shape_grid.py --kernel-time`` times the replay inside each
repeat, interleaved with the training steps, and turns it into a measured floor (``kernel_floor_ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from qkmap_hf.modeling import attention_qkmap


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
    """One recorded attention call: its three inputs' layouts, the mask tensor itself (or None) and its keywords;
    ``kernel`` says whose: ``"sdpa"`` (``scaled_dot_product_attention``) or ``"fused"`` (the fused CPU attention,
    whose one keyword is its ``scale``)."""

    query: TensorLayout
    key: TensorLayout
    value: TensorLayout
    attn_mask: torch.Tensor | None
    keywords: tuple[tuple[str, object], ...]
    kernel: str = "sdpa"

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The recorded call on these inputs, through autograd as the model makes it."""
        keywords = dict(self.keywords)
        if self.kernel == "fused":
            return attention_qkmap.FusedCausalAttention.apply(query, key, value, keywords["scale"])
        return F.scaled_dot_product_attention(query, key, value, attn_mask=self.attn_mask, **keywords)


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


class _RecordFusedAttention:
    """``attention_qkmap.FUSED_ATTENTION_OPS`` in place of the model files' own lookup, recording the layouts of
    each ``causal_attention`` call (forward) before running it."""

    def __init__(self, ops, calls: list[AttentionCall]):
        self.ops, self.calls = ops, calls

    def causal_attention(self, query, key, value, scale):
        layouts = (TensorLayout.of(query), TensorLayout.of(key), TensorLayout.of(value))
        self.calls.append(AttentionCall(*layouts, None, (("scale", scale),), kernel="fused"))
        return self.ops.causal_attention(query, key, value, scale)

    def __getattr__(self, name: str):
        return getattr(self.ops, name)


def record_training_calls(model: torch.nn.Module, ids: torch.Tensor) -> list[AttentionCall]:
    """The attention kernel calls of one training step of ``model`` on ``ids`` (the step runs, its gradients are
    dropped): sdpa's and the fused CPU attention's. Empty when the model attends through neither (eager, flex)."""
    recorder = _RecordAttention()
    ops, lookup = attention_qkmap.FUSED_ATTENTION_OPS(), attention_qkmap.FUSED_ATTENTION_OPS
    if ops is not None:  # the model files look the ops up through this name at every call
        fused = _RecordFusedAttention(ops, recorder.calls)
        attention_qkmap.FUSED_ATTENTION_OPS = lambda: fused
    try:
        with recorder:
            loss = model(ids, labels=ids).loss
        loss.backward()
    finally:
        attention_qkmap.FUSED_ATTENTION_OPS = lookup
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
            output = call.run(*inputs)
            wanted = [tensor for tensor in inputs if tensor.requires_grad]
            if wanted:
                torch.autograd.grad(output, wanted, torch.ones_like(output))
