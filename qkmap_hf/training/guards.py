"""What ``qkmap train`` checks before it writes anything, and how its checkpoints survive an interrupted save.

- ``check_train_options``: numbers mean what they say (``0`` is ``0`` or refused, never "the default"), and the
  output folder is neither the source checkpoint nor a folder of someone else's files.
- ``CheckpointCompletion``: after every ``checkpoint-N`` is fully written, a record of its files and sizes is
  written last (atomically); ``pick_resume_checkpoint`` takes the newest checkpoint whose files are all there
  and readable, says which one and why newer ones were skipped, and names the broken file of an explicit one.
- ``save_failed``: a failed checkpoint or final save (a full disk, mostly) as one line naming the folder and the
  free space it needs, instead of a traceback from deep inside the Trainer.
"""

from __future__ import annotations

import errno
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..fileio import atomic_write_json
from ..filenames import PROVENANCE_FILES, SAFETENSORS_INDEX_NAME, SAFETENSORS_SINGLE_NAME

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
              "lora_alpha", "monitor_steps")  # fmt: skip
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
    ours = (out / PROVENANCE_FILES["training"]).is_file() or any(_CHECKPOINT.match(p.name) for p in out.iterdir())
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


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class SaveFailedError(OSError):
    """A save that could not complete; ``str()`` is the whole message (``qkmap_hf.cli`` prints it as it is)."""

    def __init__(self, code: int | None, message: str):
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _is_full_disk(error: BaseException) -> bool:
    """ENOSPC and kin, also when safetensors' Rust writer reports it as text rather than as an ``OSError``."""
    if isinstance(error, OSError) and error.errno in _NO_SPACE:
        return True
    text = str(error)
    return "No space left" in text or "StorageFull" in text or "code: 28" in text


def state_bytes(model: Any, optimizer: Any = None) -> int:
    """Bytes a checkpoint of ``model`` (and ``optimizer``'s state) takes on disk, about."""
    import torch

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in getattr(optimizer, "state", {}).values():
        total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total


def save_failed(
    folder: str | Path, error: BaseException, needed: int, what: str = "checkpoint", staged: Path | None = None
) -> SaveFailedError:
    """One line for a failed save into ``folder``: the cause (with the file at fault, named in ``folder`` rather
    than in the hidden ``staged`` folder it was written to), for a full disk the space needed and free, and how to
    go on."""
    folder = Path(folder)
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        cause = f"{error.filename}: {error.strerror}"
    else:
        cause = " ".join(str(error).split()) or type(error).__name__
    if staged is not None:
        cause = cause.replace(str(staged), str(folder))
    message = f"could not save the {what} {folder}: {cause}"
    code = getattr(error, "errno", None)
    if _is_full_disk(error):
        code = code or errno.ENOSPC
        probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
        free = shutil.disk_usage(probe).free
        message += (
            f"; free some disk space: it needs about {_megabytes(needed)} free on that disk, {_megabytes(free)} "
            "are free now"
        )
    if what == "checkpoint":
        message += (
            ". Run again with --resume: it continues from the last complete checkpoint (this incomplete one is "
            "skipped)."
        )
    else:
        message += ". The output folder was left as it was."
    return SaveFailedError(code, message)
