# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""The QK-MAP feature map ``phi`` of docs/method.md, with a backward pass that recomputes instead of storing.

Copied into every checkpoint next to modeling_qkmap.py (it imports only torch). Plain autograd over the
elementwise chain keeps phases, cos, sin and the gained features of every query and key for the backward
pass: about five times the bytes of ``z``. ``QKMapFeatureFunction`` keeps ``z`` and the small parameter
tensors only and recomputes cos/sin in the backward pass; its gradients are autograd's up to float rounding
(tests/plugin/test_feature_map.py checks them against autograd of the written-out formula).
"""

from __future__ import annotations

import warnings

import torch


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool) -> None:
    """``out = x * cos + rotate_half(x) * sin`` (Llama's RoPE on the last dimension), or its adjoint.

    On the two halves, with one multiply and one fused multiply-add per half written straight into ``out`` (a
    strided view of the feature buffer): forward ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``, adjoint
    ``(x1 c1 + x2 s2, x2 c2 - x1 s1)``. ``x`` is only read, so it needs no copy of its first half.
    """
    x1, x2 = _halves(x)
    out1, out2 = _halves(out)
    cos1, cos2 = _halves(cos)
    sin1, sin2 = _halves(sin)
    sign = 1 if adjoint else -1
    if torch.compiler.is_compiling():  # dynamo takes no strided ``out=``; inductor fuses the plain form anyway
        out1.copy_(x1 * cos1 + sign * x2 * (sin2 if adjoint else sin1))
        out2.copy_(x2 * cos2 - sign * x1 * (sin1 if adjoint else sin2))
        return
    torch.mul(x1, cos1, out=out1).addcmul_(x2, sin2 if adjoint else sin1, value=sign)
    torch.mul(x2, cos2, out=out2).addcmul_(x1, sin1 if adjoint else sin2, value=-sign)


def _halves(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of the last dimension as views: two ``narrow`` calls, about half the dispatch cost of
    ``chunk`` (its ``split`` and list), which decoding pays eight times per layer and token."""
    half = tensor.shape[-1] // 2
    return tensor.narrow(-1, 0, half), tensor.narrow(-1, half, half)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without the call when it is a no-op (decoding runs this path per token and layer)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least (docs/method.md: a bf16 phase of magnitude 100 is off by 0.5 rad); float64 stays. A Python
    check, not ``torch.promote_types``, which dispatches an op per call (decoding calls this per layer and token)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class _Layout:
    """Views that broadcast to ``(batch, seq, kv_heads, groups, F, m)`` (one row of a block: cos or sin) in the
    compute dtype.

    Token-major, like the projections the model feeds in (``q_proj(x).view(b, t, h, m).transpose(1, 2)``), so
    every elementwise pass walks memory in order. cos and sin of the phases live in one buffer of two contiguous
    halves, ``(2, batch, seq, kv_heads, groups, F, m)`` (``empty_trig``; a strided ``cos_``/``sin_`` over
    interleaved slots took twice as long here), so one multiply applies both rows' gains and one rotation call
    turns both rows: at hidden 128 each op's per-call and per-row cost, not its arithmetic, is most of the map's
    time. Only the rotation writes the interleaved ``(..., F, 2, m)`` feature rows. The output is handed back as a
    ``(batch, heads, seq, 2F*m)`` view, as Llama's RoPE output is.
    """

    def __init__(self, z: torch.Tensor, frequency: torch.Tensor, cos: torch.Tensor):
        self.batch, self.heads, self.seq, self.m = z.shape
        self.kv_heads, self.num_freq, self.freq_width = frequency.shape
        self.groups = self.heads // self.kv_heads
        self.dtype = _compute_dtype(z.dtype)
        self.table_batch = cos.shape[0]
        self.device = z.device

    def z(self, z: torch.Tensor) -> torch.Tensor:
        return _cast(z.transpose(1, 2), self.dtype).view(self.batch, self.seq, self.kv_heads, self.groups, 1, self.m)

    def frequency(self, frequency: torch.Tensor) -> torch.Tensor:
        return _cast(frequency, self.dtype).view(1, 1, self.kv_heads, 1, self.num_freq, self.freq_width)

    def gain_rows(self, gain: torch.Tensor) -> torch.Tensor:
        """The gains as ``(2, 1, 1, kv_heads, 1, F, m)``, cos rows then sin rows, to broadcast against the trig."""
        rows = _cast(gain, self.dtype).view(1, 1, self.kv_heads, 1, self.num_freq, 2, self.m)
        return rows.movedim(-2, 0)

    def table(self, table: torch.Tensor) -> torch.Tensor:
        return _cast(table, self.dtype).view(self.table_batch, self.seq, 1, 1, 1, self.m)

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """A ``(batch, heads, seq, 2F*m)`` tensor seen (no copy) as ``(2, batch, seq, kv_heads, groups, F, m)``: its
        cos rows, then its sin rows."""
        rows = tensor.transpose(1, 2).unflatten(2, (self.kv_heads, self.groups))
        return rows.unflatten(-1, (self.num_freq, 2, self.m)).movedim(-2, 0)

    def empty_features(self) -> torch.Tensor:
        """The interleaved feature rows ``(batch, seq, kv_heads, groups, F, 2, m)``, the kernel's layout."""
        return torch.empty(
            (self.batch, self.seq, self.kv_heads, self.groups, self.num_freq, 2, self.m),
            dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def empty_trig(self) -> torch.Tensor:
        """``(2, batch, seq, kv_heads, groups, F, m)``: a contiguous half per row."""
        shape = (2, self.batch, self.seq, self.kv_heads, self.groups, self.num_freq, self.m)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def trig(self, z: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """``cos(omega z)`` and ``sin(omega z)`` per frequency block, stacked as ``empty_trig``. The phases are
        written into the sin half and turned in place: no buffer of their own."""
        trig = self.empty_trig()
        cosines, sines = trig
        phase = torch.mul(self.z(z), self.frequency(frequency), out=sines)
        torch.cos(phase, out=cosines)
        phase.sin_()
        return trig

    def output(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        width = 2 * self.num_freq * self.m
        return _cast(features.view(self.batch, self.seq, self.heads, width).transpose(1, 2), dtype)

    def unblock(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, kv_heads, groups, m)`` back to ``z``'s ``(batch, heads, seq, m)``."""
        return tensor.reshape(self.batch, self.seq, self.heads, self.m).transpose(1, 2)


# Rows up to this many elements are rotated in one call for both (cos and sin) rows, larger ones a row per call. One
# call halves the per-op cost that dominates small rows (0.5x the time at 65,536 elements a row, 2 threads); on
# larger rows it walks the two rows' halves of memory in alternation and ran up to 1.35x slower than a call per
# row (benchmarks in docs/performance.md, "One rotation call for both rows").
MERGED_ROTATION_MAX_ROW_NUMEL = 65_536


def _rotate_rows_into(out, rows, table_cos, table_sin, rotate_cos_blocks: bool, adjoint: bool) -> None:
    """RoPE (or its adjoint) of ``rows``, ``(2, ...)`` cos rows then sin rows, into ``out`` of the same shape; the sin
    rows only (the cos rows copied) if the cos blocks are not rotated. Both rows in one call when they are small."""
    if rotate_cos_blocks and rows[0].numel() <= MERGED_ROTATION_MAX_ROW_NUMEL:
        _rotate_into(out, rows, table_cos, table_sin, adjoint)
        return
    _rotate_into(out[1], rows[1], table_cos, table_sin, adjoint)
    if rotate_cos_blocks:
        _rotate_into(out[0], rows[0], table_cos, table_sin, adjoint)
    else:
        out[0].copy_(rows[0])


def _features(z, frequency, gain, cos, sin, rotate_cos_blocks: bool) -> torch.Tensor:
    """The forward pass of ``phi`` (no autograd node): see ``qkmap_features``."""
    layout = _Layout(z, frequency, cos)
    trig = layout.trig(z, frequency).mul_(layout.gain_rows(gain))
    features = layout.empty_features()
    _rotate_rows_into(
        features.movedim(-2, 0), trig, layout.table(cos), layout.table(sin), rotate_cos_blocks, adjoint=False
    )
    return layout.output(features, z.dtype)


def _feature_gradients(grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks: bool, needs) -> tuple:
    """Gradients of ``phi`` for ``(z, frequency, gain, cos, sin)``, recomputing cos/sin of the phases from ``z``.

    ``needs`` says which of the five are wanted (``ctx.needs_input_grad`` order); the others come back as None.
    """
    if not any(needs):
        return None, None, None, None, None
    need_z, need_frequency, need_gain, need_cos, need_sin = needs
    layout = _Layout(z, frequency, cos)
    table_cos, table_sin = layout.table(cos), layout.table(sin)
    incoming = layout.rows(grad_output)
    trig = layout.trig(z, frequency)  # recomputed bit for bit as in the forward pass
    gain_rows = layout.gain_rows(gain)
    grad_cos = grad_sin = None
    if need_cos or need_sin:  # out = u cos + rotate_half(u) sin on the rotated rows, u = gain * trig
        rotated = slice(None) if rotate_cos_blocks else slice(1, None)
        features, grad_rotated = (trig * gain_rows)[rotated], incoming[rotated]
        shape = (1, *table_cos.shape)
        if need_cos:
            grad_cos = (grad_rotated * features).sum_to_size(shape).view(cos.shape).to(cos.dtype)
        if need_sin:
            grad_sin = (grad_rotated * rotate_half(features)).sum_to_size(shape).view(sin.shape).to(sin.dtype)
    # Through the rotation (orthogonal and linear): d features = R^T grad, read from sdpa's head-major gradient
    # and written token-major, cos rows and sin rows each into a contiguous half of one buffer.
    grad = layout.empty_trig()
    _rotate_rows_into(grad, incoming, table_cos, table_sin, rotate_cos_blocks, adjoint=True)
    grad_z = grad_frequency = grad_gain = None
    if need_gain:
        # One scratch row for the products that are only summed: a fresh buffer costs a page fault per 4 KiB on first
        # touch, several times the multiply itself (measured: 2.7 ms against 0.16 ms in place).
        scratch = torch.empty_like(trig[0])
        dims = (0, 1, 3)  # what the gains broadcast across: batch, positions, the query heads of a group
        products = [
            torch.mul(row, trig_row, out=scratch).sum(dim=dims) for row, trig_row in zip(grad, trig, strict=True)
        ]
        grad_gain = torch.stack(products, dim=-2).view(gain.shape).to(gain.dtype)
    if need_z or need_frequency:
        # d/dphase of (a cos(phase), b sin(phase)) = (-a sin(phase), b cos(phase)).
        (grad_cos_rows, grad_sin_rows), (cosines, sines) = grad.mul_(gain_rows), trig
        grad_phase = grad_sin_rows.mul_(cosines).addcmul_(grad_cos_rows, sines, value=-1)
        if need_frequency:  # the product is only summed: into the cos rows' half, free by now (no fresh buffer)
            grad_frequency = torch.mul(grad_phase, layout.z(z), out=grad_cos_rows)
            grad_frequency = grad_frequency.sum_to_size(layout.frequency(frequency).shape)
            grad_frequency = grad_frequency.view(frequency.shape).to(frequency.dtype)
        if need_z:
            grad_z = grad_phase.mul_(layout.frequency(frequency))
            grad_z = grad_z.squeeze(-2) if layout.num_freq == 1 else grad_z.sum(dim=-2)
            grad_z = layout.unblock(grad_z).to(z.dtype)
    return grad_z, grad_frequency, grad_gain, grad_cos, grad_sin


def rotate_half(tensor: torch.Tensor, adjoint: bool = False) -> torch.Tensor:
    """Llama's ``rotate_half`` on the last dimension, ``(x1, x2) -> (-x2, x1)``, or its adjoint ``(x2, -x1)``: one
    copy, for the paths that do not rotate in place into strided halves (``_rotate_into``)."""
    first, second = _halves(tensor)
    return torch.cat((second, -first) if adjoint else (-second, first), dim=-1)


def _expression_blocks(z, frequency, gain, cos, sin):
    """The views of ``_Layout`` as plain expressions (no buffers, no ``out=``), for ``torch.compile`` to fuse:
    ``z`` as ``(batch, seq, kv_heads, groups, 1, m)``, omega and the RoPE tables to broadcast against the feature rows
    ``(batch, seq, kv_heads, groups, F, 2, m)``, the gains as those rows."""
    batch, heads, seq, m = z.shape
    kv_heads, num_freq, freq_width = frequency.shape
    dtype = _compute_dtype(z.dtype)
    z_blocks = z.transpose(1, 2).to(dtype).reshape(batch, seq, kv_heads, heads // kv_heads, 1, m)
    omega = frequency.to(dtype).view(1, 1, kv_heads, 1, num_freq, freq_width)
    gains = gain.to(dtype).view(1, 1, kv_heads, 1, num_freq, 2, m)
    table_cos, table_sin = (table.to(dtype).view(table.shape[0], seq, 1, 1, 1, 1, m) for table in (cos, sin))
    return z_blocks, omega, gains, table_cos, table_sin


def _expression_features(z, frequency, gain, cos, sin, rotate_cos_blocks: bool) -> torch.Tensor:
    """``_features`` as one plain expression: the same math, which ``torch.compile`` fuses into a pass or two over
    memory where eager PyTorch makes one per op (``qkmap_compile_feature_map``)."""
    z_blocks, omega, gains, table_cos, table_sin = _expression_blocks(z, frequency, gain, cos, sin)
    phase = z_blocks * omega
    rows = torch.stack((phase.cos(), phase.sin()), dim=-2) * gains
    rotated = rows * table_cos + rotate_half(rows) * table_sin
    if not rotate_cos_blocks:
        rotated = torch.stack((rows[..., 0, :], rotated[..., 1, :]), dim=-2)
    batch, heads, seq, _ = z.shape
    return rotated.reshape(batch, seq, heads, -1).transpose(1, 2).to(z.dtype)


def _expression_gradients(grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks: bool, needs) -> tuple:
    """``_feature_gradients`` for ``z``, omega and the gains as one plain expression (``qkmap_compile_feature_map``);
    ``needs`` as there, its last two (the RoPE tables') False."""
    need_z, need_frequency, need_gain = needs[:3]
    z_blocks, omega, gains, table_cos, table_sin = _expression_blocks(z, frequency, gain, cos, sin)
    batch, heads, seq, m = z.shape
    incoming = grad_output.transpose(1, 2).to(z_blocks.dtype).reshape(*z_blocks.shape[:4], omega.shape[4], 2, m)
    grad_rows = incoming * table_cos + rotate_half(incoming * table_sin, adjoint=True)  # R^T grad
    if not rotate_cos_blocks:
        grad_rows = torch.stack((incoming[..., 0, :], grad_rows[..., 1, :]), dim=-2)
    phase = z_blocks * omega
    cosines, sines = phase.cos(), phase.sin()
    grad_z = grad_frequency = grad_gain = None
    if need_gain:
        products = grad_rows * torch.stack((cosines, sines), dim=-2)
        grad_gain = products.sum(dim=(0, 1, 3)).reshape(gain.shape).to(gain.dtype)
    if need_z or need_frequency:
        grad_trig = grad_rows * gains
        grad_phase = grad_trig[..., 1, :] * cosines - grad_trig[..., 0, :] * sines
        if need_frequency:
            grad_frequency = (grad_phase * z_blocks).sum_to_size(omega.shape).reshape(frequency.shape)
            grad_frequency = grad_frequency.to(frequency.dtype)
        if need_z:
            grad_z = (grad_phase * omega).sum(dim=-2).reshape(batch, seq, heads, m).transpose(1, 2).to(z.dtype)
    return grad_z, grad_frequency, grad_gain, None, None


class CompiledExpression:
    """A plain-expression version of a feature-map pass, compiled with ``torch.compile`` on first use
    (``qkmap_compile_feature_map``): the map's elementwise chain fused into a few passes over memory.

    Where compiling fails (no C++ compiler for inductor on a CPU, a backend that cannot take it), it warns once,
    naming the error, and answers None from then on: the caller runs its eager path, whose values are the same up
    to float rounding. Inside a caller's own ``torch.compile`` it is traced as part of that graph.
    """

    def __init__(self, expression):
        self.expression = expression
        self.compiled = None
        self.failure: str | None = None

    def __call__(self, *args):
        if self.failure is not None:
            return None
        if torch.compiler.is_compiling():
            return self.expression(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.expression, dynamic=None)
        # Detached: the passes run without autograd anyway, and a guard on ``requires_grad`` would compile training's
        # and inference's calls of one shape twice.
        args = tuple(arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args)
        try:
            return self.compiled(*args)
        except Exception as error:  # any backend failure falls back to the eager path
            lines = str(error).strip().splitlines()
            self.failure = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
            warnings.warn(
                f"qkmap_compile_feature_map: torch.compile of {self.expression.__name__} failed ({self.failure}); "
                "the eager feature map runs instead (same values, slower).",
                RuntimeWarning,
                stacklevel=2,
            )
            return None


def _expression_query_key_features(query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks: bool):
    """Both maps of ``QKMapQueryKeyFunction`` in one compiled region: one guard check and call, not two."""
    return (
        _expression_features(query, frequency, query_gain, cos, sin, rotate_cos_blocks),
        _expression_features(key, frequency, key_gain, cos, sin, rotate_cos_blocks),
    )


def _expression_query_key_gradients(
    grad_query, grad_key, query, key, frequency, query_gain, key_gain, cos, sin, rotate, query_needs, key_needs
):
    """``_expression_gradients`` of queries and keys in one compiled region: ``(z_q, z_k, omega, gain_q, gain_k)``."""
    grad_q, frequency_q, gain_q, _, _ = _expression_gradients(
        grad_query, query, frequency, query_gain, cos, sin, rotate, query_needs
    )
    grad_k, frequency_k, gain_k, _, _ = _expression_gradients(
        grad_key, key, frequency, key_gain, cos, sin, rotate, key_needs
    )
    return grad_q, grad_k, _add(frequency_q, frequency_k), gain_q, gain_k


COMPILED_FEATURES = CompiledExpression(_expression_features)
COMPILED_GRADIENTS = CompiledExpression(_expression_gradients)
COMPILED_QUERY_KEY_FEATURES = CompiledExpression(_expression_query_key_features)
COMPILED_QUERY_KEY_GRADIENTS = CompiledExpression(_expression_query_key_gradients)


def _runs_compiled(compiled: bool, z: torch.Tensor) -> bool:
    """Whether a call tries the compiled expressions: asked for, and more than one position (one token is
    dispatch-bound either way, and a compile per decoding shape would not pay)."""
    return compiled and z.shape[-2] > 1


# The fused CPU kernel (qkmap_hf/kernels/feature_map_cpu.cpp): the map in one pass over memory each way. These files
# import only torch, so they look its ops up in ``torch.ops``; ``import qkmap_hf`` registers them where this machine
# has built them (``qkmap kernels``). The name carries the ops' version: a checkpoint's copy of this file calls only
# the ops it was written for, and runs the eager map where they are missing.
FUSED_NAMESPACE = "qkmap_v1"
# Dtypes of ``z`` the fused kernel takes (it computes in float32, as the eager map does for these); float64 stays eager.
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedOps:
    """``torch.ops.qkmap_v1`` where the ops ``names`` are registered, else None. Looked up again only when a library
    has been loaded since the last call (``torch.ops.loaded_libraries``): a failed lookup costs a registry search
    each time."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.libraries_seen = -1
        self.ops = None

    def __call__(self):
        libraries = len(torch.ops.loaded_libraries)
        if libraries != self.libraries_seen:
            namespace = getattr(torch.ops, FUSED_NAMESPACE)
            found = all(hasattr(namespace, name) for name in self.names)
            self.ops, self.libraries_seen = (namespace if found else None), libraries
        return self.ops


FUSED_OPS = FusedOps(("features", "feature_gradients"))


def _runs_fused(fused: bool, z: torch.Tensor) -> bool:
    """Whether a call runs the fused kernel: asked for, a CPU tensor of a dtype it takes, not inside
    ``torch.compile`` (which traces the plain expressions instead), and its ops registered."""
    return (
        fused
        and z.device.type == "cpu"
        and z.dtype in FUSED_DTYPES
        and not torch.compiler.is_compiling()
        and FUSED_OPS() is not None
    )


def _fused_features(z, frequency, gain, cos, sin, rotate_cos_blocks: bool) -> torch.Tensor:
    """``_features`` by the fused kernel: ``(batch, heads, seq, 2F*m)`` in ``z.dtype``, a view of a token-major buffer
    as the eager map's output is."""
    f32 = torch.float32
    inputs = (_cast(tensor, f32) for tensor in (z, frequency, gain, cos, sin))
    return _cast(FUSED_OPS().features(*inputs, rotate_cos_blocks), z.dtype)


def _fused_gradients(grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks: bool, needs) -> tuple:
    """``_feature_gradients`` for ``z``, omega and the gains by the fused kernel; ``needs`` as there, the RoPE
    tables' gradients (its last two) not asked for."""
    f32 = torch.float32
    inputs = (_cast(tensor, f32) for tensor in (grad_output, z, frequency, gain, cos, sin))
    grads = FUSED_OPS().feature_gradients(*inputs, rotate_cos_blocks)
    return (
        *(
            _cast(grad, like.dtype) if need else None
            for grad, like, need in zip(grads, (z, frequency, gain), needs, strict=True)
        ),
        None,
        None,
    )


def _map_features(z, frequency, gain, cos, sin, rotate_cos_blocks: bool, compiled: bool, fused: bool) -> torch.Tensor:
    """The forward pass of ``phi``: the fused kernel where it runs, else the compiled expression when asked for and it
    runs, else the eager ``_features``."""
    if _runs_fused(fused, z):
        return _fused_features(z, frequency, gain, cos, sin, rotate_cos_blocks)
    if _runs_compiled(compiled, z):
        features = COMPILED_FEATURES(z, frequency, gain, cos, sin, rotate_cos_blocks)
        if features is not None:
            return features
    return _features(z, frequency, gain, cos, sin, rotate_cos_blocks)


def _map_gradients(
    grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks: bool, needs, compiled: bool, fused: bool
) -> tuple:
    """``_feature_gradients``, from the fused kernel or the compiled expression (in that order, where they run) when
    the RoPE tables need no gradient."""
    if any(needs[:3]) and not any(needs[3:]) and _runs_fused(fused, z):
        return _fused_gradients(grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks, needs[:3])
    if any(needs[:3]) and not any(needs[3:]) and _runs_compiled(compiled, z):
        grads = COMPILED_GRADIENTS(grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks, tuple(needs[:3]))
        if grads is not None:
            return grads
    return _feature_gradients(grad_output, z, frequency, gain, cos, sin, rotate_cos_blocks, needs)


def _add(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    return second if first is None else first if second is None else first + second


# The autograd Functions below take ``ctx`` in ``forward`` (no ``setup_context``): with a ``setup_context``,
# ``Function.apply`` binds its arguments through ``inspect.signature`` on every call, ~50 us each here against ~12 us for
# the whole call without it, paid per layer and training step (those Functions would also run under functorch's
# transforms, which nothing here uses).


class QKMapFeatureFunction(torch.autograd.Function):
    """``phi`` with a recomputing backward pass: saves ``z``, ``omega``, gains and the RoPE tables only.

    ``compiled``: both passes run the compiled expressions (``qkmap_compile_feature_map``); ``fused``: the fused CPU
    kernel where it runs (``qkmap_fused_feature_map``)."""

    @staticmethod
    def forward(ctx, z, frequency, gain, cos, sin, rotate_cos_blocks: bool, compiled: bool, fused: bool):
        ctx.save_for_backward(z, frequency, gain, cos, sin)
        ctx.rotate_cos_blocks, ctx.compiled, ctx.fused = rotate_cos_blocks, compiled, fused
        return _map_features(z, frequency, gain, cos, sin, rotate_cos_blocks, compiled, fused)

    @staticmethod
    def backward(ctx, grad_output):
        needs = ctx.needs_input_grad[:5]
        grads = _map_gradients(grad_output, *ctx.saved_tensors, ctx.rotate_cos_blocks, needs, ctx.compiled, ctx.fused)
        return *grads, None, None, None


class QKMapQueryKeyFunction(torch.autograd.Function):
    """``phi`` of queries and keys in one node: ``omega`` and the RoPE tables, which both share, saved once.

    Two ``QKMapFeatureFunction`` nodes would each keep a reference to the ``(seq, m)`` cos and sin tables; in the
    count of saved activation bytes per layer those are as large as a fifth of one ``z`` at ``m = 64``.
    """

    @staticmethod
    def forward(
        ctx, query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks: bool, compiled: bool, fused: bool
    ):
        ctx.save_for_backward(query, key, frequency, query_gain, key_gain, cos, sin)
        ctx.rotate_cos_blocks, ctx.compiled, ctx.fused = rotate_cos_blocks, compiled, fused
        return _query_key_features(
            query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks, compiled, fused
        )

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        grads = _query_key_gradients(
            grad_query, grad_key, *ctx.saved_tensors, ctx.rotate_cos_blocks, ctx.needs_input_grad, ctx.compiled,
            ctx.fused,
        )  # fmt: skip
        return *grads, None, None, None


def _query_key_features(
    query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks: bool, compiled: bool, fused: bool
):
    """The forward pass of ``QKMapQueryKeyFunction`` (no autograd node): both maps, fused or compiled where asked for."""
    if _runs_fused(fused, query):
        return (
            _fused_features(query, frequency, query_gain, cos, sin, rotate_cos_blocks),
            _fused_features(key, frequency, key_gain, cos, sin, rotate_cos_blocks),
        )
    if _runs_compiled(compiled, query):
        features = COMPILED_QUERY_KEY_FEATURES(query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks)
        if features is not None:
            return features
    return (
        _features(query, frequency, query_gain, cos, sin, rotate_cos_blocks),
        _features(key, frequency, key_gain, cos, sin, rotate_cos_blocks),
    )


def _query_key_gradients(
    grad_query, grad_key, query, key, frequency, query_gain, key_gain, cos, sin, rotate, needs, compiled: bool,
    fused: bool,
):  # fmt: skip
    """Gradients of ``QKMapQueryKeyFunction`` for its seven tensor inputs; ``needs`` in that order."""
    need_q, need_k, need_frequency, need_q_gain, need_k_gain, need_cos, need_sin = needs[:7]
    query_needs = (need_q, need_frequency, need_q_gain, need_cos, need_sin)
    key_needs = (need_k, need_frequency, need_k_gain, need_cos, need_sin)
    compiles = _runs_compiled(compiled, query) and not _runs_fused(fused, query)
    if not (need_cos or need_sin) and any(query_needs) and any(key_needs) and compiles:
        grads = COMPILED_QUERY_KEY_GRADIENTS(
            grad_query, grad_key, query, key, frequency, query_gain, key_gain, cos, sin, rotate, query_needs[:3],
            key_needs[:3],
        )  # fmt: skip
        if grads is not None:
            return *grads, None, None
    grad_q, freq_q, gain_q, cos_q, sin_q = _map_gradients(
        grad_query, query, frequency, query_gain, cos, sin, rotate, query_needs, compiled, fused
    )
    grad_k, freq_k, gain_k, cos_k, sin_k = _map_gradients(
        grad_key, key, frequency, key_gain, cos, sin, rotate, key_needs, compiled, fused
    )
    return grad_q, grad_k, _add(freq_q, freq_k), gain_q, gain_k, _add(cos_q, cos_k), _add(sin_q, sin_k)


def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    """A query or key projection as ``QKMapAttention`` computes it: ``(batch, heads, seq, width)``, a transposed view
    of the token-major ``linear`` output."""
    return torch.nn.functional.linear(hidden, weight, bias).view(*hidden.shape[:-1], -1, width).transpose(1, 2)


def _projection_gradients(grad_z, hidden, weight, needs) -> tuple:
    """Gradients of ``_project`` for ``(hidden, weight, bias)`` from the gradient of its ``(batch, heads, seq, width)``
    output; ``needs`` says which (the others come back as None)."""
    need_hidden, need_weight, need_bias = needs
    if grad_z is None:
        return None, None, None
    grad_out = grad_z.transpose(1, 2).reshape(*hidden.shape[:-1], weight.shape[0])  # a view: token-major already
    rows, inputs = grad_out.reshape(-1, weight.shape[0]), hidden.reshape(-1, hidden.shape[-1])
    grad_hidden = grad_out.matmul(weight) if need_hidden else None
    grad_weight = rows.t().mm(inputs) if need_weight else None
    grad_bias = rows.sum(dim=0) if need_bias else None
    return grad_hidden, grad_weight, grad_bias


class QKMapProjectedQueryKeyFunction(torch.autograd.Function):
    """``q_proj``, ``k_proj`` and ``phi`` of both in one node that keeps the layer input, not the projections.

    ``QKMapQueryKeyFunction`` keeps the projected queries and keys ``z`` for its backward pass: in the wide layout
    they are most of the saved bytes above what the kernel needs (docs/performance.md). This node recomputes them
    in the backward pass from the layer input, which the value projection keeps anyway, at the cost of the two
    projections' forward matmuls once more (``qkmap_recompute_projections``). Values are the unfused path's bit
    for bit; gradients up to the order of float sums.
    """

    @staticmethod
    def forward(ctx, hidden, query_weight, query_bias, key_weight, key_bias, frequency, query_gain, key_gain, cos, sin,
                width: int, rotate_cos_blocks: bool, compiled: bool, fused: bool):  # fmt: skip
        ctx.save_for_backward(
            hidden, query_weight, query_bias, key_weight, key_bias, frequency, query_gain, key_gain, cos, sin
        )
        ctx.width, ctx.rotate_cos_blocks, ctx.compiled, ctx.fused = width, rotate_cos_blocks, compiled, fused
        query = _project(hidden, query_weight, query_bias, width)
        key = _project(hidden, key_weight, key_bias, width)
        return _query_key_features(
            query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks, compiled, fused
        )

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        hidden, query_weight, query_bias, key_weight, key_bias, *shared = ctx.saved_tensors
        needs = ctx.needs_input_grad
        need_query, need_key = any(needs[0:3]), needs[0] or any(needs[3:5])
        need_frequency, need_q_gain, need_k_gain, need_cos, need_sin = needs[5:10]
        both = need_frequency or need_cos or need_sin  # gradients both sides' maps contribute to
        query = _project(hidden, query_weight, query_bias, ctx.width) if need_query or need_q_gain or both else None
        key = _project(hidden, key_weight, key_bias, ctx.width) if need_key or need_k_gain or both else None
        grad_q, grad_k, *grads = _query_key_gradients(
            grad_query, grad_key, query, key, *shared, ctx.rotate_cos_blocks, (need_query, need_key, *needs[5:10]),
            ctx.compiled, ctx.fused,
        )  # fmt: skip
        hidden_q, *query_grads = _projection_gradients(grad_q, hidden, query_weight, (needs[0], *needs[1:3]))
        hidden_k, *key_grads = _projection_gradients(grad_k, hidden, key_weight, (needs[0], *needs[3:5]))
        return _add(hidden_q, hidden_k), *query_grads, *key_grads, *grads, None, None, None, None


def qkmap_features(
    z: torch.Tensor,
    frequency: torch.Tensor,
    gain: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate_cos_blocks: bool = True,
    compiled: bool = False,
    fused: bool = True,
) -> torch.Tensor:
    """Map projected queries or keys to RoPE-rotated periodic features, ``phi`` of docs/method.md.

    Args:
        z: ``(batch, heads, seq, m)`` projections; ``heads`` is a multiple of the key/value heads.
        frequency: ``(kv_heads, F, m)`` or ``(kv_heads, F, 1)`` positive frequencies ``omega``.
        gain: ``(kv_heads, 2F, m)`` effective gains, rows ordered ``cos_0, sin_0, cos_1, ...``.
        cos, sin: ``(batch or 1, seq, m)`` RoPE tables for dimension ``m``.
        rotate_cos_blocks: rotate the cos blocks with RoPE like the sin blocks (False: cos blocks unrotated).
        compiled: run the map as ``torch.compile``-fused expressions (``qkmap_compile_feature_map``; ``CompiledExpression``).
        fused: run the fused CPU kernel where it is loaded and takes the input (``qkmap_fused_feature_map``;
            ``FUSED_OPS``); it comes before ``compiled``.

    Returns ``(batch, heads, seq, 2F*m)`` in ``z.dtype``. Phases, cos/sin and the rotation run in float32
    (float64 inputs stay float64); one broadcasted expression, no loop over blocks. When gradients are needed
    the recomputing ``QKMapFeatureFunction`` runs; without them its forward runs alone (no autograd node).
    """
    inputs = (z, frequency, gain, cos, sin)
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs):
        return QKMapFeatureFunction.apply(*inputs, rotate_cos_blocks, compiled, fused)
    return _map_features(*inputs, rotate_cos_blocks, compiled, fused)


def qkmap_query_key_features(
    query: torch.Tensor,
    key: torch.Tensor,
    frequency: torch.Tensor,
    query_gain: torch.Tensor,
    key_gain: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate_cos_blocks: bool = True,
    compiled: bool = False,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qkmap_features(query, ...), qkmap_features(key, ...))`` with one autograd node for both.

    Queries and keys share ``omega`` and the RoPE tables; one ``QKMapQueryKeyFunction`` saves them once.
    """
    inputs = (query, key, frequency, query_gain, key_gain, cos, sin)
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs):
        return QKMapQueryKeyFunction.apply(*inputs, rotate_cos_blocks, compiled, fused)
    if query.shape[-2] == 1:
        groups = query.shape[1] // key.shape[1]
        stacked = stack_query_key_parameters(frequency, query_gain, key_gain, groups)
        return one_token_query_key_features(query, key, *stacked, cos, sin, rotate_cos_blocks, fused)
    return _query_key_features(*inputs, rotate_cos_blocks, compiled, fused)


def qkmap_projected_query_key_features(
    hidden: torch.Tensor,
    query_weight: torch.Tensor,
    query_bias: torch.Tensor | None,
    key_weight: torch.Tensor,
    key_bias: torch.Tensor | None,
    frequency: torch.Tensor,
    query_gain: torch.Tensor,
    key_gain: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate_cos_blocks: bool = True,
    compiled: bool = False,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qkmap_query_key_features`` of ``hidden``'s query and key projections (``linear(hidden, weight, bias)``
    viewed as ``(batch, heads, seq, m)``), in one node that recomputes the projections in the backward pass instead
    of keeping them (``QKMapProjectedQueryKeyFunction``). ``hidden`` is ``(batch, seq, hidden_size)``."""
    width = query_gain.shape[-1]
    return QKMapProjectedQueryKeyFunction.apply(
        hidden, query_weight, query_bias, key_weight, key_bias, frequency, query_gain, key_gain, cos, sin, width,
        rotate_cos_blocks, compiled, fused,
    )  # fmt: skip


def stack_query_key_parameters(
    frequency: torch.Tensor, query_gain: torch.Tensor, key_gain: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frequency rows ``(heads, F, m or 1)`` and gain rows ``(heads, F, 2, m)`` per head, the query heads' (each
    repeating its key head's) then the key heads', for ``one_token_query_key_features``. They change only with the
    parameters: a decoding model can keep them between tokens (``QKMapFeatureMap.decoding_parameters``)."""
    query_frequency = frequency
    if groups > 1:
        query_frequency = frequency.repeat_interleave(groups, dim=0)
        query_gain = query_gain.repeat_interleave(groups, dim=0)
    gain = torch.cat((query_gain, key_gain))
    return torch.cat((query_frequency, frequency)), gain.view(gain.shape[0], -1, 2, gain.shape[-1])


def one_token_query_key_features(
    query: torch.Tensor,
    key: torch.Tensor,
    stacked_frequency: torch.Tensor,
    stacked_gain: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate_cos_blocks: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding (one token, no gradients): queries and keys as the heads of one call.

    At one token the map is a few small ops whose cost is the per-op dispatch, not arithmetic: one call for both
    halves it (measured ~0.6x the time of two calls). Every head gets its own frequency and gain rows
    (``stack_query_key_parameters``), so each query and key is mapped exactly as by two separate calls.
    """
    heads = query.shape[1]
    z = torch.cat((query, key), dim=1)
    if _runs_fused(fused, z):  # the stacked rows are the kernel's per-head rows (one head per row of frequencies)
        features = _fused_features(z, stacked_frequency, stacked_gain.flatten(1, 2), cos, sin, rotate_cos_blocks)
    else:
        features = _one_token_features(z, stacked_frequency, stacked_gain, cos, sin, rotate_cos_blocks)
    return features.split((heads, key.shape[1]), dim=1)


def _one_token_features(z, frequency, gain, cos, sin, rotate_cos_blocks: bool) -> torch.Tensor:
    """``_features`` in as few ops as it takes, for one token, where each op's dispatch costs more than its
    arithmetic: ~15 per layer, about as many as Llama's RoPE of a query and a key.

    ``z`` is ``(batch, heads, 1, m)``: the length-1 sequence axis broadcasts against ``omega``'s ``F`` axis, so no
    view reshapes it. cos and sin of the phases are stacked into one ``(batch, heads, F, 2, m)`` tensor, so one
    multiply applies both gains (``gain`` as ``(heads, F, 2, m)``), and the rotation turns whole rows at once:
    ``x * cos + roll(x, m/2) * sin`` with the rolled first half negated, which is ``rotate_half(x) * sin``. Every
    element sees the same operations as in ``_features`` (a sign flip is exact), so the bits are the same (tested);
    at many tokens ``_Layout``'s halves written in place are faster.
    """
    batch, heads, _, m = z.shape
    dtype = _compute_dtype(z.dtype)
    phase = _cast(z, dtype) * _cast(frequency, dtype)
    trig = torch.stack((phase.cos(), phase.sin_()), dim=-2).mul_(_cast(gain, dtype))
    table_shape = (cos.shape[0], 1, 1, 1, m)
    rolled = trig.roll(m // 2, dims=-1)
    rolled.narrow(-1, 0, m // 2).neg_()
    features = torch.mul(trig, _cast(cos, dtype).view(table_shape))
    features.addcmul_(rolled, _cast(sin, dtype).view(table_shape))
    if not rotate_cos_blocks:
        features.select(-2, 0).copy_(trig.select(-2, 0))
    return _cast(features.view(batch, heads, 1, -1), z.dtype)
