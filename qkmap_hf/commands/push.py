"""``qkmap push MODEL ORG/NAME``: validate the checkpoint folder, then create the repo and upload it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

HELP = "Validate a checkpoint folder (clean load without qkmap_hf, no pickles, card) and upload it to the Hub."


@dataclass
class PushArguments:
    """What ``qkmap push`` takes: ``push_to_hub``'s inputs, one flag each (their defaults are the Hub's)."""

    model: str = field(
        metadata={
            "positional": True,
            "help": "checkpoint folder (config.json, safetensors, remote-code files, README.md)",
        }
    )
    repo_id: str = field(metadata={"positional": True, "help": "Hub repository, ORG/NAME"})
    private: bool = field(default=False, metadata={"help": "create the repository as private", "switch": True})
    revision: str | None = field(
        default=None, metadata={"help": "branch to push to (created if missing; default main)"}
    )
    commit_message: str | None = field(default=None, metadata={"help": "commit title"})
    token: str | None = field(default=None, metadata={"help": "Hub token (default: HF_TOKEN or the saved login)"})
    dry_run: bool = field(default=False, metadata={"help": "validate only; upload nothing", "switch": True})
    timeout: str | None = field(
        default=None,
        metadata={
            "help": "seconds to wait for the Hub to connect and to answer each request (default: QKMAP_HUB_TIMEOUT, "
            "else 10,60)",
            "metavar": "[CONNECT,]READ",
        },
    )


def option_classes() -> tuple[type, ...]:
    return (PushArguments,)


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``): no one writes it while it uploads."""
    return args.model


def run(args: argparse.Namespace) -> int:
    """Validate, then upload; refusals (a failed validation included, exit code 1) go through ``cli.main``."""
    from ..hub import PushValidationError, check_repo_id, files_to_upload, push_to_hub, validate_for_push
    from .paths import require_path

    check_repo_id(args.repo_id)
    require_path("MODEL", args.model, "checkpoint folder")
    if args.dry_run:
        problems = validate_for_push(args.model)
        if problems:
            raise PushValidationError(args.model, problems)
        files = files_to_upload(args.model)
        print(f"{args.model} is ready to push ({len(files)} files):")
        for name in files:
            print(f"  {name}")
        return 0
    info = push_to_hub(
        args.model,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        token=args.token,
        timeout=args.timeout,
    )
    print(f"pushed {args.model} to {args.repo_id}: {info.commit_url}")
    return 0
