"""Hostile values, refused where they enter in one line naming the file, line, field or flag, with every file
(also outside the folders) unchanged: booleans that are not booleans, misspelt qkmap_* fields, typed validation
errors of transformers/huggingface_hub, an unknown hidden_act, NaN and out-of-range floats and negative counts of
heal/analyze/compare/eval, JSONL text that is not a string, --data that is a FIFO or a device. A data file that
is all whitespace is warned about."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoConfig

from qkmap_hf import QKMapConfig
from qkmap_hf.cli import build_parser
from qkmap_hf.flags import parse_overrides
from qkmap_hf.training.data import build_datasets, byte_level_tokenizer
from tests.eval_utils import save_tiny_model
from tests.hostile import assert_refused, run_cli, tiny_llama, tree_digest
from tests.utils import tiny_config_kwargs

BOOLEAN_FIELDS = [n for n in QKMapConfig.qkmap_field_names() if n in QKMapConfig.boolean_field_names()]
NULLABLE_BOOLEAN_FIELDS = [n for n in QKMapConfig.qkmap_field_names() if n in QKMapConfig.boolean_field_names(True)]
TRAIN_FLAGS = ("--block-size", "16", "--batch-size", "2", "--max-steps", "1", "--disable-tqdm", "--no-eval-on-start",
               "--eval-steps", "100", "--save-steps", "0")  # fmt: skip


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-validation")
    save_tiny_model(root / "model", byte_level_tokenizer(), "qk_map", train_steps=0)
    tiny_llama(root / "llama")
    return root


@pytest.fixture
def work(pristine, tmp_path):
    shutil.copytree(pristine / "model", tmp_path / "model")
    shutil.copytree(pristine / "llama", tmp_path / "llama")
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    (tmp_path / "secret.txt").write_text("outside every folder")
    return tmp_path


def _edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _train(capsys, work, model, *extra):
    return run_cli(capsys, "train", "--model", model, "--data", work / "text.txt", "--output-dir", work / "out",
                   *TRAIN_FLAGS, *extra)  # fmt: skip


# ---- booleans ------------------------------------------------------------------------------------


def test_every_boolean_qkmap_field_is_covered():
    assert {"qkmap_learnable_frequencies", "qkmap_input_norm", "qkmap_rotate_cos_blocks"} <= set(BOOLEAN_FIELDS)


@pytest.mark.parametrize("field", BOOLEAN_FIELDS)
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_boolean_fields_accept_only_booleans(field, value):
    with pytest.raises(ValueError, match=f"QKMapConfig.{field}={value!r} is invalid"):
        QKMapConfig(**tiny_config_kwargs(**{field: value}))


@pytest.mark.parametrize("field", NULLABLE_BOOLEAN_FIELDS)
@pytest.mark.parametrize("value", ["no", "null", 0, 1])
def test_nullable_boolean_fields_accept_booleans_and_none_only(field, value):
    with pytest.raises(ValueError, match=f"QKMapConfig.{field}={value!r} is invalid; use true, false or null"):
        QKMapConfig(**tiny_config_kwargs(**{field: value}))
    for allowed in (True, False, None):
        assert getattr(QKMapConfig(**tiny_config_kwargs(**{field: allowed})), field) is allowed


def test_nullable_boolean_overrides_parse_null_and_refuse_words():
    assert NULLABLE_BOOLEAN_FIELDS == ["qkmap_recompute_projections"]
    parsed = parse_overrides(["qkmap_recompute_projections=null", "qkmap_input_norm=yes"])
    assert parsed == {"qkmap_recompute_projections": None, "qkmap_input_norm": True}
    assert parse_overrides(["qkmap_recompute_projections=No"]) == {"qkmap_recompute_projections": False}
    with pytest.raises(ValueError, match="qkmap_recompute_projections is a boolean field; .* or null for its default"):
        parse_overrides(["qkmap_recompute_projections=auto"])
    with pytest.raises(ValueError, match=r"qkmap_input_norm is a boolean field; use true/false \(or 1/0, yes/no\)\.$"):
        parse_overrides(["qkmap_input_norm=null"])


def test_a_string_boolean_in_config_json_is_refused_naming_the_file(work, capsys):
    _edit_config(work / "model", qkmap_learnable_frequencies="no")
    before = tree_digest(work)
    code, _, err = _train(capsys, work, work / "model")
    assert_refused(code, err, str(work / "model" / "config.json"), "qkmap_learnable_frequencies='no'", "true or false")
    assert tree_digest(work) == before and not (work / "out").exists()


@pytest.mark.parametrize("word, value", [("true", True), ("No", False), ("1", True), ("0", False), ("yes", True)])
def test_config_flag_converts_boolean_words(word, value):
    args = build_parser().parse_args(
        [
            "train",
            "--model",
            "tiny",
            "--data",
            "x",
            "--output-dir",
            "o",
            "--config",
            f"qkmap_learnable_frequencies={word}",
        ]
    )
    assert args.config == {"qkmap_learnable_frequencies": value}


def test_config_flag_refuses_other_boolean_words(work, capsys):
    before = tree_digest(work)
    code, _, err = _train(capsys, work, "tiny", "--config", "qkmap_learnable_frequencies=maybe")
    assert_refused(code, err, "--config 'qkmap_learnable_frequencies=maybe'", "is a boolean field")
    assert tree_digest(work) == before and not (work / "out").exists()


# ---- unknown and mistyped fields -----------------------------------------------------------------


def test_a_misspelt_qkmap_field_is_refused_with_the_closest_name(work, capsys):
    before = tree_digest(work)
    code, _, err = _train(capsys, work, "tiny", "--config", "qkmap_min_frequncy=0.2")
    assert_refused(code, err, "--config 'qkmap_min_frequncy=0.2'", "did you mean qkmap_min_frequency?")
    _edit_config(work / "model", qkmap_learnable_frequncies=False)
    before = tree_digest(work)
    code, _, err = _train(capsys, work, work / "model")
    assert_refused(code, err, str(work / "model" / "config.json"), "'qkmap_learnable_frequncies'",
                   "did you mean qkmap_learnable_frequencies?")  # fmt: skip
    assert tree_digest(work) == before and not (work / "out").exists()


def test_typed_validation_errors_are_one_line_naming_the_file_and_field(work, capsys):
    _edit_config(work / "llama", hidden_size="wide")
    before = tree_digest(work)
    code, _, err = _train(capsys, work, work / "llama")
    assert_refused(code, err, str(work / "llama" / "config.json"), "field 'hidden_size'", "expected int, got str")
    code, _, err = _train(capsys, work, work / "model", "--config", 'num_hidden_layers="two"')
    assert_refused(code, err, f"{work / 'model' / 'config.json'} with --config num_hidden_layers",
                   "field 'num_hidden_layers'")  # fmt: skip
    assert tree_digest(work) == before and not (work / "out").exists()


@pytest.mark.parametrize("folder", ["llama", "model"])
def test_an_unknown_hidden_act_is_refused_naming_the_file(folder, work, capsys):
    _edit_config(work / folder, hidden_act="swishh")
    before = tree_digest(work)
    code, _, err = _train(capsys, work, work / folder)
    assert_refused(code, err, str(work / folder / "config.json"), "hidden_act", "'swishh'", "did you mean")
    assert tree_digest(work) == before and not (work / "out").exists()
    with pytest.raises(ValueError, match="hidden_act='swishh' is not an activation"):
        AutoConfig.from_pretrained(work / "model") if folder == "model" else QKMapConfig(hidden_act="swishh")


# ---- floats and counts of every command ----------------------------------------------------------

HEAL = ["heal", "{tmp}/model", "--teacher", "{tmp}/model", "--data", "{tmp}/text.txt", "--output-dir", "{tmp}/out"]
ANALYZE = ["analyze", "{tmp}/model", "--text", "{tmp}/text.txt", "--output-dir", "{tmp}/out"]
COMPARE = ["compare", "--data", "{tmp}/text.txt", "--output-dir", "{tmp}/out"]
EVAL = ["eval", "{tmp}/model", "--tasks", "qkmap_next_line", "--output-path", "{tmp}/out"]
TRAIN = ["train", "--model", "{tmp}/model", "--data", "{tmp}/text.txt", "--output-dir", "{tmp}/out"]
VERIFY = ["verify", "{tmp}/llama", "{tmp}/model", "--text", "{tmp}/text.txt", "--no-save"]
CONVERT = ["convert", "{tmp}/llama", "{tmp}/out", "--verify", "{tmp}/text.txt", "--no-progress"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (HEAL + ["--alpha", "nan"], "--alpha nan: must be a finite number"),
        (HEAL + ["--alpha", "0"], "--alpha 0.0: must be positive"),
        (HEAL + ["--kl-weight", "inf"], "--kl-weight inf: must be a finite number"),
        (HEAL + ["--kl-weight-end", "-1"], "--kl-weight-end -1.0: must not be negative"),
        (HEAL + ["--cos-share", "1.5"], "--cos-share 1.5: must lie in [0, 1]"),
        (HEAL + ["--phase-ramp", "0:nan"], "--phase-ramp 0.0:nan: must be a finite number"),
        (HEAL + ["--phase-ramp", "0.6:0.2"], "--phase-ramp 0.6:0.2: START must not exceed END"),
        (HEAL + ["--switch-on-ramp", "0:2"], "--switch-on-ramp 0.0:2.0: must lie in [0, 1]"),
        (HEAL + ["--recalibrate-every", "-1"], "--recalibrate-every -1: must not be negative"),
        (HEAL + ["--calibration-blocks", "-2"], "--calibration-blocks -2: must be positive"),
        (HEAL[:3] + ["{tmp}/no-teacher"] + HEAL[4:] + ["--max-steps", "0"], "--max-steps 0"),  # before the teacher
        (ANALYZE + ["--scales", "nan"], "--scales (nan,): must be finite positive factors"),
        (ANALYZE + ["--scales", "2,inf"], "--scales (2.0, inf): must be finite positive factors"),
        (ANALYZE + ["--num-windows", "-1"], "--num-windows -1: must be positive"),
        (ANALYZE + ["--seed", "-3"], "--seed -3: must not be negative"),
        (COMPARE + ["--learning-rate", "nan"], "--learning-rate nan: must be a finite number"),
        (COMPARE + ["--weight-decay", "-0.1"], "--weight-decay -0.1: must not be negative"),
        (COMPARE + ["--eval-fraction", "1"], "--eval-fraction 1.0: must lie in [0, 1)"),
        (COMPARE + ["--first-seed", "-1"], "--first-seed -1: must not be negative"),
        (COMPARE + ["--tuning-seeds", "0"], "--tuning-seeds 0: must be positive"),
        (EVAL + ["--limit", "-3"], "--limit -3: must be positive"),
        (EVAL + ["--limit=nan"], "--limit nan: must be a finite number"),
        (EVAL + ["--num-fewshot", "-1"], "--num_fewshot -1: must be at least 0"),
        (EVAL + ["--batch-size", "0"], "--batch_size 0: must be positive"),
        (EVAL + ["--batch-size", "auto:-2"], "--batch_size -2: must be positive"),
        (TRAIN + ["--max-eval-blocks", "-1"], "--max-eval-blocks -1: must not be negative"),
        (TRAIN + ["--save-total-limit", "-2"], "--save-total-limit -2: must not be negative"),
        (TRAIN + ["--seed", "-5"], "--seed -5: must not be negative"),
        (VERIFY + ["--max-tokens", "-8"], "--max-tokens -8: must be at least 2"),
        (VERIFY + ["--generate-tokens", "-1"], "--generate-tokens -1: must not be negative"),
        (CONVERT + ["--max-tokens", "1"], "--max-tokens 1: must be at least 2"),
    ],
    ids=lambda v: " ".join(v[8:]) if isinstance(v, list) else None,
)
def test_floats_and_counts_are_finite_and_in_range(argv, named, work, capsys):
    before = tree_digest(work)
    code, _, err = run_cli(capsys, *[a.format(tmp=work) for a in argv])
    assert_refused(code, err, named)
    assert tree_digest(work) == before and not (work / "out").exists()


# ---- data ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, 7, ["a list"], {"nested": "text"}])
def test_jsonl_text_must_be_a_string(text, work, capsys):
    records = [{"text": "a fine line"}, {"text": text}]
    (work / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "train", "--model", work / "model", "--data", work / "data.jsonl",
                           "--output-dir", work / "out", *TRAIN_FLAGS)  # fmt: skip
    assert_refused(code, err, f"{work / 'data.jsonl'}:2: field 'text' is {json.dumps(text)}", "not a string")
    assert tree_digest(work) == before and not (work / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_non_regular_data_files_are_refused_up_front(kind, work, capsys):
    if kind == "fifo":
        data = work / "pipe.txt"
        os.mkfifo(data)  # reading it would block forever
    else:
        data = "/dev/zero"  # reading it would never end
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "train", "--model", work / "model", "--data", work / "text.txt", "--data", data,
                           "--output-dir", work / "out", *TRAIN_FLAGS)  # fmt: skip
    assert_refused(code, err, f"--data {data} is a", "not a regular file or a folder")
    assert tree_digest(work) == before and not (work / "out").exists()


def test_all_whitespace_data_files_are_warned_about(work, capsys):
    (work / "blank.txt").write_text("  \n\t\n\n")
    (work / "blank.jsonl").write_text("\n   \n")
    capsys.readouterr()
    train, _, _ = build_datasets([work / "text.txt", work / "blank.txt", work / "blank.jsonl"],
                                 byte_level_tokenizer(), 16)  # fmt: skip
    err = capsys.readouterr().err
    assert f"warning: --data {work / 'blank.txt'} holds only whitespace" in err
    assert f"warning: --data {work / 'blank.jsonl'} holds only whitespace" in err
    assert f"--data {work / 'text.txt'}" not in err and len(train) > 0
