"""``qkmap serve FOLDER``: an OpenAI-compatible server for a model folder on the best engine installed."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys

HELP = "Serve a model folder over an OpenAI-compatible API: vLLM if installed (or its venv built), else transformers serve."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder", help="model folder (config.json, weights, tokenizer), e.g. the output of qkmap convert"
    )
    parser.add_argument("--engine", choices=("auto", "vllm", "transformers"), default="auto",
                        help="auto: vLLM when importable here or built by scripts/setup_vllm.sh, else transformers")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument("--dtype", default="auto", help="weights dtype for the engine (default: the folder's)")
    parser.add_argument("--max-model-len", type=int, help="vLLM: longest sequence to plan the KV cache for")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM: no torch.compile (starts sooner, slower)")
    parser.add_argument("--engine-args", default="",
                        help="options for the engine's own server, as one string: --engine-args='--cb-num-blocks 64'")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..serving import serve_command, start_server

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
