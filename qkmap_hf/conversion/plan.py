"""The plan: every output tensor with its shape, dtype, shard and origin, checked against the QK-MAP model.

The adapter says which outputs each source tensor feeds (``tensor_outputs``); the plan places each output
in the shard of its first source (created tensors join their layer's attention), adds the tensors the query/key
constructions create (``QueryKeyConstruction.created_tensors``: the qk_map parameters, an input norm's reference
scale) where the source has none, and refuses names, shapes or gaps the model would not load. ``convert_checkpoint`` and
``convert_model`` share it, so disk and memory can never disagree about a tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..modeling.configuration_qkmap import QKMapConfig
from ..modeling.qk_registry import constructions_for
from .adapters import ArchitectureAdapter, OutputTensor
from .errors import ConversionError
from .sources import FileSpan, ShardReader, TensorSource


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: tuple[str, ...] = ()  # source tensor names; empty for tensors the conversion creates
    compute: Callable[..., torch.Tensor] | None = None  # None: the single source, cast to ``dtype``
    unchanged: bool = False  # the output bytes are the source's bytes (same dtype, no compute)

    @property
    def source(self) -> str | None:
        """The single source tensor, if there is exactly one."""
        return self.sources[0] if len(self.sources) == 1 else None


@dataclasses.dataclass
class ConversionPlan:
    adapter: ArchitectureAdapter
    config: QKMapConfig
    shards: list[tuple[str, list[PlannedTensor]]]
    sharded: bool
    dtype: torch.dtype  # dtype of the converted weights (a construction's float32 modules stay float32)

    @property
    def num_tensors(self) -> int:
        return sum(len(tensors) for _, tensors in self.shards)

    def materialize(self, planned: PlannedTensor, read: ShardReader) -> torch.Tensor | FileSpan:
        """One output tensor: read (or create), compute, check, cast; math stays in the source precision.

        An unchanged tensor in a file comes back as its ``FileSpan``: the writer copies the bytes as they are.
        """
        if planned.unchanged:
            span = read.span(planned.sources[0])
            if span is not None:
                return span
        inputs = [read(name) for name in planned.sources]
        tensor = planned.compute(*inputs) if planned.compute is not None else inputs[0]
        if tuple(tensor.shape) != planned.shape:
            raise ConversionError(
                f"tensor {planned.name!r} has shape {tuple(tensor.shape)} but the QK-MAP model expects {planned.shape}."
            )
        return tensor.to(planned.dtype)


def expected_parameters(config: QKMapConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes a QK-MAP model with ``config`` loads (built on the meta device: no memory)."""
    from ..modeling.modeling_qkmap import QKMapForCausalLM

    with torch.device("meta"):
        model = QKMapForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def construction_tensors(config: QKMapConfig) -> list[OutputTensor]:
    """The tensors the query/key constructions create in every layer, at the values a fresh model starts from."""
    outputs = []
    for construction in constructions_for(config):
        for name, value in construction.created_tensors(config).items():
            outputs += [
                OutputTensor(f"model.layers.{layer}.self_attn.{name}", compute=value.clone)
                for layer in range(config.num_hidden_layers)
            ]
    return outputs


def float32_prefixes(config: QKMapConfig) -> tuple[str, ...]:
    """Name fragments of the modules kept in float32 (``_keep_in_fp32_modules``: phases and gains)."""
    return tuple(f".self_attn.{name}." for c in constructions_for(config) for name in c.float32_modules)


def plan_conversion(
    source: TensorSource, adapter: ArchitectureAdapter, config: QKMapConfig, dtype: torch.dtype | None
) -> ConversionPlan:
    """Map every source tensor to its outputs, add the qk_map parameters, and check the result against the model."""
    expected = expected_parameters(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    out_dtype = dtype or source.dominant_dtype()
    infos = {name: info for _, shard_infos in source.shards for name, info in shard_infos.items()}

    float32 = float32_prefixes(config)

    def kept_in_float32(name: str) -> bool:
        return any(fragment in name for fragment in float32)

    def output_dtype(name: str, source_dtype: torch.dtype) -> torch.dtype:
        if kept_in_float32(name):
            return torch.float32  # _keep_in_fp32_modules: phases and gains stay float32
        return out_dtype if (dtype is not None and source_dtype.is_floating_point) else source_dtype

    shards: list[tuple[str, list[PlannedTensor]]] = []
    produced: dict[str, OutputTensor] = {}
    for shard, shard_infos in source.shards:
        planned = []
        where = f"{source.where}/{shard}"
        for source_name, info in shard_infos.items():
            adapter.check_tensor_name(source_name, where)
            for output in adapter.tensor_outputs(source_name, config):
                if output.name in produced:
                    if produced[output.name].sources == output.sources and output.sources:
                        continue  # a merge, yielded again by another of its sources
                    raise ConversionError(f"{where}: tensor {output.name!r} is produced twice ({source_name!r}).")
                if output.name not in expected:
                    raise ConversionError(
                        f"{where}: tensor {source_name!r} has no place in the converted model (a "
                        f"{adapter.architecture} with this config has no parameter {output.name!r}). The checkpoint "
                        f"does not match its config.json or is not a plain {adapter.architecture}."
                    )
                unknown = [name for name in output.sources if name not in infos]
                if unknown:
                    raise ConversionError(f"{where}: {output.name!r} needs {unknown}, which the checkpoint lacks.")
                first = infos[output.sources[0]] if output.sources else info
                unchanged = output.compute is None and len(output.sources) == 1
                if unchanged and first.shape != expected[output.name]:
                    raise ConversionError(
                        f"{where}: tensor {source_name!r} has shape {first.shape}, but config.json (hidden_size, "
                        f"num_attention_heads, num_key_value_heads, head_dim, ...) implies {expected[output.name]}."
                    )
                target_dtype = output_dtype(output.name, first.dtype)
                produced[output.name] = output
                planned.append(
                    PlannedTensor(
                        output.name,
                        expected[output.name],
                        target_dtype,
                        output.sources,
                        output.compute,
                        unchanged=unchanged and target_dtype == first.dtype,
                    )
                )
        shards.append((shard, planned))

    created = [output for output in construction_tensors(config) if output.name not in produced]
    created += [output for output in adapter.created_tensors(config) if output.name not in produced]
    for output in created:
        if output.name not in expected:
            raise ConversionError(f"internal: {output.name!r} is not a parameter of the QK-MAP model.")
        layer_prefix = output.name.rsplit(".", 2)[0] + "."
        target = next((i for i, (_, ts) in enumerate(shards) if any(t.name.startswith(layer_prefix) for t in ts)), -1)
        created_dtype = torch.float32 if kept_in_float32(output.name) else out_dtype
        shards[target][1].append(PlannedTensor(output.name, expected[output.name], created_dtype, (), output.compute))
        produced[output.name] = output

    missing = [name for name in expected if name not in produced and name not in optional]
    if missing:
        raise ConversionError(
            f"{source.where}: {len(missing)} tensor(s) the model needs are missing from the checkpoint, e.g. "
            f"{', '.join(missing[:4])}. The checkpoint is incomplete or does not match config.json."
        )
    return ConversionPlan(adapter, config, shards, source.sharded, out_dtype)


__all__ = ["ConversionPlan", "construction_tensors", "PlannedTensor", "expected_parameters", "plan_conversion"]
