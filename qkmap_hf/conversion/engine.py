"""The one streaming conversion engine: Llama-style checkpoint in, QK-MAP checkpoint out.

Memory stays near one source shard whatever the model size: the source index and shard headers are read
first (``safe_open`` reads headers only), then shards are opened one at a time and every output tensor is
read, transformed and written straight into its output shard with a streaming safetensors writer (the
header is known up front, so no output shard is ever held in memory). Output goes to a hidden temporary
folder beside DST that is renamed into place only when complete; SRC is only ever read.

The same plan (``plan_conversion``) serves ``convert_checkpoint`` (disk to disk) and ``convert_model``
(in memory), so the two can never disagree about a tensor.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..modeling.configuration_qkmap import QKMapConfig
from ..safety import check_overwrite_target
from .adapters import ArchitectureAdapter, ConversionError, adapter_for, supported_architectures

INITS = ("exact", "canonical")
DEFAULT_OMEGA0 = 1e-3
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # in-memory sources (GGUF, convert_model) shard like save_pretrained

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PROVENANCE_NAME = "qkmap_conversion.json"
VERIFICATION_NAME = "verification.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
QKMAP_PARAMETERS = ("log_frequency", "query_gain", "key_gain")

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------------
# Options and config
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """What the user chose; validated once so every entry point refuses the same bad values."""

    init: str = "exact"
    num_frequencies: int = 1
    omega0: float = DEFAULT_OMEGA0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        init = "canonical" if self.init == "native" else self.init
        object.__setattr__(self, "init", init)
        if init not in INITS:
            raise ConversionError(f"init={self.init!r} is invalid; choose one of: {', '.join(INITS)}.")
        if (
            isinstance(self.num_frequencies, bool)
            or not isinstance(self.num_frequencies, int)
            or self.num_frequencies < 1
        ):
            raise ConversionError(f"num_frequencies={self.num_frequencies!r} is invalid; it must be an integer >= 1.")
        if not (isinstance(self.omega0, (int, float)) and math.isfinite(self.omega0) and self.omega0 > 0):
            raise ConversionError(f"omega0={self.omega0!r} is invalid; it must be a positive number (default 1e-3).")
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPE_NAMES:
                raise ConversionError(f"dtype={self.dtype!r} is invalid; choose one of: {', '.join(DTYPE_NAMES)}.")
            object.__setattr__(self, "dtype", DTYPE_NAMES[self.dtype])


_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_source_config(config: dict[str, Any], where: str) -> None:
    """Name the field when a source config cannot describe a convertible model."""
    for field in _REQUIRED_FIELDS:
        value = config.get(field)
        if value is None:
            raise ConversionError(f"{where}: field {field!r} is missing; a Llama-style config.json needs it.")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConversionError(f"{where}: field {field}={value!r} must be a positive integer.")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads != 0:
        raise ConversionError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}; every key/value "
            "head must serve the same number of query heads (GQA). The config.json is inconsistent with the weights."
        )
    if config.get("head_dim") is None and config["hidden_size"] % heads != 0:
        raise ConversionError(
            f"{where}: hidden_size={config['hidden_size']} is not divisible by num_attention_heads={heads} and no "
            "head_dim is given; the head width is undefined."
        )


def build_qkmap_config(
    source_config: dict[str, Any], adapter: ArchitectureAdapter, options: ConversionOptions, where: str
) -> QKMapConfig:
    """The QK-MAP config of the converted model: the source's Llama fields plus the qk_map initialisation."""
    fields = adapter.config_fields(source_config)
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(
        qk_mode="qk_map",
        qkmap_input_dim=head_dim,
        qkmap_num_frequencies=options.num_frequencies,
        architectures=["QKMapForCausalLM"],
    )
    if options.init == "exact":
        # a_sin sin(omega z) with a_sin = 1/omega is z to O((omega z)^2): the source attention in disguise.
        fields.update(
            qkmap_init="exact",
            qkmap_exact_frequency=float(options.omega0),
            qkmap_gain_parametrization="inverse_frequency",
            qkmap_logit_scale=head_dim**-0.5,
        )
    else:
        fields.update(qkmap_init="native")
    try:
        config = QKMapConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{where}: the converted config is invalid: {error}") from error
    return config


def normalized_source_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The source config with its class defaults filled in (e.g. Mistral's sliding_window, Qwen2's bos/eos),
    through transformers' own config class, so the converted model sees what the source model saw."""
    from transformers import AutoConfig

    check_source_config(raw, where)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConversionError(f"{where}: field 'model_type' is missing.")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except Exception as error:  # unknown model type, or transformers' own strict validation
        raise ConversionError(f"{where}: transformers cannot read this {model_type!r} config: {error}") from error
    normalized = config.to_dict()
    normalized["architectures"] = raw.get("architectures")
    return normalized


def read_source_config(directory: Path) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint folder (normalized later, once the architecture is known)."""
    path = directory / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"{path}: config.json is missing; a Hugging Face checkpoint folder needs it to describe the model. "
            "For a GGUF file pass --gguf-file NAME (gguf_file=...)."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: not readable JSON ({error}).") from error
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: expected a JSON object.")
    return raw


def source_architecture(config: dict[str, Any]) -> str | None:
    architectures = config.get("architectures") or []
    return architectures[0] if architectures else None


# --------------------------------------------------------------------------------------------------
# Tensor sources: where tensors come from, in shards opened one at a time
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorSource:
    """Source tensors grouped in shards; ``open(shard)`` yields a reader valid while the shard is open."""

    where: str
    sharded: bool
    shards: list[tuple[str, dict[str, TensorInfo]]]

    def open(self, shard: str) -> contextlib.AbstractContextManager[Callable[[str], torch.Tensor]]:
        raise NotImplementedError

    def dominant_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the bytes (the default output dtype)."""
        sizes: dict[torch.dtype, int] = {}
        for _, infos in self.shards:
            for info in infos.values():
                if info.dtype.is_floating_point:
                    sizes[info.dtype] = sizes.get(info.dtype, 0) + math.prod(info.shape)
        return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


class SafetensorsSource(TensorSource):
    """A folder with ``model.safetensors`` or ``model.safetensors.index.json`` plus shards (headers checked up front)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.where = str(directory)
        index_path = directory / INDEX_NAME
        if index_path.is_file():
            files, weight_map = self._read_index(index_path)
            self.sharded = True
        elif (directory / SINGLE_NAME).is_file():
            files, weight_map = [SINGLE_NAME], None
            self.sharded = False
        else:
            refuse_pickle_only(directory)
            found = sorted(p.name for p in directory.glob("*.safetensors"))
            hint = (
                f" (found {', '.join(found)}, but without {INDEX_NAME} they are not a transformers checkpoint)"
                if found
                else ""
            )
            raise ConversionError(f"{directory}: no {SINGLE_NAME} or {INDEX_NAME}{hint}.")
        self.shards = []
        owner: dict[str, str] = {}
        for file in files:
            infos = read_safetensors_header(directory / file)
            for name in infos:
                if name in owner:
                    raise ConversionError(f"{directory / file}: tensor {name!r} also appears in {owner[name]}.")
                owner[name] = file
            self.shards.append((file, infos))
        if weight_map is not None:
            for name, file in weight_map.items():
                if owner.get(name) != file:
                    raise ConversionError(
                        f"{index_path}: weight_map places {name!r} in {file}, but that shard does not contain it; the "
                        "index and the shards do not belong together."
                    )

    @staticmethod
    def _read_index(index_path: Path) -> tuple[list[str], dict[str, str]]:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise TypeError("weight_map is empty or not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConversionError(f"{index_path}: not a valid safetensors index ({error!r}).") from error
        files = list(dict.fromkeys(sorted(weight_map.values())))
        missing = [f for f in files if not (index_path.parent / f).is_file()]
        if missing:
            raise ConversionError(
                f"{index_path}: shard(s) {', '.join(missing)} listed in the index are missing from "
                f"{index_path.parent}; the download is incomplete."
            )
        return files, weight_map

    @contextlib.contextmanager
    def open(self, shard: str) -> Iterator[Callable[[str], torch.Tensor]]:
        from safetensors import safe_open

        path = self.directory / shard
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise ConversionError(f"{path}: cannot open ({error}); the file is damaged or was replaced.") from error

        def read(name: str) -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as error:
                raise ConversionError(
                    f"{path}: reading tensor {name!r} failed ({error}); the file is damaged."
                ) from error

        with handle:  # unmaps the shard when done: only one shard is mapped at a time
            yield read


class StateDictSource(TensorSource):
    """Tensors already in memory (a GGUF loaded by transformers, or a model passed to ``convert_model``)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], where: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in state_dict.items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if tensor.numel() and key in seen:  # tied weights: saved once, as save_pretrained does
                continue
            seen.add(key)
            self.tensors[name] = tensor
        groups: list[dict[str, TensorInfo]] = [{}]
        size = 0
        for name, tensor in self.tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = TensorInfo(tuple(tensor.shape), tensor.dtype)
            size += nbytes
        self.sharded = len(groups) > 1
        if self.sharded:
            self.shards = [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]
        else:
            self.shards = [(SINGLE_NAME, groups[0])]

    @contextlib.contextmanager
    def open(self, shard: str) -> Iterator[Callable[[str], torch.Tensor]]:
        yield self.tensors.__getitem__


def refuse_pickle_only(directory: Path) -> None:
    """Pickle checkpoints can run arbitrary code when loaded: explain and refuse, never unpickle."""
    pickles = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ConversionError(
            f"{directory}: only pickle checkpoint files found ({', '.join(pickles[:4])}). Pickle files can execute "
            "arbitrary code when loaded, so qkmap convert never opens them; it reads safetensors and GGUF only. Use "
            "the safetensors release of the model, or convert the file yourself in a sandbox you trust "
            "(model.save_pretrained(dir) writes safetensors)."
        )


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of one shard (header only; the data stays on disk)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            infos = {}
            for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                view = handle.get_slice(name)
                dtype_name = view.get_dtype()
                if dtype_name not in TORCH_DTYPES:
                    raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name}.")
                infos[name] = TensorInfo(tuple(view.get_shape()), TORCH_DTYPES[dtype_name])
            return infos
    except ConversionError:
        raise
    except Exception as error:  # SafetensorError / OSError: corrupt header, truncated data, unreadable file
        if isinstance(error, (KeyboardInterrupt, MemoryError)):
            raise
        raise ConversionError(
            f"{path}: not a valid safetensors file ({error}). It is corrupt or truncated; download it again."
        ) from error


# --------------------------------------------------------------------------------------------------
# The plan: every output tensor with its shape, dtype, shard and origin
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str | None = None  # source tensor name, or None for tensors the conversion creates
    make: Callable[[], torch.Tensor] | None = None


@dataclasses.dataclass
class ConversionPlan:
    adapter: ArchitectureAdapter
    config: QKMapConfig
    shards: list[tuple[str, list[PlannedTensor]]]
    sharded: bool
    dtype: torch.dtype  # dtype of the converted weights (qk_map parameters stay float32)

    @property
    def num_tensors(self) -> int:
        return sum(len(tensors) for _, tensors in self.shards)

    def materialize(self, planned: PlannedTensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """One output tensor: read (or create), transform, check, cast. Math stays in the source precision."""
        if planned.source is not None:
            tensor = self.adapter.transform(planned.name, read(planned.source), self.config)
        else:
            assert planned.make is not None
            tensor = planned.make()
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


def qkmap_initial_values(config: QKMapConfig) -> dict[str, torch.Tensor]:
    """The qk_map parameters of one layer, from the model's own ``QKMapFeatureMap.initial_values``."""
    from ..modeling.modeling_qkmap import QKMapFeatureMap

    return {name: value.float() for name, value in QKMapFeatureMap(config).initial_values().items()}


def plan_conversion(
    source: TensorSource, adapter: ArchitectureAdapter, config: QKMapConfig, dtype: torch.dtype | None
) -> ConversionPlan:
    """Map every source tensor to its output, add the qk_map parameters, and check the result against the model."""
    expected = expected_parameters(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    out_dtype = dtype or source.dominant_dtype()

    def output_dtype(name: str, source_dtype: torch.dtype) -> torch.dtype:
        if ".qk_map." in name:
            return torch.float32  # _keep_in_fp32_modules: phases and gains stay float32
        return out_dtype if (dtype is not None and source_dtype.is_floating_point) else source_dtype

    shards: list[tuple[str, list[PlannedTensor]]] = []
    produced: dict[str, str] = {}
    for shard, infos in source.shards:
        planned = []
        for source_name, info in infos.items():
            adapter.check_tensor_name(source_name, f"{source.where}/{shard}")
            name = adapter.rename(source_name)
            if name is None:
                continue
            if name not in expected:
                raise ConversionError(
                    f"{source.where}/{shard}: tensor {source_name!r} has no place in the converted model (a "
                    f"{adapter.architecture} with this config has no such parameter). The checkpoint does not match "
                    f"its config.json or is not a plain {adapter.architecture}."
                )
            if name in produced:
                raise ConversionError(f"{source.where}/{shard}: tensor {name!r} also comes from {produced[name]}.")
            if info.shape != expected[name]:
                raise ConversionError(
                    f"{source.where}/{shard}: tensor {source_name!r} has shape {info.shape}, but config.json "
                    f"(hidden_size, num_attention_heads, num_key_value_heads, head_dim, ...) implies {expected[name]}."
                )
            produced[name] = shard
            planned.append(PlannedTensor(name, info.shape, output_dtype(name, info.dtype), source=source_name))
        shards.append((shard, planned))

    initial = qkmap_initial_values(config)
    created: dict[str, Callable[[], torch.Tensor]] = {}
    for layer in range(config.num_hidden_layers):
        for param in QKMAP_PARAMETERS:
            created[f"model.layers.{layer}.self_attn.qk_map.{param}"] = initial[param].clone
    bias_dtype = out_dtype
    for name, make in adapter.extra_tensors(config).items():
        if name not in produced:
            shape = expected[name]
            created[name] = lambda make=make, shape=shape: make(shape)
    for name, make in created.items():
        if name not in expected:
            raise ConversionError(f"internal: {name!r} is not a parameter of the QK-MAP model.")
        layer_prefix = name.rsplit(".", 2)[0] + "."
        target = next((i for i, (_, ts) in enumerate(shards) if any(t.name.startswith(layer_prefix) for t in ts)), -1)
        created_dtype = torch.float32 if ".qk_map." in name else bias_dtype
        shards[target][1].append(PlannedTensor(name, expected[name], created_dtype, make=make))
        produced[name] = shards[target][0]

    missing = [name for name in expected if name not in produced and name not in optional]
    if missing:
        raise ConversionError(
            f"{source.where}: {len(missing)} tensor(s) the model needs are missing from the checkpoint, e.g. "
            f"{', '.join(missing[:4])}. The checkpoint is incomplete or does not match config.json."
        )
    return ConversionPlan(adapter, config, shards, source.sharded, out_dtype)


# --------------------------------------------------------------------------------------------------
# Writing: a streaming safetensors writer and an atomic output folder
# --------------------------------------------------------------------------------------------------


def write_safetensors_streaming(
    path: Path,
    planned: list[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor],
    on_tensor: Callable[[], None] | None = None,
) -> int:
    """Write one safetensors file tensor by tensor; return its data size in bytes.

    The header (names, dtypes, shapes, offsets) is known from the plan, so it goes first and each tensor's
    bytes follow as soon as the tensor exists: memory holds one tensor, never the shard. Tensors are ordered
    by element size (largest first), as safetensors does, so every tensor starts aligned.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise ConversionError("safetensors output needs a little-endian machine.")
    order = sorted(planned, key=lambda p: -p.dtype.itemsize)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in order:
        nbytes = math.prod(p.shape) * p.dtype.itemsize
        header[p.name] = {
            "dtype": SAFETENSORS_DTYPES[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for p in order:
            tensor = produce(p)
            if tensor.dtype != p.dtype or tuple(tensor.shape) != p.shape:
                raise ConversionError(
                    f"internal: {p.name} is {tensor.dtype}{tuple(tensor.shape)}, planned {p.dtype}{p.shape}."
                )
            if tensor.numel():
                out.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
            if on_tensor is not None:
                on_tensor()
        out.flush()
        os.fsync(out.fileno())
    return offset


def _check_destination(src_dirs: list[Path], dst: Path, overwrite: bool) -> None:
    for src in src_dirs:
        src = src.resolve()
        resolved = dst.resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise ConversionError(f"DST {dst} overlaps SRC {src}; choose a destination outside the source folder.")
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir():
            raise ConversionError(f"DST {dst} exists and is not a folder; remove it or choose another destination.")
        if any(dst.iterdir()) and not overwrite:
            raise ConversionError(
                f"DST {dst} exists and is not empty; pass --overwrite (overwrite=True) to replace it."
            )
        if any(dst.iterdir()):  # never the working folder, a source's parent, or a folder that is not a model's
            check_overwrite_target(dst, src_dirs)


@contextlib.contextmanager
def atomic_directory(dst: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a hidden temporary folder beside ``dst``; on success it becomes ``dst``, on any failure it vanishes.

    With ``overwrite`` the old ``dst`` is moved aside only once the new one is complete, and restored if the
    final rename fails. KeyboardInterrupt cleans up too; a hard kill leaves only the hidden ``.DST.tmp-*``.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        yield tmp
        _fsync_directory(tmp)
        if dst.exists():
            if any(dst.iterdir()) and not overwrite:
                raise ConversionError(f"DST {dst} was filled by someone else during the conversion; not replacing it.")
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            dst.rename(old)
            try:
                tmp.rename(dst)
            except BaseException:
                old.rename(dst)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
        _fsync_directory(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_tensors(plan: ConversionPlan, source: TensorSource, out_dir: Path, progress: bool = True) -> None:
    """Stream every shard of the plan into ``out_dir``, one source shard open at a time, plus the index."""
    from tqdm.auto import tqdm

    weight_map: dict[str, str] = {}
    total = 0
    with tqdm(total=plan.num_tensors, unit="tensor", desc="converting", disable=not progress) as bar:
        for number, (shard, planned) in enumerate(plan.shards, start=1):
            bar.set_postfix_str(f"shard {number}/{len(plan.shards)} {shard}")
            with source.open(shard) as read:
                total += write_safetensors_streaming(
                    out_dir / shard, planned, lambda p, read=read: plan.materialize(p, read), bar.update
                )
            weight_map.update({p.name: shard for p in planned})
    if plan.sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def copy_remote_code(out_dir: Path) -> list[str]:
    """Copy the model files (and whatever they import relatively) so DST loads with trust_remote_code alone."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from ..modeling import modeling_qkmap

    files = [modeling_qkmap.__file__, *get_relative_import_files(modeling_qkmap.__file__)]
    for file in files:
        shutil.copyfile(file, out_dir / Path(file).name)
    return [Path(f).name for f in files]


def copy_side_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Tokenizer files and generation config, copied byte for byte (never anything executable or pickled)."""
    copied = []
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, out_dir / name)
            copied.append(name)
    return copied


# --------------------------------------------------------------------------------------------------
# Source resolution
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    directory: Path
    label: str  # what the user passed (path or repo id), for provenance and messages
    gguf_file: str | None = None
    repo_id: str | None = None


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(p and not p.startswith(".") for p in parts) and "\\" not in text


def resolve_source(
    src: str | os.PathLike, gguf_file: str | None = None, cache_dir: str | os.PathLike | None = None
) -> ResolvedSource:
    """A local folder, a ``.gguf`` file, or a repo id already in the local Hugging Face cache (never downloads)."""
    label = os.fspath(src)
    path = Path(label).expanduser()
    repo_id = None
    if path.is_file():
        if path.suffix == ".gguf":
            return ResolvedSource(path.parent.absolute(), label, gguf_file or path.name)
        if path.name.endswith(PICKLE_SUFFIXES):
            refuse_pickle_only(path.parent)
        raise ConversionError(f"SRC {label} is a file; pass the checkpoint folder (or a .gguf file).")
    if path.is_dir():
        directory = path.absolute()
    elif _looks_like_repo_id(label) and not path.exists():
        from huggingface_hub import snapshot_download

        try:
            directory = Path(snapshot_download(label, local_files_only=True, cache_dir=cache_dir))
        except Exception as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            raise ConversionError(
                f"SRC {label!r} is not a local folder and not a repo id in the local Hugging Face cache "
                f"({cache_dir or 'HF_HUB_CACHE'}); conversion never downloads. Fetch it first (e.g. `hf download "
                f"{label}`) or pass a local folder. ({type(error).__name__})"
            ) from error
        repo_id = label
    else:
        raise ConversionError(f"SRC {label}: no such folder.")
    if gguf_file is not None:
        if not (directory / gguf_file).is_file():
            present = sorted(p.name for p in directory.glob("*.gguf"))
            raise ConversionError(
                f"{directory}: GGUF file {gguf_file!r} not found"
                + (f"; present: {', '.join(present)}." if present else ".")
            )
    elif not (directory / "config.json").exists():
        ggufs = sorted(p.name for p in directory.glob("*.gguf"))
        if len(ggufs) == 1:
            gguf_file = ggufs[0]
        elif ggufs:
            raise ConversionError(f"{directory}: several GGUF files ({', '.join(ggufs)}); choose one with --gguf-file.")
    return ResolvedSource(directory, label, gguf_file, repo_id)


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def _prepare(config_dict: dict[str, Any], architecture: str | None, options: ConversionOptions, where: str):
    adapter = adapter_for(architecture, where)
    adapter.check_config(config_dict, where)
    return adapter, build_qkmap_config(config_dict, adapter, options, where)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def convert_model(
    model: torch.nn.Module,
    *,
    init: str = "exact",
    num_frequencies: int = 1,
    omega0: float = DEFAULT_OMEGA0,
    dtype: torch.dtype | str | None = None,
    share_weights: bool = False,
):
    """Return a ``QKMapForCausalLM`` computing ``model``'s function (``init="exact"``) or its canonical start.

    Uses the same adapter and tensor plan as ``convert_checkpoint``. Weights are copied unless
    ``share_weights=True`` (then the converted model shares storage with ``model`` where dtypes agree).
    """
    from transformers.initialization import no_init_weights

    from ..modeling.modeling_qkmap import QKMapForCausalLM

    options = ConversionOptions(init, num_frequencies, omega0, dtype)
    architecture = type(model).__name__
    where = f"model {architecture}"
    config_dict = model.config.to_dict()
    check_source_config(config_dict, where)
    adapter, config = _prepare(config_dict, architecture, options, where)
    source = StateDictSource(model.state_dict(), where, max_shard_bytes=sys.maxsize)
    plan = plan_conversion(source, adapter, config, options.dtype)
    config.dtype = _dtype_name(plan.dtype)
    state: dict[str, torch.Tensor] = {}
    for shard, planned in plan.shards:
        with source.open(shard) as read:
            for p in planned:
                tensor = plan.materialize(p, read)
                state[p.name] = tensor if share_weights or p.source is None else tensor.clone()
    with no_init_weights():
        converted = QKMapForCausalLM(config)
    result = converted.load_state_dict(state, strict=False, assign=True)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConversionError(f"{where}: state dict mismatch (missing {missing[:4]}, unexpected {unexpected[:4]}).")
    if config.tie_word_embeddings:
        converted.tie_weights()
    parameter = next(model.parameters(), None)
    if parameter is not None:
        converted.to(parameter.device)  # created tensors and buffers join the source's device
    if getattr(model, "generation_config", None) is not None:
        converted.generation_config = copy.deepcopy(model.generation_config)
    return converted.eval() if not model.training else converted


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    init: str = "exact",
    num_frequencies: int = 1,
    omega0: float = DEFAULT_OMEGA0,
    dtype: torch.dtype | str | None = None,
    gguf_file: str | None = None,
    verify_text: str | os.PathLike | None = None,
    max_tokens: int = 512,
    generate_tokens: int = 64,
    overwrite: bool = False,
    base_model: str | None = None,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert a Llama-style checkpoint on disk (safetensors folder, cached repo id, or GGUF) into ``dst``.

    ``dst`` loads with ``AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)`` without qkmap_hf.
    With ``verify_text`` the converted model is checked against the source before ``dst`` appears
    (``verification.json``). Returns ``dst``. Raises ``ConversionError`` naming the file or field on bad input.
    """
    options = ConversionOptions(init, num_frequencies, omega0, dtype)
    dst = Path(dst).expanduser().absolute()
    resolved = resolve_source(src, gguf_file, cache_dir)
    _check_destination([resolved.directory], dst, overwrite)

    gguf_model = gguf_tokenizer = None
    if resolved.gguf_file is not None:
        from ..assets import load_gguf_causal_lm

        where = str(resolved.directory / resolved.gguf_file)
        try:
            gguf_model, gguf_tokenizer = load_gguf_causal_lm(resolved.directory, resolved.gguf_file)
        except Exception as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            raise ConversionError(f"{where}: transformers could not load this GGUF file ({error}).") from error
        architecture = type(gguf_model).__name__
        config_dict = gguf_model.config.to_dict()
        check_source_config(config_dict, where)
        source: TensorSource = StateDictSource(gguf_model.state_dict(), where, max_shard_bytes)
        options = dataclasses.replace(options, dtype=options.dtype or torch.float32)
    else:
        where = str(resolved.directory / "config.json")
        if not any(resolved.directory.glob("*.safetensors")):
            refuse_pickle_only(resolved.directory)  # the real problem, before any config complaint
        raw_config = read_source_config(resolved.directory)
        architecture = source_architecture(raw_config)
        adapter_for(architecture, where)  # refuse unsupported families before anything else
        config_dict = normalized_source_config(raw_config, where)
        source = SafetensorsSource(resolved.directory)
    adapter, config = _prepare(config_dict, architecture, options, where)
    plan = plan_conversion(source, adapter, config, options.dtype)
    config.dtype = _dtype_name(plan.dtype)
    has_tokenizer = gguf_model is not None or any((resolved.directory / n).is_file() for n in TOKENIZER_FILES)
    if verify_text is not None and not has_tokenizer:
        raise ConversionError(
            f"{resolved.directory}: no tokenizer files, so --verify cannot tokenize the text; add the source's "
            "tokenizer files or convert without --verify."
        )

    provenance: dict[str, Any] = {
        "kind": "conversion",  # qkmap_hf.cards files this record under "Conversion"
        "source": resolved.label,
        "source_architecture": architecture,
        "base_model": base_model or _guess_base_model(resolved, config_dict),
        "init": options.init,
        "omega_0": options.omega0 if options.init == "exact" else None,
        "num_frequencies": options.num_frequencies,
        "gain_parametrization": config.qkmap_gain_parametrization,
        "dtype": config.dtype,
        "qkmap_hf_version": _qkmap_version(),
        "transformers_version": _package_version("transformers"),
        "torch_version": torch.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if options.init == "canonical":
        provenance["frequency_range"] = [config.qkmap_min_frequency, config.qkmap_max_frequency]
    if resolved.gguf_file is not None:
        provenance["gguf_file"] = resolved.gguf_file
    if str(resolved.directory) != resolved.label:
        provenance["source_path"] = str(resolved.directory)

    with atomic_directory(dst, overwrite) as tmp:
        write_tensors(plan, source, tmp, progress=progress)
        config.to_json_file(tmp / "config.json")
        copy_remote_code(tmp)
        if gguf_model is not None:
            gguf_tokenizer.save_pretrained(tmp)
            if gguf_model.generation_config is not None:
                gguf_model.generation_config.save_pretrained(tmp)
        else:
            copy_side_files(resolved.directory, tmp)
        if verify_text is not None:
            from ..verify import verify_conversion

            report = verify_conversion(
                gguf_model if gguf_model is not None else resolved.directory,
                tmp,
                verify_text,
                max_tokens=max_tokens,
                generate_tokens=generate_tokens,
                tokenizer=gguf_tokenizer,
                source_label=resolved.label,
                converted_label=str(dst),
            )
            report.save(tmp / VERIFICATION_NAME)
            if report.non_finite():  # NaN/inf logits: DST never appears (see qkmap_hf.verify)
                bad = ", ".join(report.non_finite())
                raise ConversionError(f"verifying {dst} gave non-finite {bad}; the model is broken, nothing written.")
            provenance["verification"] = report.summary()
            if progress:
                print(report.table())
        (tmp / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
        _write_card(tmp, provenance, dst.name)
    return dst


def _write_card(out_dir: Path, provenance: dict[str, Any], name: str) -> None:
    """README.md from ``qkmap_hf.cards`` (template in model_cards/) with the conversion provenance and base_model."""
    from ..cards import write_model_card

    write_model_card(out_dir, provenance=provenance, model_name=name)


def _guess_base_model(resolved: ResolvedSource, config: dict[str, Any]) -> str:
    if resolved.repo_id:
        return resolved.repo_id
    name = config.get("_name_or_path") or ""
    return name if _looks_like_repo_id(name) and "/" in name and not Path(name).exists() else resolved.label


def _qkmap_version() -> str:
    from ..version import __version__

    return __version__


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


__all__ = [
    "ConversionError",
    "ConversionOptions",
    "ConversionPlan",
    "convert_checkpoint",
    "convert_model",
    "plan_conversion",
    "resolve_source",
    "supported_architectures",
]
