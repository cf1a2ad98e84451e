"""Options declared once: the flags of train, heal and compare are built from the option dataclasses' fields."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

import qkmap_hf.commands
from qkmap_hf.cli import COMMANDS, build_parser
from qkmap_hf.cli import main as cli_main
from qkmap_hf.flags import options_from_namespace
from qkmap_hf.training.compare import CompareOptions, Variant
from qkmap_hf.training.heal import HealOptions
from qkmap_hf.training.options import SHARED_GROUPS, TRAINING_ARGUMENT_NAMES, TrainOptions
from qkmap_hf.training.sweep import TuningOptions
from qkmap_hf.training.trainer import training_arguments

OPTION_CLASSES = {
    "train": (TrainOptions,),
    "heal": (TrainOptions, HealOptions),
    "compare": (CompareOptions, TuningOptions),
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
    assert options_from_namespace(TuningOptions, args) == TuningOptions()


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
    assert options_from_namespace(TuningOptions, args) == TuningOptions(
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


# --------------------------------------------------------------------------------------------------
# Every command's flags come from option dataclasses; each default is declared once (issue 21)
# --------------------------------------------------------------------------------------------------

COMMANDS_DIR = Path(qkmap_hf.commands.__file__).parent


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _command_classes(name: str) -> tuple[type, ...]:
    module = importlib.import_module(COMMANDS[name])
    return module.option_classes() if hasattr(module, "option_classes") else ()


def _field_default(option: dataclasses.Field):
    if option.default_factory is not dataclasses.MISSING:
        return option.default_factory()
    return option.default


def test_no_command_writes_a_flag_by_hand():
    calls = []
    for path in sorted(COMMANDS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                calls.append(f"{path.name}:{node.lineno}")
    assert calls == [], f"hand-written add_argument in qkmap_hf/commands: {calls}"


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "eval"])  # eval forwards its argv to lm-eval
def test_every_flag_is_a_field_and_its_parsed_default_is_the_field_default(name):
    fields_by_name = {f.name: f for cls in _command_classes(name) for f in dataclasses.fields(cls)}
    assert fields_by_name, f"qkmap {name} has no option classes"
    for action in _subparsers()[name]._actions:
        if isinstance(action, argparse._HelpAction) or action.default is argparse.SUPPRESS:
            continue  # -h, and old --no-... spellings (their field's own flag holds the default)
        assert action.dest in fields_by_name, f"qkmap {name}: {action.option_strings or action.dest} is no field"
        option = fields_by_name[action.dest]
        if option.default is dataclasses.MISSING and option.default_factory is dataclasses.MISSING:
            continue  # required
        if isinstance(action, argparse._StoreFalseAction):
            continue  # --no-FLAG: argparse's own default, the field's flag before it sets the value
        assert action.default == _field_default(option), f"qkmap {name} {action.option_strings}"


def test_the_shared_groups_are_declared_once_and_composed():
    """TrainOptions and CompareOptions inherit the groups; only ``overridden`` fields may appear in their own body,
    with the group's metadata (help may change) and, where the default differs, a documented one."""
    own_defaults = {("CompareOptions", "max_eval_blocks"): 64}  # every run of every arm evaluates on them
    for cls in (TrainOptions, CompareOptions):
        composed = {f.name: f for f in dataclasses.fields(cls)}
        for group in SHARED_GROUPS:
            assert issubclass(cls, group)
            for option in dataclasses.fields(group):
                mine = composed[option.name]
                expected = own_defaults.get((cls.__name__, option.name), _field_default(option))
                assert _field_default(mine) == expected, f"{cls.__name__}.{option.name}"
                same = {k: v for k, v in mine.metadata.items() if k != "help"}
                assert same == {k: v for k, v in option.metadata.items() if k != "help"}
    own = set(CompareOptions.__annotations__) & {f.name for g in SHARED_GROUPS for f in dataclasses.fields(g)}
    assert own == {"config", "max_eval_blocks"}  # both through flags.overridden
    assert not set(TrainOptions.__annotations__) & {f.name for g in SHARED_GROUPS for f in dataclasses.fields(g)}
    assert _subparsers()["compare"]._option_string_actions["--max-eval-blocks"].default == 64
    assert _subparsers()["train"]._option_string_actions["--max-eval-blocks"].default == 256


def test_library_defaults_come_from_the_option_classes():
    from qkmap_hf.conversion import convert_model
    from qkmap_hf.conversion.api import convert_to_folder
    from qkmap_hf.conversion.options import ConversionOptions, conversion_options
    from qkmap_hf.demo import DemoOptions, run_demo
    from qkmap_hf.flags import default_of
    from qkmap_hf.packaging import convert_checkpoint
    from qkmap_hf.serving import serve_command
    from qkmap_hf.training.data import DataOptions, build_datasets
    from qkmap_hf.verify import verify_conversion

    for function in (convert_checkpoint, convert_to_folder, convert_model):  # None: ConversionOptions' default
        assert all(default_of(function, f.name) is None for f in dataclasses.fields(ConversionOptions)), function
    assert conversion_options() == ConversionOptions()
    assert conversion_options(ConversionOptions(omega0=2e-3), num_frequencies=2) == ConversionOptions(
        omega0=2e-3, num_frequencies=2
    )
    defaulted = {p.name for p in inspect.signature(build_datasets).parameters.values() if p.default is not p.empty}
    assert defaulted == {"options"}  # the split and read settings' defaults are DataOptions'
    assert (
        set(inspect.signature(build_datasets).parameters) >= {"options", "settings"} and DataOptions().split_seed == 0
    )
    assert default_of(run_demo, "options") is None and DemoOptions().verify_tokens == default_of(
        verify_conversion, "max_tokens"
    )
    parsers = _subparsers()
    for name, flag, function, parameter in (
        ("verify", "--max-tokens", verify_conversion, "max_tokens"),
        ("verify", "--generate-tokens", verify_conversion, "generate_tokens"),
        ("convert", "--max-tokens", convert_checkpoint, "max_tokens"),
        ("serve", "--host", serve_command, "host"),
        ("serve", "--port", serve_command, "port"),
        ("serve", "--dtype", serve_command, "dtype"),
    ):
        assert parsers[name]._option_string_actions[flag].default == default_of(function, parameter), (name, flag)
    assert parsers["convert"]._option_string_actions["--omega0"].default == ConversionOptions().omega0


# The spellings of the commands that wrote their flags by hand before they came from dataclasses, plus the old
# aliases of the others: each must still parse.
OLD_SPELLINGS = {
    "analyze": "--compare --device --dtype --key-scales --lengths --max-tokens --needle-examples --no-progress "
    "--num-windows --output-dir --scales --seed --task --task-examples --task-length --text --trust-remote-code",
    "card": "--analysis --eval-results --license --name --overwrite --provenance",
    "convert": "--base-model --dtype --gguf-file --init --max-tokens --no-progress --num-frequencies --omega0 "
    "--overwrite --verify",
    "demo": "--eval-limit --output-dir --verify-tokens",
    "push": "--commit-message --dry-run --private --revision --timeout --token",
    "serve": "--dtype --enforce-eager --engine --engine-args --host --max-model-len --port",
    "verify": "--generate-tokens --gguf-file --json --max-tokens --no-save --text",
    "heal": "--keep-inverse-frequency-gains --no-native-gains --native-gains",
    "compare": "--variant --variants --tune --tuning-seeds --tuning-first-seed --save-models",
}


@pytest.mark.parametrize("name", OLD_SPELLINGS)
def test_old_spellings_are_still_flags(name):
    known = _subparsers()[name]._option_string_actions
    assert [flag for flag in OLD_SPELLINGS[name].split() if flag not in known] == []


def test_old_spellings_parse_to_the_same_values():
    import warnings

    from qkmap_hf.analysis import AnalysisSettings
    from qkmap_hf.conversion.options import ConversionOptions

    args = _parse("convert", ["--overwrite", "s", "d", "--init", "native", "--omega0", "2e-3", "--num-frequencies",
                              "2", "--dtype", "bfloat16", "--no-progress", "--max-tokens", "64"])  # fmt: skip
    assert (args.src, args.dst, args.overwrite, args.progress, args.max_tokens) == ("s", "d", True, False, 64)
    assert options_from_namespace(ConversionOptions, args) == ConversionOptions("native", 2, 2e-3, "bfloat16")
    args = _parse("convert", ["s", "d", "--init", "canonical"])  # the deprecated name still parses, and warns
    with pytest.warns(FutureWarning):
        assert options_from_namespace(ConversionOptions, args).init == "native"
    args = _parse("verify", ["s", "d", "--text", "t.txt", "--no-save", "--json", "r.json"])
    assert (args.text, args.save, args.json, args.max_tokens, args.generate_tokens) == (
        "t.txt",
        False,
        "r.json",
        512,
        64,
    )
    args = _parse("analyze", ["--trust-remote-code", "m", "--output-dir", "o", "--compare", "a", "b", "--compare",
                              "c", "--lengths", "64,128", "--scales", "0.5,2", "--text", "t.txt", "--no-progress",
                              "--key-scales", "2"])  # fmt: skip
    assert (args.model, args.compare, args.trust_remote_code, args.progress) == ("m", ["a", "b", "c"], True, False)
    assert args.key_scales == (2.0,)
    with warnings.catch_warnings():
        settings = options_from_namespace(AnalysisSettings, args)
    assert settings == AnalysisSettings(scales=(0.5, 2.0), context_lengths=(64, 128), text_file="t.txt")
    args = _parse("push", ["--private", "--dry-run", "m", "org/name", "--timeout", "5,30"])
    assert (args.model, args.repo_id, args.private, args.dry_run, args.timeout) == ("m", "org/name", True, True, "5,30")
    args = _parse("serve", ["--enforce-eager", "f", "--port", "9000", "--engine", "transformers"])
    assert (args.folder, args.enforce_eager, args.port, args.engine, args.host) == (
        "f",
        True,
        9000,
        "transformers",
        "127.0.0.1",
    )
    args = _parse("card", ["--overwrite", "m", "--eval-results", "ev", "--license", "mit"])
    assert (args.model, args.overwrite, args.eval_results, args.license) == ("m", True, "ev", "mit")
    args = _parse("demo", ["--eval-limit", "4", "--verify-tokens", "128"])
    assert (args.output_dir, args.eval_limit, args.verify_tokens) == ("runs/demo", 4, 128)
    args = _parse("heal", ["c", "--teacher", "t", "--data", "d", "--output-dir", "o"])
    assert args.native_gains is True  # --keep-inverse-frequency-gains (the old --no-native-gains) leaves it alone
    args = _parse("compare", ["--data", "d", "--output-dir", "o", "--warmup", "10"])
    assert options_from_namespace(CompareOptions, args).warmup == 10  # steps, as qkmap train reads it


def test_a_bad_list_value_is_a_one_line_refusal_naming_the_flag(capsys):
    assert cli_main(["analyze", "m", "--output-dir", "o", "--lengths", "a,b"]) == 2
    assert "--lengths 'a,b'" in capsys.readouterr().err


def test_a_composed_class_may_change_only_the_default_and_help_of_an_inherited_field():
    from qkmap_hf.flags import overridden
    from qkmap_hf.training.data import DataOptions

    changed = overridden(DataOptions, "split_seed", default=3)
    assert changed.default == 3 and changed.metadata["help"] == "seed of the held-out split" and changed.kw_only
    with pytest.raises(TypeError):
        overridden(DataOptions, "split_seed", metadata={})
