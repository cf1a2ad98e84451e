"""Hostile training runs: never into the source checkpoint or over foreign files, 0 means 0 (or is refused),
binary input is refused naming the file, no pad token is needed, and checkpoints survive a full disk."""

from __future__ import annotations

import errno
import shutil

import pytest
from safetensors.torch import load_file

from qkmap_hf.tasks import data_file
from qkmap_hf.training.optim import QKMapTrainer
from tests.eval_utils import build_tokenizer, save_tiny_model
from tests.hostile import assert_refused, run_cli, tree_digest

LATIN_1 = "Thou art more lovely\nand more temperate: caf\xe9\n".encode("latin-1")
TRAIN_FLAGS = ("--block-size", "32", "--batch-size", "2", "--disable-tqdm", "--no-eval-on-start", "--eval-steps", "100")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny QK-MAP checkpoint whose tokenizer has no pad token, and a text file."""
    root = tmp_path_factory.mktemp("hostile-train")
    tokenizer = build_tokenizer(root / "tokenizer")
    tokenizer.pad_token = None
    save_tiny_model(root / "model", tokenizer, "qk_map", train_steps=0)
    shutil.copy(data_file("haystack.txt"), root / "text.txt")
    return root


@pytest.fixture
def work(pristine, tmp_path):
    shutil.copytree(pristine / "model", tmp_path / "model")
    shutil.copy(pristine / "text.txt", tmp_path / "text.txt")
    return tmp_path


def _train(capsys, work, *extra):
    return run_cli(capsys, "train", "--model", work / "model", "--data", work / "text.txt", *TRAIN_FLAGS, *extra)


@pytest.mark.parametrize("output", ["model", "model/run"])
def test_never_trains_into_the_source_checkpoint(output, work, capsys):
    before = tree_digest(work)
    code, _, err = _train(capsys, work, "--output-dir", work / output, "--max-steps", "1")
    assert_refused(code, err, "is inside the source checkpoint --model", "Choose another --output-dir")
    assert tree_digest(work) == before


def test_never_writes_over_model_files_it_did_not_write(work, capsys):
    other = work / "other"
    shutil.copytree(work / "model", other)  # someone else's checkpoint, no qkmap_training.json
    before = tree_digest(work)
    code, _, err = _train(capsys, work, "--output-dir", other, "--max-steps", "1")
    assert_refused(code, err, f"--output-dir {other} already holds config.json, model.safetensors")
    assert tree_digest(work) == before


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--max-steps", "0"], "--max-steps 0: train at least one step"),
        (["--max-steps", "-5"], "--max-steps -5"),
        (["--batch-size", "0"], "--batch-size 0: must be a positive integer"),
        (["--block-size", "0"], "--block-size 0: must be a positive integer"),
        (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps 0"),
        (["--learning-rate", "nan"], "--learning-rate nan: must be a finite number"),
        (["--qkmap-learning-rate", "-1"], "--qkmap-learning-rate -1.0: must not be negative"),
        (["--eval-fraction", "1"], "--eval-fraction 1.0: must lie in [0, 1)"),
        (["--num-train-epochs", "0"], "--num-train-epochs 0 trains nothing"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_numbers_mean_what_they_say(flags, named, work, capsys):
    before = tree_digest(work)
    code, _, err = _train(capsys, work, "--output-dir", work / "out", *flags)
    assert_refused(code, err, named)
    assert tree_digest(work) == before and not (work / "out").exists()


@pytest.mark.parametrize(
    "content, named",
    [
        (b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)) * 4, "is binary (it contains NUL bytes)"),
        (LATIN_1, f"is not UTF-8 text (byte {LATIN_1.index(0xE9)}, line 2"),
    ],
    ids=["binary", "latin-1"],
)
def test_non_text_training_input_is_refused_naming_the_file(content, named, work, capsys):
    (work / "corpus").mkdir()
    shutil.copy(work / "text.txt", work / "corpus" / "a.txt")
    (work / "corpus" / "b.txt").write_bytes(content)
    before = tree_digest(work)
    code, _, err = run_cli(
        capsys,
        "train",
        "--model",
        work / "model",
        "--data",
        work / "corpus",
        "--output-dir",
        work / "out",
        "--max-steps",
        "1",
        *TRAIN_FLAGS,
    )
    assert_refused(code, err, str(work / "corpus" / "b.txt"), named)
    assert tree_digest(work) == before and not (work / "out").exists()


@pytest.mark.slow
def test_zero_qkmap_learning_rate_is_zero_and_no_pad_token_is_needed(work, capsys):
    """`--qkmap-learning-rate 0` froze the QK-MAP parameters (it used to train them at the default rate), and a
    tokenizer without a pad token trains (packed blocks need no padding)."""
    source_digest = tree_digest(work / "model")
    code, out, err = _train(
        capsys,
        work,
        "--output-dir",
        work / "out",
        "--max-steps",
        "3",
        "--learning-rate",
        "1e-2",
        "--qkmap-learning-rate",
        "0",
    )
    assert code == 0, err
    before, after = load_file(work / "model" / "model.safetensors"), load_file(work / "out" / "model.safetensors")
    qkmap = [name for name in before if name.endswith(("log_frequency", "query_gain", "key_gain"))]
    others = [name for name in before if name not in qkmap and name in after]
    assert qkmap and all((before[n] == after[n]).all() for n in qkmap)
    assert sum(not (before[n] == after[n]).all() for n in others) > len(others) // 2  # the rest did train
    assert tree_digest(work / "model") == source_digest


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_then_resume_and_truncation(work, capsys, monkeypatch):
    out = work / "out"
    flags = ("--output-dir", out, "--max-steps", "4", "--save-steps", "2", "--save-total-limit", "5")
    original = QKMapTrainer._save_rng_state

    def disk_fills_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", f"{output_dir}/rng_state.pth")
        return original(self, output_dir)

    monkeypatch.setattr(QKMapTrainer, "_save_rng_state", disk_fills_at_step_4)
    code, _, err = _train(capsys, work, *flags)
    assert_refused(code, err, "rng_state.pth: No space left on device", "free some disk space")
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-4" / "trainer_state.json").exists()
    monkeypatch.setattr(QKMapTrainer, "_save_rng_state", original)

    # --resume skips the half-written checkpoint-4, says so, and finishes from checkpoint-2
    code, _, err = _train(capsys, work, *flags, "--resume")
    assert code == 0, err
    assert f"continuing from {out / 'checkpoint-2'}" in err and "checkpoint-4/trainer_state.json is missing" in err
    assert (out / "checkpoint-4" / "qkmap_checkpoint_complete.json").is_file()

    # a truncated weight file: named when resumed from explicitly, skipped by `--resume` (latest)
    weights = out / "checkpoint-4" / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    before = tree_digest(out)
    code, _, err = _train(capsys, work, *flags, "--resume", out / "checkpoint-4")
    assert_refused(code, err, f"--resume {out / 'checkpoint-4'}: {weights} is truncated")
    assert tree_digest(out) == before
    code, _, err = _train(capsys, work, *flags, "--resume")
    assert code == 0, err
    assert f"continuing from {out / 'checkpoint-2'}" in err and f"{weights} is truncated" in err


@pytest.mark.parametrize(
    "line, named",
    [
        (LATIN_1, "is not UTF-8 text"),
        (b'{"text": "unterminated\n', ":1 is not JSON"),
        (b"[1, 2]\n", ":1 is a JSON list"),
    ],
    ids=["latin-1", "broken-json", "not-an-object"],
)
def test_bad_jsonl_is_refused_naming_the_file(line, named, work, capsys):
    (work / "data.jsonl").write_bytes(line)
    before = tree_digest(work)
    code, _, err = run_cli(
        capsys,
        "train",
        "--model",
        work / "model",
        "--data",
        work / "data.jsonl",
        "--output-dir",
        work / "out",
        "--max-steps",
        "1",
        *TRAIN_FLAGS,
    )
    assert_refused(code, err, f"{work / 'data.jsonl'}", named)
    assert tree_digest(work) == before and not (work / "out").exists()
