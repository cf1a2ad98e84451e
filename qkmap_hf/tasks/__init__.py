"""The bundled lm-eval task pack: YAML task configs in this folder, their data in ``data/``.

Everything resolves relative to this package, never to the working directory, so the pack works from any folder
and from an installed wheel. ``qkmap eval`` adds this folder to lm-eval's ``--include_path`` by itself; from Python
use ``lm_eval.tasks.TaskManager(include_path=qkmap_hf.lm_eval.task_pack_dir())``.

Tasks (tag ``qkmap_local`` runs all but the generic ``qkmap_needle``):

- ``qkmap_shakespeare_ppl``: rolling log-likelihood over passages of *The Tempest* (word/byte perplexity, bits/byte).
- ``qkmap_next_line``: which of four lines follows four lines of a speech (*Macbeth*, *Othello*); acc, acc_norm.
- ``qkmap_needle_256``/``_512``/``_1024``: synthetic long-context evidence retrieval: a fact hidden in about N words
  of *Julius Caesar*, then a question about it (multiple choice over four numbers).
- ``qkmap_needle``: the same at any length: ``--metadata needle_words=4096`` (default 512).
"""

from __future__ import annotations

from pathlib import Path

TASK_PACK_DIR = Path(__file__).resolve().parent
DATA_DIR = TASK_PACK_DIR / "data"
TASK_NAMES = (
    "qkmap_shakespeare_ppl",
    "qkmap_next_line",
    "qkmap_needle_256",
    "qkmap_needle_512",
    "qkmap_needle_1024",
    "qkmap_needle",
)
TAG = "qkmap_local"


def task_pack_dir() -> Path:
    """Folder to pass to lm-eval as ``include_path`` (YAML configs of the bundled tasks)."""
    return TASK_PACK_DIR


def data_file(name: str) -> Path:
    """Path of a bundled data file; a clear error if the installation lacks it."""
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"Task data {path} is missing; the qkmap-hf installation is incomplete (the wheel must include "
            "qkmap_hf/tasks/data/*). Rebuild it with `python -m qkmap_hf.tasks.build_data`."
        )
    return path


__all__ = ["DATA_DIR", "TAG", "TASK_NAMES", "TASK_PACK_DIR", "data_file", "task_pack_dir"]
