"""Loading source models: the one place that turns what a user names (a model folder, a ``.gguf`` file, a repo
id in the local Hugging Face cache) into a folder to read, or into a model and tokenizer in memory.

Conversion, heal's teacher, verify, analyze and the demo's assets all read models through here, so a GGUF file
loads the same way everywhere (dequantized, as a plain float checkpoint), a bad ``config.json`` is named in one
line wherever it is read, and a pickle-only checkpoint is refused, never opened. It imports no other layer of
the package that reads models, so each of them can build on it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from .errors import ConversionError
from .filenames import PICKLE_SUFFIXES, TOKENIZER_FILES
from .safety import find_pickles, load_checked_config, tokenizer_file


def is_repo_id(text: str, *, with_owner: bool = False) -> bool:
    """Whether huggingface_hub's validator accepts ``text`` as a repo id (``ORG/NAME``, or ``NAME`` unless
    ``with_owner``); the package's one test of a name that may be a Hub model. A path that starts like a path
    (``.``, ``/``, ``~``) is never one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.startswith((".", "/", "~")) or (with_owner and "/" not in text):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    """A source on disk: its folder, what the user passed (for provenance and messages), its GGUF file if it is
    one, and its repo id if it came from the local Hugging Face cache."""

    directory: Path
    label: str
    gguf_file: str | None = None
    repo_id: str | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.gguf_file is not None or any((self.directory / n).is_file() for n in TOKENIZER_FILES)


def refuse_pickle_only(directory: Path) -> None:
    """Pickle checkpoints can run arbitrary code when loaded: explain and refuse, never unpickle.

    Pickles are found by name and by content (a renamed ``.pt`` is still a pickle).
    """
    files = sorted(
        p.name for p in directory.iterdir() if p.is_file() and not p.name.endswith((".json", ".safetensors"))
    )
    pickles = sorted(name for name, _ in find_pickles(directory, files))
    if pickles:
        raise ConversionError(
            f"{directory}: only pickle checkpoint files found ({', '.join(pickles[:4])}). Pickle files can execute "
            "arbitrary code when loaded, so qkmap convert never opens them; it reads safetensors and GGUF only. Use "
            "the safetensors release of the model, or convert the file yourself in a sandbox you trust "
            "(model.save_pretrained(dir) writes safetensors)."
        )


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
    elif is_repo_id(label) and not path.exists():
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


def split_gguf_path(path: str | os.PathLike, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """``(folder, gguf_file)``: a path to a ``.gguf`` file names its folder and the file (transformers loads GGUF
    from a folder plus a file name); any other path is a folder, with ``gguf_file`` as given."""
    path = Path(path)
    if gguf_file is None and path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    return path, gguf_file


def _gguf_model(directory: str | os.PathLike, gguf_file: str, dtype: torch.dtype):
    """The GGUF checkpoint as a plain float model: transformers dequantizes it on load and attaches a gguf
    quantization config, dropped here so that the model saves (and converts) as an ordinary checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype)
    for holder in (model.config, model):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.hf_quantizer = None
    return model


def load_gguf_causal_lm(directory: str | os.PathLike, gguf_file: str, dtype: torch.dtype | None = None):
    """Load a GGUF checkpoint with transformers as a plain (dequantized) model, plus its tokenizer.

    The whole model is dequantized into memory (float32 by default).
    """
    from transformers import AutoTokenizer

    model = _gguf_model(directory, gguf_file, torch.float32 if dtype is None else dtype)
    return model, AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


def load_causal_lm(
    source: str | os.PathLike, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32, **kwargs: Any
):
    """A source model in eval mode: a folder (its ``config.json`` checked first, so a bad field is one line naming
    the file), a GGUF file in a folder (``gguf_file``, or a path ending in ``.gguf``), or a Hub id as transformers
    resolves it. ``kwargs`` go to ``from_pretrained`` (``attn_implementation``, ``trust_remote_code``)."""
    from transformers import AutoModelForCausalLM

    folder, gguf_file = split_gguf_path(source, gguf_file)
    if gguf_file:
        return _gguf_model(folder, gguf_file, dtype).eval()
    if (folder / "config.json").is_file() and "config" not in kwargs:
        remote = {"trust_remote_code": kwargs["trust_remote_code"]} if "trust_remote_code" in kwargs else {}
        kwargs["config"] = load_checked_config(folder, **remote)
    return AutoModelForCausalLM.from_pretrained(os.fspath(source), dtype=dtype, **kwargs).eval()


def load_source_tokenizer(folder: str | os.PathLike, gguf_file: str | None = None, **kwargs: Any):
    """The tokenizer beside a model's weights (the GGUF file's own, else the tokenizer files), or ``None`` when the
    folder has none."""
    from transformers import AutoTokenizer

    if gguf_file:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, **kwargs)
    if tokenizer_file(folder) == str(Path(folder)):  # no tokenizer file in it
        return None
    return AutoTokenizer.from_pretrained(folder, **kwargs)


__all__ = [
    "ResolvedSource",
    "is_repo_id",
    "load_causal_lm",
    "load_gguf_causal_lm",
    "load_source_tokenizer",
    "refuse_pickle_only",
    "resolve_source",
    "split_gguf_path",
]
