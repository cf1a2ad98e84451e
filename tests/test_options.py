"""Options declared once: the flags of train, heal and compare are built from the option dataclasses' fields."""

from __future__ import annotations

import dataclasses

import pytest

from qkmap_hf.cli import build_parser
from qkmap_hf.cli import main as cli_main
from qkmap_hf.commands.compare import TuningFlags
from qkmap_hf.flags import options_from_namespace
from qkmap_hf.training.compare import CompareOptions, Variant
from qkmap_hf.training.heal import HealOptions
from qkmap_hf.training.options import TRAINING_ARGUMENT_NAMES, TrainOptions
from qkmap_hf.training.trainer import training_arguments

OPTION_CLASSES = {
    "train": (TrainOptions,),
    "heal": (TrainOptions, HealOptions),
    "compare": (CompareOptions, TuningFlags),
}


def _parse(command: str, argv: list[str]):
    return build_parser().parse_args([command, *argv])


def test_train_flags_in_the_documented_spellings_give_the_expected_options():
    args = _parse("train", [
        "--model", "tiny", "--data", "a.txt", "b.txt", "--output-dir", "out", "--max-steps", "60",
        "--no-eval-on-start", "--resume", "--config", "qkmap_min_frequency=0.1", "--config", "qkmap_init=native",
        "--warmup", "10", "--logging-steps", "0.5", "--eval-steps", "20", "--lora", "--no-lora-train-qk",
        "--lora-target-modules", "q_proj", "k_proj", "--bf16", "no", "--qk-mode", "qk_norm", "--batch_size", "4",
    ])  # fmt: skip
    expected = TrainOptions(
        model="tiny", data=["a.txt", "b.txt"], output_dir="out", max_steps=60, eval_on_start=False, resume="latest",
        config={"qkmap_min_frequency": 0.1, "qkmap_init": "native"}, warmup=10, logging_steps=0.5, eval_steps=20,
        lora=True, lora_train_qk=False, lora_target_modules=["q_proj", "k_proj"], bf16="no", qk_mode="qk_norm",
        batch_size=4,
    )  # fmt: skip
    options = options_from_namespace(TrainOptions, args)
    assert options == expected
    assert isinstance(options.warmup, int) and isinstance(options.eval_steps, int)  # steps, not a fraction


def test_flag_defaults_are_the_dataclass_defaults():
    options = options_from_namespace(
        TrainOptions, _parse("train", ["--model", "m", "--data", "d", "--output-dir", "o"])
    )
    assert options == TrainOptions(model="m", data=["d"], output_dir="o")
    args = _parse("compare", ["--data", "d", "--output-dir", "o"])
    assert options_from_namespace(CompareOptions, args) == CompareOptions(data=["d"], output_dir="o")
    assert options_from_namespace(TuningFlags, args) == TuningFlags()


def test_resume_takes_an_optional_folder_and_bools_take_yes_no():
    args = _parse("train", ["--model", "m", "--data", "d", "--output-dir", "o", "--resume", "o/checkpoint-6",
                            "--disable-tqdm", "--fsdp", "no", "--eval-on-start", "false"])  # fmt: skip
    assert (args.resume, args.disable_tqdm, args.fsdp, args.eval_on_start) == ("o/checkpoint-6", True, False, False)


def test_a_bare_switch_before_a_positional_leaves_the_positional_alone():
    args = _parse("heal", ["--lora", "conv", "--teacher", "src", "--data", "d", "--output-dir", "o", "--disable-tqdm"])
    assert (args.converted, args.lora, args.disable_tqdm) == ("conv", True, True)
    args = _parse("heal", ["--lora", "no", "conv", "--teacher", "src", "--data", "d", "--output-dir", "o"])
    assert (args.converted, args.lora) == ("conv", False)
    args = _parse("heal", ["--lora=false", "conv", "--teacher", "src", "--data", "d", "--output-dir", "o"])
    assert (args.converted, args.lora) == ("conv", False)


def test_heal_flags_fill_both_option_classes():
    args = _parse("heal", [
        "conv", "--teacher", "src", "--data", "d", "--output-dir", "o", "--phase-ramp", "0:0.3",
        "--norm-ramp", "0.1:0.9", "--keep-inverse-frequency-gains", "--layerwise", "--kl-weight-end", "0.5",
        "--max-steps", "12",
    ])  # fmt: skip
    assert args.converted == "conv" and args.model is None  # run() puts CONVERTED in --model's place
    assert options_from_namespace(HealOptions, args) == HealOptions(
        teacher="src", phase_ramp=(0.0, 0.3), norm_ramp=(0.1, 0.9), native_gains=False, layerwise=True,
        kl_weight_end=0.5,
    )  # fmt: skip
    assert options_from_namespace(TrainOptions, args).max_steps == 12


def test_compare_variants_config_and_tuning_grid_repeat():
    args = _parse("compare", [
        "--data", "d", "--output-dir", "o", "--variant", "qk_map", "--variant", "wide:qk_mode=qk_map,learning_rate=0.01",
        "--config", "qkmap_num_frequencies=2", "--tune", "learning_rate=1e-3,2e-3", "--tune", "qk_lr_multiplier=1,10",
        "--tuning-seeds", "2", "--save-models",
    ])  # fmt: skip
    options = options_from_namespace(CompareOptions, args)
    assert options.variants == [Variant("qk_map", "qk_map"), Variant("wide", "qk_map", {}, {"learning_rate": 0.01})]
    assert options.config == {"qkmap_num_frequencies": 2}
    assert options_from_namespace(TuningFlags, args) == TuningFlags(
        tune=["learning_rate=1e-3,2e-3", "qk_lr_multiplier=1,10"], tuning_seeds=2, save_models=True
    )


@pytest.mark.parametrize("command", OPTION_CLASSES)
def test_every_option_has_help_and_appears_in_help(command, capsys):
    with pytest.raises(SystemExit):
        _parse(command, ["--help"])
    text = capsys.readouterr().out
    for cls in OPTION_CLASSES[command]:
        for option in dataclasses.fields(cls):
            assert len(option.metadata.get("help", "")) > 5, f"{cls.__name__}.{option.name} has no help"
            if command == "heal" and option.name == "model":
                continue  # the positional CONVERTED stands for it
            assert "--" + option.name.replace("_", "-") in text, option.name


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--config", "no_equals_sign"], "FIELD=VALUE"),
        (["--warmup", "ten"], "--warmup 'ten'"),
    ],
)
def test_unparsable_values_are_one_line_refusals_naming_the_flag(flags, message, capsys):
    code = cli_main(["train", "--model", "tiny", "--data", "d", "--output-dir", "o", *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_heal_window_must_be_start_colon_end(capsys):
    code = cli_main(["heal", "conv", "--teacher", "t", "--data", "d", "--output-dir", "o", "--phase-ramp", "0.5"])
    assert code == 2 and "--phase-ramp '0.5'" in capsys.readouterr().err


def test_training_arguments_take_the_shared_options_without_hand_copies(tmp_path):
    from transformers import TrainingArguments

    options = TrainOptions(
        model="tiny", data=["d"], output_dir=str(tmp_path), num_train_epochs=3.0, gradient_accumulation_steps=3,
        weight_decay=0.123, adam_beta2=0.9, lr_scheduler="linear", warmup=7, max_grad_norm=0.5, seed=11,
        gradient_checkpointing=True, logging_steps=3, save_total_limit=4, dataloader_num_workers=1,
        disable_tqdm=True,
    )  # fmt: skip
    args = training_arguments(options, {"batch_size": 2, "learning_rate": 1e-3}, model=None, has_eval=True)
    trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    shared = [
        f.name
        for f in dataclasses.fields(TrainOptions)
        if TRAINING_ARGUMENT_NAMES.get(f.name, f.name) in trainer_fields
    ]
    assert {"seed", "weight_decay", "lr_scheduler", "warmup", "gradient_checkpointing"} <= set(shared)
    assert args.output_dir == str(tmp_path) and args.num_train_epochs == 3.0 and args.gradient_accumulation_steps == 3
    assert args.weight_decay == 0.123 and args.adam_beta2 == 0.9 and args.max_grad_norm == 0.5
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "linear"
    assert args.warmup_steps == 7 and args.seed == 11 and args.data_seed == 11
    assert args.activation_checkpointing is True and args.logging_steps == 3 and args.save_total_limit == 4
    assert args.dataloader_num_workers == 1 and args.disable_tqdm is True
    # derived here, not copied: the resolved batch and rate, evaluation only with a held-out split
    assert args.per_device_train_batch_size == 2 and args.per_device_eval_batch_size == 2 and args.learning_rate == 1e-3
    assert args.eval_steps == 0.1
    no_eval = training_arguments(options, {"batch_size": 2, "learning_rate": 1e-3}, model=None, has_eval=False)
    assert (
        str(getattr(no_eval.eval_strategy, "value", no_eval.eval_strategy)) == "no" and no_eval.eval_on_start is False
    )
