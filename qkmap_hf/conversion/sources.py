"""Where source tensors come from: safetensors folders and state dicts in memory (GGUF, ``convert_model``).

What a source is (a folder, a ``.gguf`` file, a cached repo id) and how a model is loaded whole is
``qkmap_hf.loading``'s job; this module streams the tensors of a source that is already resolved.

A source is a list of shards, opened one at a time. A safetensors shard's reader hands out tensors (copied
out of the file) and, for tensors that go out unchanged, the byte span in the file, so the writer can copy
them inside the kernel without ever holding them in memory. Only headers are read up front.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..filenames import SAFETENSORS_INDEX_NAME, SAFETENSORS_SINGLE_NAME
from ..loading import refuse_pickle_only
from ..safety import check_not_escaping, contained_path
from .errors import ConversionError

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # in-memory sources (GGUF) shard like save_pretrained

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


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None  # absolute byte offset of the data in its shard file (safetensors sources)


@dataclasses.dataclass(frozen=True)
class FileSpan:
    """Bytes of one tensor inside an open source file, for a copy that never enters Python."""

    fd: int
    offset: int
    nbytes: int


class ShardReader:
    """Reads the tensors of a source (any shard, the open one cheaply): ``reader(name)`` and ``reader.span(name)``."""

    def __call__(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def span(self, name: str) -> FileSpan | None:
        """Where the tensor's bytes lie in a file, or ``None`` if it only exists in memory."""
        return None


class TensorSource:
    """Source tensors grouped in shards; ``open(shard)`` yields a reader valid while the shard is open."""

    where: str
    sharded: bool
    shards: list[tuple[str, dict[str, TensorInfo]]]

    def open(self, shard: str) -> contextlib.AbstractContextManager[ShardReader]:
        raise NotImplementedError

    def dominant_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the bytes (the default output dtype)."""
        sizes: dict[torch.dtype, int] = {}
        for _, infos in self.shards:
            for info in infos.values():
                if info.dtype.is_floating_point:
                    sizes[info.dtype] = sizes.get(info.dtype, 0) + math.prod(info.shape)
        return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


class _SafetensorsReader(ShardReader):
    def __init__(self, source: SafetensorsSource, shard: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.source, self.stack = source, stack
        self.handles: dict[str, Any] = {}
        self.fds: dict[str, int] = {}
        self.infos = {name: (file, info) for file, infos in source.shards for name, info in infos.items()}
        self._safe_open = safe_open
        self._open(shard)

    def _open(self, shard: str) -> None:
        path = self.source.directory / shard
        try:
            handle = self.stack.enter_context(self._safe_open(str(path), framework="pt", device="cpu"))
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise ConversionError(f"{path}: cannot open ({error}); the file is damaged or was replaced.") from error
        self.stack.callback(os.close, fd)
        self.handles[shard], self.fds[shard] = handle, fd

    def _shard_of(self, name: str) -> str:
        shard = self.infos[name][0]
        if shard not in self.handles:  # a merge reading across shards: open the other one too (headers only)
            self._open(shard)
        return shard

    def __call__(self, name: str) -> torch.Tensor:
        shard = self._shard_of(name)
        try:
            return self.handles[shard].get_tensor(name)
        except Exception as error:
            path = self.source.directory / shard
            raise ConversionError(f"{path}: reading tensor {name!r} failed ({error}); the file is damaged.") from error

    def span(self, name: str) -> FileSpan | None:
        shard = self._shard_of(name)
        info = self.infos[name][1]
        assert info.offset is not None
        return FileSpan(self.fds[shard], info.offset, math.prod(info.shape) * info.dtype.itemsize)


class SafetensorsSource(TensorSource):
    """A folder with ``model.safetensors`` or ``model.safetensors.index.json`` plus shards (headers checked up front)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.where = str(directory)
        index_path = directory / SAFETENSORS_INDEX_NAME
        if index_path.is_file():
            files, weight_map = self._read_index(index_path)
            self.sharded = True
        elif (directory / SAFETENSORS_SINGLE_NAME).is_file():
            files, weight_map = [SAFETENSORS_SINGLE_NAME], None
            self.sharded = False
        else:
            refuse_pickle_only(directory)
            found = sorted(p.name for p in directory.glob("*.safetensors"))
            hint = (
                f" (found {', '.join(found)}, but without {SAFETENSORS_INDEX_NAME} they are not a transformers checkpoint)"
                if found
                else ""
            )
            raise ConversionError(f"{directory}: no {SAFETENSORS_SINGLE_NAME} or {SAFETENSORS_INDEX_NAME}{hint}.")
        self.shards = []
        owner: dict[str, str] = {}
        for file in files:  # unchanged tensors are copied byte for byte: a link out of SRC would copy that file
            check_not_escaping(directory, file)
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
        for name, file in weight_map.items():  # a shard named ../x or /x would be read, and written beside DST
            contained_path(index_path.parent, file, source=index_path, what=f"weight_map entry {name!r} ->")
        files = list(dict.fromkeys(sorted(weight_map.values())))
        missing = [f for f in files if not (index_path.parent / f).is_file()]
        if missing:
            raise ConversionError(
                f"{index_path}: shard(s) {', '.join(missing)} listed in the index are missing from "
                f"{index_path.parent}; the download is incomplete."
            )
        return files, weight_map

    @contextlib.contextmanager
    def open(self, shard: str) -> Iterator[ShardReader]:
        with contextlib.ExitStack() as stack:  # unmaps and closes when done: one shard open at a time
            yield _SafetensorsReader(self, shard, stack)


class _MemoryReader(ShardReader):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class StateDictSource(TensorSource):
    """Tensors already in memory (a GGUF loaded by transformers, or a model passed to ``convert_model``).

    The whole model is in memory here; shards follow ``huggingface_hub.split_torch_state_dict_into_shards``,
    as ``save_pretrained`` does.
    """

    def __init__(self, state_dict: dict[str, torch.Tensor], where: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        from huggingface_hub import split_torch_state_dict_into_shards

        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in state_dict.items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if tensor.numel() and key in seen:  # tied weights: saved once, as save_pretrained does
                continue
            seen.add(key)
            self.tensors[name] = tensor
        split = split_torch_state_dict_into_shards(self.tensors, max_shard_size=max_shard_bytes)
        self.sharded = split.is_sharded
        self.shards = [
            (file, {n: TensorInfo(tuple(self.tensors[n].shape), self.tensors[n].dtype) for n in names})
            for file, names in split.filename_to_tensors.items()
        ]

    @contextlib.contextmanager
    def open(self, shard: str) -> Iterator[ShardReader]:
        yield _MemoryReader(self.tensors)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Names, shapes, dtypes and data offsets of one shard (header only; the data stays on disk).

    ``safe_open`` validates the file (header, sizes); the offsets come from the same JSON header.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names = list(handle.keys())  # noqa: SIM118 - safe_open is not iterable
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        infos = {}
        for name in names:
            entry = header[name]
            if entry["dtype"] not in TORCH_DTYPES:
                raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}.")
            start = 8 + length + int(entry["data_offsets"][0])
            infos[name] = TensorInfo(tuple(entry["shape"]), TORCH_DTYPES[entry["dtype"]], start)
        return infos
    except ConversionError:
        raise
    except Exception as error:  # SafetensorError / OSError: corrupt header, truncated data, unreadable file
        if isinstance(error, (KeyboardInterrupt, MemoryError)):
            raise
        raise ConversionError(
            f"{path}: not a valid safetensors file ({error}). It is corrupt or truncated; download it again."
        ) from error


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "FileSpan",
    "SafetensorsSource",
    "ShardReader",
    "StateDictSource",
    "TensorInfo",
    "TensorSource",
    "read_safetensors_header",
]
