"""What ``qkmap train`` checks before it writes anything, and how its checkpoints survive an interrupted save.

- ``check_train_options``: numbers mean what they say (``0`` is ``0`` or refused, never "the default"), and the
  output folder is neither the source checkpoint nor a folder of someone else's files.
- ``CheckpointCompletion``: after every ``checkpoint-N`` is fully written, a record of its files and sizes is
  written last (atomically); ``pick_resume_checkpoint`` takes the newest checkpoint whose files are all there
  and readable, says which one and why newer ones were skipped, and names the broken file of an explicit one.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..fileio import atomic_write_json
from ..filenames import SAFETENSORS_INDEX_NAME, SAFETENSORS_SINGLE_NAME

COMPLETION_FILE = "qkmap_checkpoint_complete.json"
TRAINER_STATE_FILE = "trainer_state.json"
OUTPUT_FILES = ("config.json", SAFETENSORS_SINGLE_NAME, SAFETENSORS_INDEX_NAME, "tokenizer.json", "README.md")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_train_options(options: Any) -> None:
    """``ValueError`` naming the flag for a value that would be silently wrong (see the module docstring)."""
    for name in ("max_steps",):
        value = getattr(options, name)
        if value == 0 or value < -1:
            raise ValueError(f"{_option(name)} {value}: train at least one step, or leave it out for one epoch.")
    positive = ("batch_size", "eval_batch_size", "block_size", "gradient_accumulation_steps", "max_tokens")
    for name in positive:
        value = getattr(options, name, None)
        if value is not None and value <= 0:
            raise ValueError(f"{_option(name)} {value}: must be a positive integer (leave it out for the default).")
    counts = ("max_eval_blocks", "save_total_limit", "dataloader_num_workers", "seed", "split_seed", "lora_r",
              "lora_alpha")  # fmt: skip
    for name in counts:  # a negative count is read as "all", "none" or a crash deep in a library
        value = getattr(options, name, None)
        if value is not None and value < 0:
            raise ValueError(f"{_option(name)} {value}: must not be negative.")
    for name, value in vars(options).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_option(name)} {value}: must be a finite number.")
    non_negative = (
        "learning_rate",
        "qkmap_learning_rate",
        "qkmap_lr_multiplier",
        "weight_decay",
        "qkmap_weight_decay",
        "warmup",
        "max_grad_norm",
        "num_train_epochs",
        "lora_dropout",
    )
    for name in non_negative:
        value = getattr(options, name, None)
        if value is not None and value < 0:
            raise ValueError(f"{_option(name)} {value}: must not be negative.")
    if not 0 <= options.eval_fraction < 1:
        raise ValueError(f"--eval-fraction {options.eval_fraction}: must lie in [0, 1).")
    from .data import check_data_paths

    if options.data:  # a FIFO, a device or a missing path: refused before any model is loaded
        check_data_paths(options.data)
    if options.num_train_epochs == 0 and options.max_steps == -1:
        raise ValueError("--num-train-epochs 0 trains nothing; give a positive number of epochs or --max-steps.")


def check_output_dir(model: str, output_dir: str, *, is_checkpoint: bool) -> None:
    """Training never writes into its source checkpoint, nor over model files it did not write.

    ``output_dir`` may be new, empty, or a previous ``qkmap train`` output (``qkmap_training.json`` or
    ``checkpoint-*`` inside); a folder with model files of another origin is refused."""
    out = Path(output_dir).expanduser().resolve()
    if is_checkpoint:
        source = Path(model).expanduser().resolve()
        if out == source or source in out.parents:
            raise ValueError(
                f"--output-dir {output_dir} is inside the source checkpoint --model {model}; training would replace "
                "its weights (and leave its old records beside them). Choose another --output-dir."
            )
    if not out.is_dir():
        return
    from .trainer import PROVENANCE_FILE

    ours = (out / PROVENANCE_FILE).is_file() or any(_CHECKPOINT.match(p.name) for p in out.iterdir())
    clashing = [name for name in OUTPUT_FILES if (out / name).exists()]
    if clashing and not ours:
        raise ValueError(
            f"--output-dir {output_dir} already holds {', '.join(clashing)} that qkmap train did not write; "
            "choose a new --output-dir (nothing was written)."
        )


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, readable checkpoint (the file at fault), or ``None``."""
    from safetensors import SafetensorError, safe_open

    state = folder / TRAINER_STATE_FILE
    if not state.is_file():
        return f"{state} is missing (the save was interrupted)"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        return f"{state} is truncated or corrupt ({error})"
    record_path = folder / COMPLETION_FILE
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            return f"{record_path} is corrupt ({error})"
        for name, size in record.get("files", {}).items():
            path = folder / name
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != size:
                return f"{path} is truncated or altered ({path.stat().st_size} bytes, {size} when saved)"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not (folder / "adapter_model.safetensors").is_file():
        return f"{folder} holds no *.safetensors weights"
    for path in weights:
        try:
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"{path} is truncated or corrupt ({error})"
    return None


class CheckpointCompletion(TrainerCallback):
    """Write ``qkmap_checkpoint_complete.json`` (files and sizes) into each checkpoint once it is fully saved."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                files = {
                    p.relative_to(folder).as_posix(): p.stat().st_size
                    for p in sorted(folder.rglob("*"))
                    if p.is_file() and p.name != COMPLETION_FILE
                }
                atomic_write_json(folder / COMPLETION_FILE, {"step": state.global_step, "files": files})
        return control


def pick_resume_checkpoint(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint ``--resume`` names: an explicit folder (refused, naming the bad file, if incomplete), or
    with ``latest`` the newest complete ``checkpoint-N`` in ``output_dir``, skipping incomplete ones."""
    if not resume:
        return None
    if resume != "latest":
        folder = Path(resume)
        if not folder.is_dir():
            raise FileNotFoundError(f"--resume {resume}: no such checkpoint folder.")
        problem = checkpoint_problem(folder)
        if problem:
            raise ValueError(f"--resume {resume}: {problem}; resume from another checkpoint.")
        return resume
    out = Path(output_dir)
    found = sorted(
        ((int(m.group(1)), p) for p in (out.iterdir() if out.is_dir() else []) if (m := _CHECKPOINT.match(p.name))),
        reverse=True,
    )
    skipped = []
    for _step, folder in found:
        if folder.is_dir() and (problem := checkpoint_problem(folder)) is None:
            note = f" (skipped incomplete: {'; '.join(skipped)})" if skipped else ""
            print(f"--resume: continuing from {folder}{note}", file=sys.stderr, flush=True)
            return str(folder)
        skipped.append(problem or f"{folder} is not a folder")
    if skipped:
        raise ValueError(f"--resume: no complete checkpoint in {output_dir}: {'; '.join(skipped)}.")
    raise FileNotFoundError(
        f"--resume: no checkpoint-* folder in {output_dir}; run without --resume, or pass the checkpoint folder."
    )
