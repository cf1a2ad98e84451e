"""Guards against hostile or accidental inputs, shared by conversion, training and publishing.

- ``pickle_reason``: is a file a pickle (or a container of one), judged by its bytes, whatever its name?
  Loading a pickle can run arbitrary code; this package never unpickles.
- ``check_overwrite_target``: may ``--overwrite`` replace this folder? Never the working folder (or a parent of
  it), a parent of the source, the home folder, or a folder that is not a model folder.
- ``folder_writer`` / ``check_writer``: which qkmap command wrote a folder (its provenance record), so that no
  command replaces another's output without ``--overwrite``.
- ``read_text_file``: the text of a training file, refused with its name when it is binary or not UTF-8.
- ``contained_path`` / ``check_not_escaping``: a path named inside a file (an index's ``weight_map``, an analysis
  plot, a side file that is a symlink) must stay inside its folder; the Hugging Face cache's
  ``snapshots/REV/NAME -> ../../blobs/HASH`` links are followed only into the blobs of the same cache entry.
- ``load_checked_config`` / ``named_config_errors``: a config that does not validate (huggingface_hub's typed
  errors, QKMapConfig's, an unknown ``hidden_act``) is one line naming the file (or ``--config``) and the field.
- ``tokenizer_file`` / ``check_same_vocabulary``: two models that must share token ids (teacher and student,
  source and converted) are compared by their token-to-id maps, not only their sizes, before any work starts.
"""

from __future__ import annotations

import io
import os
import pickletools
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConversionError
from .filenames import PICKLE_SUFFIXES, PROVENANCE_FILES

_PICKLE_PROTOCOL_OPCODE = 0x80  # PROTO, first opcode of every protocol 2+ pickle
_PROBE_BYTES = 1 << 16
_SMALL_PICKLE_BYTES = 4 << 20  # protocol 0/1 pickles have no magic bytes: parse small files whole
_NPY_MAGIC = b"\x93NUMPY"
PROVENANCE_MARKERS = tuple(PROVENANCE_FILES.values())


def _parses_as_pickle(data: bytes, *, whole: bool) -> bool:
    """Whether ``data`` is a run of pickle opcodes (``whole``: ending with STOP at the last byte, stack-checked)."""
    if whole:
        try:
            pickletools.dis(data, out=io.StringIO())
        except Exception:  # pickletools raises ValueError/IndexError/... on anything that is not a pickle
            return False
        return data.rstrip(b"\n").endswith(b".")
    opcodes = 0
    try:
        for opcode, _arg, _pos in pickletools.genops(data):
            opcodes += 1
            if opcode.name == "STOP" or opcodes >= 8:
                return True
    except Exception:  # a truncated probe ends mid-argument; a non-pickle fails on its first bytes
        return opcodes >= 4
    return opcodes >= 2


def pickle_reason(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` holds pickled data (``None``: it does not), from its content alone.

    Recognises protocol 2-5 pickles (``torch.save`` legacy files, joblib), zip archives with a pickle inside
    (``torch.save``'s default format, ``.npz`` with objects), NumPy ``.npy`` files of dtype object, and small
    protocol 0/1 pickles. Safetensors and GGUF files are not pickles whatever their first bytes.
    """
    path = Path(path)
    try:
        with path.open("rb") as handle:
            head = handle.read(_PROBE_BYTES)
            size = os.fstat(handle.fileno()).st_size
    except OSError:
        return None
    if (
        len(head) >= 2
        and head[0] == _PICKLE_PROTOCOL_OPCODE
        and 2 <= head[1] <= 5
        and _parses_as_pickle(head, whole=False)
    ):
        return f"a protocol-{head[1]} pickle"
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                inner = [name for name in archive.namelist() if name.endswith((".pkl", ".pickle"))]
                inner += [
                    name
                    for name in archive.namelist()
                    if name.endswith(".npy") and _npy_is_object(archive.read(name)[:256])
                ]
        except (zipfile.BadZipFile, OSError):
            inner = []
        if inner:
            return f"a zip archive holding pickled data ({inner[0]})"
        return None
    if head.startswith(_NPY_MAGIC):
        return "a NumPy array of Python objects (stored as a pickle)" if _npy_is_object(head) else None
    if size <= _SMALL_PICKLE_BYTES and head[:1] in (b"(", b"]", b"}", b"c", b"I", b"F", b"S", b"V", b"N", b"L", b"K"):
        data = head if size <= len(head) else path.read_bytes()
        if _parses_as_pickle(data, whole=True):
            return "a protocol-0/1 pickle"
    return None


def _npy_is_object(head: bytes) -> bool:
    header = head[10:256].split(b"\n", 1)[0]
    return head.startswith(_NPY_MAGIC) and (b"'|O'" in header or b"'O'" in header or b"'<O'" in header)


def find_pickles(folder: str | os.PathLike, names: Iterable[str]) -> list[tuple[str, str]]:
    """``(name, reason)`` for each of ``names`` (relative to ``folder``) that is a pickle: by content (a renamed
    ``.pt`` is still one), else by a pickle-format suffix (an empty or unreadable ``.bin`` is refused too)."""
    found = []
    for name in names:
        reason = pickle_reason(Path(folder) / name)
        if reason is None and name.endswith(PICKLE_SUFFIXES):
            reason = "a pickle-format file name"
        if reason is not None:
            found.append((name, reason))
    return found


def symlinks_in(folder: str | os.PathLike) -> list[str]:
    """Symlinks under ``folder`` (files or folders, recursively), each with its target and whether that is outside.

    An upload follows them: a link can publish a file from anywhere on the machine."""
    root = Path(folder).resolve()
    found = []
    for current, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(current, name)
            if path.is_symlink():
                target = path.resolve()
                where = "outside the folder" if not target.is_relative_to(root) else "inside the folder"
                found.append(f"{path.relative_to(root).as_posix()} (a symlink to {target}, {where})")
    return found


def _allowed_roots(folder: Path) -> list[Path]:
    """Where files of ``folder`` may really live: the folder itself, and for a snapshot of the Hugging Face cache
    (``models--ORG--NAME/snapshots/REV``) the ``blobs`` of that same cache entry, which its symlinks point into."""
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        roots.append(root.parent.parent / "blobs")
    return roots


def escape_reason(folder: str | os.PathLike, entry: str) -> str | None:
    """Why ``folder/entry`` leaves ``folder`` (``None``: it stays inside): an absolute path, ``..`` above the
    folder, or a symlink to elsewhere (other than the same cache entry's blobs)."""
    folder = Path(folder)
    if not entry or Path(entry).is_absolute() or Path(entry).drive:
        return "an absolute or empty path"
    if os.path.normpath(entry).split(os.sep)[0] == os.pardir or os.path.normpath(entry) == os.curdir:
        return "a path outside the folder"
    target = (folder / entry).resolve()
    if not any(target.is_relative_to(root) for root in _allowed_roots(folder)):
        return f"a symlink to {target}, outside the folder"
    return None


def contained_path(folder: str | os.PathLike, entry: object, *, source: str | os.PathLike, what: str) -> Path:
    """``folder/entry`` for an ``entry`` read from the file ``source``; ``ValueError`` naming the file and the entry
    when it is not a string or leads out of ``folder`` (reading or writing it would touch another file)."""
    if not isinstance(entry, str):
        raise ValueError(f"{source}: {what} {entry!r} is not a file name; the file is damaged or hostile.")
    reason = escape_reason(folder, entry)
    if reason is not None:
        raise ValueError(
            f"{source}: {what} {entry!r} is {reason}; every file it names must lie inside {folder}. Refusing it "
            "(the file is damaged or hostile)."
        )
    return Path(folder) / entry


def check_not_escaping(folder: str | os.PathLike, name: str, *, option: str = "SRC") -> None:
    """``ValueError`` when ``folder/name`` (a file about to be copied into an output) is a symlink leaving
    ``folder``: copying would publish a file from elsewhere under this name."""
    reason = escape_reason(folder, name)
    if reason is not None:
        raise ValueError(
            f"{option} {Path(folder) / name} is {reason}; refusing to copy it into the output (copy the file itself "
            f"into {folder} if it belongs there)."
        )


def is_model_folder(folder: Path) -> bool:
    """A folder a previous convert/train/save_pretrained wrote: weights (safetensors or GGUF) at its top level, or
    a qkmap provenance record."""
    if any((folder / marker).is_file() for marker in PROVENANCE_MARKERS):
        return True
    return (
        any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")) or any(folder.glob("*.gguf"))
    )


# The record each command leaves, most specific first: a heal folder also holds the training record (heal is
# train plus more) and a copy of the conversion record.
WRITER_RECORDS = (
    ("qkmap heal", PROVENANCE_FILES["healing"]),
    ("qkmap train", PROVENANCE_FILES["training"]),
    ("qkmap convert", PROVENANCE_FILES["conversion"]),
    ("qkmap compare", "compare.json"),
    ("qkmap compare", "summary.json"),
)


def folder_writer(folder: str | os.PathLike) -> tuple[str, str] | None:
    """``(command, record file)`` of the qkmap command that wrote ``folder``, or ``None`` (new, empty, foreign)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    for command, record in WRITER_RECORDS:
        if (folder / record).is_file():
            return command, record
    return None


def check_writer(folder: str | os.PathLike, command: str, *, overwrite: bool, option: str = "--output-dir") -> None:
    """Refuse (``ValueError``) to write into a folder another qkmap command wrote, unless ``overwrite``: a train
    into a heal folder would replace the healed weights and leave the heal card describing a model that is gone."""
    found = folder_writer(folder)
    if found is None or found[0] == command or overwrite:
        return
    writer, record = found
    raise ValueError(
        f"{option} {folder} holds the output of `{writer}` ({record}); `{command}` does not replace it without "
        "--overwrite. Choose a new folder, or pass --overwrite to replace it."
    )


def check_overwrite_target(
    dst: str | os.PathLike, sources: Iterable[str | os.PathLike] = (), *, option: str = "DST"
) -> None:
    """Refuse (``ValueError``) to replace ``dst`` with ``--overwrite`` unless it is a model folder that holds
    none of: the working folder, a source, the home folder. Call only when ``dst`` exists and is not empty."""
    dst = Path(dst).expanduser()
    target = dst.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ValueError(
            f"{option} {dst} is the working folder or a parent of it; --overwrite never replaces it. "
            "Choose a new folder for the output."
        )
    home = Path.home().resolve()
    if target == home or target in home.parents:
        raise ValueError(f"{option} {dst} is the home folder or a parent of it; --overwrite never replaces it.")
    for source in sources:
        source = Path(source).expanduser().resolve()
        if target == source or target in source.parents:
            raise ValueError(f"{option} {dst} holds the source {source}; --overwrite never replaces it.")
    if not is_model_folder(target):
        raise ValueError(
            f"{option} {dst} is not empty and is not a model folder (no *.safetensors or *.gguf weights, no "
            f"{' or '.join(PROVENANCE_MARKERS)}); "
            "--overwrite replaces only a previous output. Choose a new or empty folder."
        )


def check_destination(src_dirs: list[Path], dst: Path, overwrite: bool) -> None:
    """Refuse (``ConversionError``) a model folder to write that overlaps a source, is a file, or is not empty
    without ``overwrite`` (and with it, one that ``check_overwrite_target`` protects)."""
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


def read_text_file(path: str | os.PathLike) -> str:
    """The UTF-8 text of a training file; ``ValueError`` naming the file if it is binary or not UTF-8."""
    path = Path(path)
    data = path.read_bytes()
    if b"\x00" in data[:_PROBE_BYTES]:
        raise ValueError(
            f"{path} is binary (it contains NUL bytes), not text; pass text, JSONL or dataset folders with --data."
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"{path} is not UTF-8 text (byte {error.start}, line {line}: {error.reason}); convert it to UTF-8 "
            "(e.g. iconv -t UTF-8) or remove it from --data."
        ) from error


def tokenizer_file(folder: str | os.PathLike, gguf_file: str | None = None) -> str:
    """The file that holds the tokenizer of ``folder`` (its GGUF file, else the first tokenizer file), for messages."""
    from .filenames import TOKENIZER_FILES

    folder = Path(folder)
    if gguf_file:
        return str(folder / gguf_file)
    return next((str(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()), str(folder))


def vocabulary_difference(first: dict[str, int], second: dict[str, int]) -> str | None:
    """How two token-to-id maps differ (``None``: they are the same): the sizes, else the first token whose id
    differs. Equal sizes do not make equal vocabularies: ids of another tokenizer mean other words."""
    if first == second:
        return None
    for token, index in sorted(first.items(), key=lambda item: item[1]):
        other = second.get(token)
        if other != index:
            where = "absent" if other is None else f"id {other}"
            size = f"{len(first)} vs {len(second)} tokens; " if len(first) != len(second) else ""
            return f"{size}token {token!r} is id {index} vs {where}"
    extra = next(token for token in second if token not in first)
    return f"{len(first)} vs {len(second)} tokens; token {extra!r} is absent vs id {second[extra]}"


@dataclass(frozen=True)
class Vocabulary:
    """One side of a vocabulary comparison: the tokenizer (``None``: none to compare) and the file it came from,
    the logits width (``vocab_size``; ``None``: unknown) and the file that says it."""

    tokenizer_file: str
    tokenizer: Any
    config_file: str
    width: int | None


def check_same_vocabulary(first: Vocabulary, second: Vocabulary, *, purpose: str) -> None:
    """``ValueError`` naming both files unless two models share their tokens (``purpose``: why they must)."""
    if first.width is not None and second.width is not None and first.width != second.width:
        raise ValueError(
            f"{first.config_file} and {second.config_file} do not share a vocabulary: {first.width} vs "
            f"{second.width} embedding rows (vocab_size); {purpose}."
        )
    if first.tokenizer is not None and second.tokenizer is not None:
        difference = vocabulary_difference(first.tokenizer.get_vocab(), second.tokenizer.get_vocab())
        if difference is not None:
            raise ValueError(
                f"{first.tokenizer_file} and {second.tokenizer_file} are different tokenizers ({difference}); "
                f"{purpose}."
            )


def is_typed_validation_error(error: BaseException) -> bool:
    """huggingface_hub's ``StrictDataclassError`` (transformers' configs validate through it): not a ValueError."""
    return any(klass.__name__ == "StrictDataclassError" for klass in type(error).__mro__)


@contextmanager
def named_config_errors(where: str) -> Iterator[None]:
    """Config validation errors raised inside as one ``ValueError`` line that starts with ``where`` (the file, or
    the flag, that holds the bad field); the typed errors span several lines and name no file."""
    try:
        yield
    except Exception as error:
        text = " ".join(str(error).split())
        if is_typed_validation_error(error) or (isinstance(error, ValueError) and text.startswith("QKMapConfig")):
            raise ValueError(f"{where}: {text}") from error
        raise


def check_activation(config: Any, where: str) -> None:
    """``hidden_act`` must name an activation transformers has (else building the model is a bare KeyError)."""
    import difflib

    from transformers.activations import ACT2FN

    value = getattr(config, "hidden_act", None)
    if value is not None and (not isinstance(value, str) or value not in ACT2FN):
        close = difflib.get_close_matches(str(value), list(ACT2FN), n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(sorted(ACT2FN))}."
        raise ValueError(f"{where}: field 'hidden_act' is {value!r}, not an activation transformers knows{hint}")


def load_checked_config(folder: str | os.PathLike, overrides: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """``AutoConfig.from_pretrained(folder, **kwargs, **overrides)`` whose validation errors name ``config.json``
    (and ``--config`` when ``overrides`` were given) and the field, in one line."""
    from transformers import AutoConfig

    where = str(Path(folder) / "config.json")
    if overrides:
        where += f" with --config {', '.join(overrides)}"
    with named_config_errors(where):
        config = AutoConfig.from_pretrained(folder, **kwargs, **(overrides or {}))
    check_activation(config, where)
    return config
