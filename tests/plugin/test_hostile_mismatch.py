"""Hostile mismatches, refused before any work starts in one line naming both files: a teacher whose vocabulary
or tokenizer differs from the student's (`qkmap heal`), a tokenizer larger than the embedding (`qkmap train`), a
checkpoint of another shape (`--resume`), a DST whose vocabulary is not SRC's (`qkmap verify`). And the documented
`qkmap heal --teacher GGUF_FOLDER` heals."""

from __future__ import annotations

import json
import shutil

import pytest

import qkmap_hf
from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.loading import load_gguf_causal_lm
from qkmap_hf.safety import vocabulary_difference
from qkmap_hf.tasks import data_file
from tests.eval_utils import build_tokenizer
from tests.hostile import assert_refused, run_cli, tiny_gguf, tiny_llama, tree_digest
from tests.utils import tiny_config_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")
FLAGS = ("--block-size", "32", "--batch-size", "2", "--max-steps", "2", "--disable-tqdm", "--no-eval-on-start",
         "--eval-steps", "100", "--save-steps", "0", "--max-eval-blocks", "2")  # fmt: skip


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny GGUF (the teacher), its exact conversion (the student) and a text file."""
    root = tmp_path_factory.mktemp("hostile-mismatch")
    tiny_gguf(root / "gguf")
    qkmap_hf.convert_checkpoint(root / "gguf", root / "conv", init="exact", progress=False)
    shutil.copy(data_file("haystack.txt"), root / "text.txt")
    return root


@pytest.fixture
def work(pristine, tmp_path):
    for name in ("gguf", "conv"):
        shutil.copytree(pristine / name, tmp_path / name)
    shutil.copy(pristine / "text.txt", tmp_path / "text.txt")
    (tmp_path / "secret.txt").write_text("outside every folder")
    return tmp_path


def _heal(capsys, work, teacher, *extra):
    return run_cli(capsys, "heal", work / "conv", "--teacher", teacher, "--data", work / "text.txt",
                   "--output-dir", work / "out", *FLAGS, *extra)  # fmt: skip


def test_heal_from_a_gguf_teacher_folder(work, capsys):
    """``qkmap heal CONVERTED --teacher GGUF_FOLDER`` end to end through the CLI: the teacher loads through
    qkmap_hf.loading (dequantized), distils, and the healed folder is a complete QK-MAP model that loads."""
    code, out, err = _heal(capsys, work, work / "gguf")
    assert code == 0, err
    assert "KL to teacher" in out
    record = json.loads((work / "out" / "qkmap_healing.json").read_text())
    assert record["source"] == str(work / "gguf") and record["steps"] == 2
    healed = QKMapForCausalLM.from_pretrained(work / "out")
    assert healed.config.vocab_size == 257 and (work / "out" / "README.md").is_file()


def _teacher_folder(work, tokenizer_edit=None):
    """The GGUF teacher saved as a safetensors folder, its tokenizer.json optionally edited."""
    model, tokenizer = load_gguf_causal_lm(work / "gguf", "tiny.gguf")
    model.save_pretrained(work / "teacher")
    tokenizer.save_pretrained(work / "teacher")
    if tokenizer_edit is not None:
        path = work / "teacher" / "tokenizer.json"
        document = json.loads(path.read_text())
        tokenizer_edit(document["model"]["vocab"])
        path.write_text(json.dumps(document))
    return work / "teacher"


def _swap_a_and_b(vocab):
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


def test_heal_refuses_a_teacher_with_the_same_size_but_another_tokenizer(work, capsys):
    teacher = _teacher_folder(work, _swap_a_and_b)
    before = tree_digest(work)
    code, _, err = _heal(capsys, work, teacher)
    assert_refused(code, err, f"{teacher / 'tokenizer.json'} and {work / 'conv' / 'tokenizer.json'}",
                   "different tokenizers", "token 'b' is id 97 vs id 98")  # fmt: skip
    assert tree_digest(work) == before and not (work / "out").exists()


def test_heal_refuses_a_teacher_with_another_vocabulary_size(work, capsys):
    teacher = tiny_llama(work / "llama")  # a 512-token BPE
    before = tree_digest(work)
    code, _, err = _heal(capsys, work, teacher)
    assert_refused(code, err, f"{teacher / 'config.json'} and {work / 'conv' / 'config.json'}", "512 vs 257")
    assert tree_digest(work) == before and not (work / "out").exists()


def test_heal_accepts_the_same_tokenizer_saved_as_a_folder(work, capsys):
    code, _, err = _heal(capsys, work, _teacher_folder(work))
    assert code == 0, err


def test_train_refuses_a_tokenizer_larger_than_the_embedding(work, capsys):
    build_tokenizer(work / "big-tokenizer")  # 512 tokens, the model has 257 rows
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "train", "--model", work / "conv", "--tokenizer", work / "big-tokenizer",
                           "--data", work / "text.txt", "--output-dir", work / "out", *FLAGS)  # fmt: skip
    assert_refused(code, err, str(work / "big-tokenizer" / "tokenizer.json"), "token ids up to 511",
                   f"{work / 'conv' / 'config.json'} has vocab_size 257")  # fmt: skip
    assert tree_digest(work) == before and not (work / "out").exists()


def test_resume_refuses_a_checkpoint_of_another_shape(work, capsys):
    checkpoint = work / "out" / "checkpoint-1"
    other = QKMapConfig(**tiny_config_kwargs(vocab_size=257, hidden_size=48, head_dim=12))
    QKMapForCausalLM(other).save_pretrained(checkpoint)
    (checkpoint / "trainer_state.json").write_text("{}")
    (work / "out" / "qkmap_training.json").write_text("{}")
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "train", "--model", work / "conv", "--data", work / "text.txt",
                           "--output-dir", work / "out", "--resume", *FLAGS)  # fmt: skip
    assert_refused(code, err, f"--resume {checkpoint / 'model.safetensors'} holds", "of shape [257, 48]",
                   f"{work / 'conv' / 'config.json'} has [257, 32]")  # fmt: skip
    assert tree_digest(work) == before


def test_verify_refuses_a_dst_of_another_vocabulary(work, capsys):
    teacher = _teacher_folder(work, _swap_a_and_b)
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "verify", teacher, work / "conv", "--text", work / "text.txt")
    assert_refused(code, err, f"{teacher / 'tokenizer.json'} and {work / 'conv' / 'tokenizer.json'}",
                   "different tokenizers")  # fmt: skip
    llama = tiny_llama(work / "llama")
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "verify", llama, work / "conv", "--text", work / "text.txt")
    assert_refused(code, err, f"{llama / 'config.json'} and {work / 'conv' / 'config.json'}", "512 vs 257")
    assert tree_digest(work) == before


def test_verify_accepts_the_gguf_source_of_its_conversion(work, capsys):
    """The same tokens from a GGUF (tokenizer built from its metadata) and from the converted tokenizer.json."""
    code, out, err = run_cli(capsys, "verify", work / "gguf" / "tiny.gguf", work / "conv", "--text", work / "text.txt",
                             "--max-tokens", "32", "--generate-tokens", "2", "--no-save")  # fmt: skip
    assert code == 0, err
    assert "KL(source||converted)" in out


def test_vocabulary_difference_names_the_first_token_that_moved():
    assert vocabulary_difference({"a": 0, "b": 1}, {"a": 0, "b": 1}) is None
    assert vocabulary_difference({"a": 0, "b": 1}, {"a": 1, "b": 0}) == "token 'a' is id 0 vs id 1"
    assert vocabulary_difference({"a": 0}, {"a": 0, "c": 1}) == "1 vs 2 tokens; token 'c' is absent vs id 1"
    assert vocabulary_difference({"a": 0, "z": 1}, {"a": 0}) == "2 vs 1 tokens; token 'z' is id 1 vs absent"
