"""Writing: a streaming safetensors writer and the files beside the weights (inside the atomic output folder of
``qkmap_hf.fileio.atomic_directory``).

The writer knows every header up front (from the plan), so each tensor's bytes go to their final offset
as soon as the tensor exists: memory holds one tensor, never a shard. Tensors that go out unchanged are
copied file to file inside the kernel (``os.copy_file_range``), so they never enter Python at all. Files
are synced once, after the last shard, so the disk flushes while later shards are still being written.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..fileio import atomic_copy, atomic_write_json
from ..filenames import SAFETENSORS_INDEX_NAME, TOKENIZER_FILES
from ..safety import check_not_escaping, contained_path, pickle_reason
from .errors import ConversionError
from .plan import ConversionPlan, PlannedTensor
from .sources import SAFETENSORS_DTYPES, FileSpan, TensorSource

_COPY_CHUNK = 64 * 2**20
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        if hasattr(os, "pwrite"):
            written = os.pwrite(fd, data, offset)
        else:  # pragma: no cover - Windows has no pwrite
            os.lseek(fd, offset, os.SEEK_SET)
            written = os.write(fd, data)
        data, offset = data[written:], offset + written


def _copy_span(span: FileSpan, fd: int, offset: int) -> None:
    """Copy ``span`` to ``offset`` of ``fd``: in the kernel where the filesystem allows, else in 64 MB chunks."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < span.nbytes:
        count = min(span.nbytes - done, 2**30)
        if use_kernel:
            try:
                copied = os.copy_file_range(span.fd, fd, count, span.offset + done, offset + done)
            except OSError as error:
                if error.errno not in _NO_KERNEL_COPY:
                    raise
                use_kernel = False
                continue
            if copied == 0:
                raise ConversionError(f"source file ended {span.nbytes - done} bytes early; it was truncated.")
        else:
            if hasattr(os, "pread"):
                chunk = os.pread(span.fd, min(count, _COPY_CHUNK), span.offset + done)
            else:  # pragma: no cover - Windows has no pread
                os.lseek(span.fd, span.offset + done, os.SEEK_SET)
                chunk = os.read(span.fd, min(count, _COPY_CHUNK))
            if not chunk:
                raise ConversionError(f"source file ended {span.nbytes - done} bytes early; it was truncated.")
            _write_at(fd, memoryview(chunk), offset + done)
            copied = len(chunk)
        done += copied


def write_safetensors_streaming(
    path: Path,
    planned: list[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor | FileSpan],
    on_tensor: Callable[[], None] | None = None,
) -> int:
    """Write one safetensors file tensor by tensor; return its data size in bytes (the file is not synced).

    The header (names, dtypes, shapes, offsets) is known from the plan, so it goes first and each tensor's
    bytes follow as soon as the tensor exists. Tensors are ordered by element size (largest first), as
    safetensors does, so every tensor starts aligned. ``produce`` returns a tensor, or a ``FileSpan``
    whose bytes are copied as they are.
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        position = 8 + len(encoded)
        _write_at(fd, memoryview(struct.pack("<Q", len(encoded)) + encoded), 0)
        for p in order:
            nbytes = header[p.name]["data_offsets"][1] - header[p.name]["data_offsets"][0]
            data = produce(p)
            if isinstance(data, FileSpan):
                if data.nbytes != nbytes:
                    raise ConversionError(f"internal: {p.name} spans {data.nbytes} bytes, planned {nbytes}.")
                _copy_span(data, fd, position)
            else:
                if data.dtype != p.dtype or tuple(data.shape) != p.shape:
                    raise ConversionError(
                        f"internal: {p.name} is {data.dtype}{tuple(data.shape)}, planned {p.dtype}{p.shape}."
                    )
                if data.numel():
                    raw = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    _write_at(fd, memoryview(raw), position)
            del data
            position += nbytes
            if on_tensor is not None:
                on_tensor()
    finally:
        os.close(fd)
    return offset


def write_tensors(plan: ConversionPlan, source: TensorSource, out_dir: Path, progress: bool = True) -> None:
    """Stream every shard of the plan into ``out_dir``, one source shard open at a time, plus the index."""
    from tqdm.auto import tqdm

    weight_map: dict[str, str] = {}
    total = 0
    with tqdm(total=plan.num_tensors, unit="tensor", desc="converting", disable=not progress) as bar:
        for number, (shard, planned) in enumerate(plan.shards, start=1):
            bar.set_postfix_str(f"shard {number}/{len(plan.shards)} {shard}")
            target = contained_path(out_dir, shard, source=source.where, what="output shard")
            target.parent.mkdir(parents=True, exist_ok=True)
            with source.open(shard) as read:
                total += write_safetensors_streaming(
                    target, planned, lambda p, read=read: plan.materialize(p, read), bar.update
                )
            weight_map.update({p.name: shard for p in planned})
    if plan.sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_json(out_dir / SAFETENSORS_INDEX_NAME, index)


def copy_remote_code(out_dir: Path) -> list[str]:
    """Copy the model files (and whatever they import relatively) so DST loads with trust_remote_code alone."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from ..modeling import modeling_qkmap

    files = [modeling_qkmap.__file__, *get_relative_import_files(modeling_qkmap.__file__)]
    for file in files:
        atomic_copy(file, out_dir / Path(file).name)
    return [Path(f).name for f in files]


def copy_side_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Tokenizer files and generation config, copied byte for byte (never anything executable or pickled, never
    through a symlink that leaves SRC)."""
    copied = []
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src_dir / name).is_file():
            check_not_escaping(src_dir, name)  # a link out of SRC would be copied (dereferenced) into DST
            reason = pickle_reason(src_dir / name)
            if reason is not None:
                raise ConversionError(
                    f"{src_dir / name} is {reason}, not a tokenizer file; remove it (never unpickled)."
                )
            atomic_copy(src_dir / name, out_dir / name)
            copied.append(name)
    return copied


__all__ = [
    "copy_remote_code",
    "copy_side_files",
    "write_safetensors_streaming",
    "write_tensors",
]
