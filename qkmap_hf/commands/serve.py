"""``qkmap serve FOLDER``: an OpenAI-compatible server for a model folder on the best engine installed."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal

from ..flags import default_of
from ..serving import serve_command

HELP = "Serve a model folder over an OpenAI-compatible API: vLLM if installed (or its venv built), else transformers serve."


@dataclass
class ServeArguments:
    """What ``qkmap serve`` takes; the server settings' defaults are ``serve_command``'s, read from there."""

    folder: str = field(
        metadata={
            "positional": True,
            "help": "model folder (config.json, weights, tokenizer), e.g. the output of qkmap convert",
        }
    )
    engine: Literal["auto", "vllm", "transformers"] = field(
        default="auto",
        metadata={"help": "auto: vLLM when importable here or built by scripts/setup_vllm.sh, else transformers"},
    )
    host: str = field(
        default=default_of(serve_command, "host"), metadata={"help": "listen address (127.0.0.1: this machine only)"}
    )
    port: int = field(default=default_of(serve_command, "port"), metadata={"help": "listen port"})
    dtype: str = field(
        default=default_of(serve_command, "dtype"),
        metadata={"help": "weights dtype for the engine (auto: the folder's)"},
    )
    max_model_len: int | None = field(
        default=default_of(serve_command, "max_model_len"),
        metadata={"help": "vLLM: longest sequence to plan the KV cache for"},
    )
    enforce_eager: bool = field(
        default=default_of(serve_command, "enforce_eager"),
        metadata={"help": "vLLM: no torch.compile (starts sooner, slower)", "switch": True},
    )
    engine_args: str = field(
        default="",
        metadata={"help": "options for the engine's own server, as one string: --engine-args='--cb-num-blocks 64'"},
    )


def option_classes() -> tuple[type, ...]:
    return (ServeArguments,)


def run(args: argparse.Namespace) -> int:
    from ..serving import start_server

    command = serve_command(
        args.folder,
        None if args.engine == "auto" else args.engine,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        engine_args=shlex.split(args.engine_args),
    )
    print(f"serving {args.folder} with {command.engine} at {command.url} (Ctrl-C stops it)", flush=True)
    process = start_server(command)
    # SIGTERM (a supervisor, a test stopping this PID) stops the server too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return process.wait()
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
