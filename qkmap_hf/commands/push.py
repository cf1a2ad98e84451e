"""``qkmap push MODEL ORG/NAME``: validate the checkpoint folder, then create the repo and upload it."""

from __future__ import annotations

import argparse

HELP = "Validate a checkpoint folder (clean load without qkmap_hf, no pickles, card) and upload it to the Hub."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder (config.json, safetensors, remote-code files, README.md)")
    parser.add_argument("repo_id", help="Hub repository, ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="branch to push to (created if missing; default main)")
    parser.add_argument("--commit-message", help="commit title")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--dry-run", action="store_true", help="validate only; upload nothing")
    parser.add_argument(
        "--timeout",
        metavar="[CONNECT,]READ",
        help="seconds to wait for the Hub to connect and to answer each request (default: QKMAP_HUB_TIMEOUT, "
        "else 10,60)",
    )


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
