"""qkmap train: presets, data pipeline, parameter groups, a real tiny run, resume, and the saved checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import qkmap_hf
from qkmap_hf.assets import shakespeare_text
from qkmap_hf.modeling.configuration_qkmap import QK_MODES
from qkmap_hf.training.data import (
    PackedDataset,
    build_datasets,
    byte_level_tokenizer,
    split_blocks,
    tokenize_documents,
)
from qkmap_hf.training.optim import QKMAP_LR_MULTIPLIER, QKMapTrainer
from qkmap_hf.training.presets import PRESETS, count_parameters, get_preset, preset_config
from qkmap_hf.training.trainer import PROVENANCE_FILE, TrainOptions, bf16_enabled, train, training_arguments
from tests.utils import run_clean_python

LN_VOCAB = math.log(257)  # loss of a uniform byte-level model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "hamlet.txt"
    path.write_text(shakespeare_text(max_chars=300_000, plays=("hamlet_gut",)), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------


def test_presets_have_paper_sizes_and_modes_share_shapes():
    # Llama-2 7B has exactly 6,738,415,616 parameters; the 7b preset is that shape with standard attention.
    assert count_parameters(preset_config("7b", "standard")) == 6_738_415_616
    assert abs(count_parameters(preset_config("190m", "standard")) - 190e6) / 190e6 < 0.01
    assert 1.0e9 < count_parameters(preset_config("1b", "standard")) < 1.2e9
    assert count_parameters(preset_config("tiny", "standard")) < 200_000

    small = {mode: preset_config("small-cpu", mode) for mode in QK_MODES}
    for config in small.values():  # the prototype's shape
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.head_dim) == (
            4,
            256,
            4,
            64,
        )
    standard = count_parameters(small["standard"])
    # QK-Norm adds two head_dim weights per layer; QK-MAP (m = head_dim, F = 1) adds omega (m) and 2 x (2 x m) gains
    # per key/value head per layer.
    assert count_parameters(small["qk_norm"]) - standard == 4 * 2 * 64
    assert count_parameters(small["qk_map"]) - standard == 4 * 4 * (64 + 2 * 2 * 64)
    assert preset_config("tiny", "qk_map", vocab_size=300, qkmap_max_frequency=2.0).qkmap_max_frequency == 2.0
    with pytest.raises(ValueError, match="tiny"):
        get_preset("huge")
    assert {"tiny", "small-cpu", "190m", "1b", "7b"} <= set(PRESETS)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def test_byte_level_tokenizer_is_bytes_and_reloads(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = byte_level_tokenizer()
    text = "Thou art more lovely — and more temperate:\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert len(tokenizer) == 257 and tokenizer.eos_token_id == 256
    assert tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text, add_special_tokens=False)["input_ids"] == ids


def test_text_jsonl_and_saved_dataset_sources_pack_and_split(tmp_path):
    from datasets import Dataset

    documents = [f"Document number {i}: " + "to be or not to be " * (i + 1) for i in range(12)]
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text(documents[0])
    (tmp_path / "folder" / "b.md").write_text(documents[1])
    (tmp_path / "folder" / "ignored.bin").write_bytes(b"\x00\x01")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in documents[2:7]))
    Dataset.from_dict({"body": documents[7:]}).save_to_disk(str(tmp_path / "saved"))

    tokenizer = byte_level_tokenizer()
    sources = [tmp_path / "folder", tmp_path / "docs.jsonl", tmp_path / "saved"]
    train_set, eval_set, stats = build_datasets(
        sources, tokenizer, 32, text_field="body", eval_fraction=0.25, split_seed=3
    )
    expected_tokens = sum(len(d.encode()) + 1 for d in documents)  # every document ends with EOS
    assert stats.tokens == expected_tokens
    assert stats.train_blocks + stats.eval_blocks == expected_tokens // 32
    assert stats.eval_blocks == round(expected_tokens // 32 * 0.25)
    stream = tokenize_documents(documents, tokenizer)
    assert torch.equal(stream[: len(documents[0].encode())], torch.tensor(list(documents[0].encode())))
    example = train_set[0]
    assert example["input_ids"].shape == (32,) and torch.equal(example["input_ids"], example["labels"])

    # The held-out split is a function of the seed: same seed, same blocks; disjoint; together all blocks.
    blocks = torch.arange(400).view(100, 4)
    train_a, eval_a = split_blocks(blocks, 0.1, None, seed=0)
    train_b, eval_b = split_blocks(blocks, 0.1, None, seed=0)
    _, eval_c = split_blocks(blocks, 0.1, None, seed=1)
    assert torch.equal(eval_a, eval_b) and torch.equal(train_a, train_b) and not torch.equal(eval_a, eval_c)
    assert len(eval_a) == 10
    assert sorted(torch.cat([train_a, eval_a])[:, 0].tolist()) == list(range(0, 400, 4))
    assert len(split_blocks(blocks, 0.5, 7, seed=0)[1]) == 7

    with pytest.raises(ValueError, match=r"docs\.jsonl:1 has no field 'text'.*--text-field"):
        build_datasets([tmp_path / "docs.jsonl"], tokenizer, 32)
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_datasets([tmp_path / "missing.txt"], tokenizer, 32)


# --------------------------------------------------------------------------------------------------
# Parameter groups
# --------------------------------------------------------------------------------------------------


def _trainer(model, tmp_path, **kwargs):
    options = TrainOptions(model="tiny", data=[], output_dir=str(tmp_path), save_steps=0, max_steps=10, warmup=0)
    resolved = {"batch_size": 2, "learning_rate": 1e-3}
    args = training_arguments(options, resolved, model, has_eval=False)
    blocks = torch.randint(0, 257, (8, 16))
    return QKMapTrainer(model=model, args=args, train_dataset=PackedDataset(blocks), **kwargs)


def test_qkmap_parameters_get_their_own_group(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(preset_config("tiny", "qk_map"))
    names = dict(model.named_parameters())
    groups = {g["name"]: g for g in _trainer(model, tmp_path).create_optimizer().param_groups}
    assert set(groups) == {"decay", "no_decay", "qkmap"}

    qkmap = groups["qkmap"]
    assert qkmap["lr"] == pytest.approx(QKMAP_LR_MULTIPLIER * 1e-3) and qkmap["weight_decay"] == 0.0
    expected = {id(p) for n, p in names.items() if ".self_attn.qk_map." in n}
    assert {id(p) for p in qkmap["params"]} == expected
    assert len(expected) == 3 * model.config.num_hidden_layers  # log_frequency, query_gain, key_gain per layer

    def group_of(name: str) -> str:
        return next(g for g, v in groups.items() if any(p is names[name] for p in v["params"]))

    assert group_of("model.layers.0.self_attn.q_proj.weight") == "decay"
    assert group_of("model.embed_tokens.weight") == "decay"
    assert group_of("model.layers.1.input_layernorm.weight") == "no_decay"
    assert group_of("model.norm.weight") == "no_decay"
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    every = sum(len(g["params"]) for g in groups.values())
    assert every == len({id(p) for p in model.parameters()})  # each (tied) tensor exactly once

    # An explicit rate wins, and the schedule scales every group by the same factor.
    trainer = _trainer(model, tmp_path, qkmap_learning_rate=5e-2)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    for _ in range(4):
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    rates = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert rates["qkmap"] / rates["decay"] == pytest.approx(5e-2 / 1e-3)
    assert rates["decay"] < 1e-3  # cosine decay has started

    qk_norm = AutoModelForCausalLM.from_config(preset_config("tiny", "qk_norm"))
    groups = {g["name"]: g for g in _trainer(qk_norm, tmp_path).create_optimizer().param_groups}
    assert set(groups) == {"decay", "no_decay"}
    q_norm = dict(qk_norm.named_parameters())["model.layers.0.self_attn.q_norm.weight"]
    assert any(p is q_norm for p in groups["no_decay"]["params"])


def test_bf16_is_off_on_cpu():
    assert bf16_enabled("auto") == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert bf16_enabled("no") is False


# --------------------------------------------------------------------------------------------------
# A real tiny run through the command-line entry point
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory):
    from qkmap_hf.cli import run_command

    out = tmp_path_factory.mktemp("tiny-run") / "out"
    torch.set_num_threads(1)
    code = run_command("train", [
        "--model", "tiny", "--data", str(corpus), "--output-dir", str(out), "--max-steps", "60",
        "--logging-steps", "5", "--eval-steps", "20", "--save-steps", "30", "--max-eval-blocks", "32",
        "--disable-tqdm", "--seed", "0",
    ])  # fmt: skip
    assert code == 0
    return out, json.loads((out / PROVENANCE_FILE).read_text())


def test_loss_goes_down_on_real_text(tiny_run):
    _, record = tiny_run
    history = record["log_history"]
    train_losses = [h["loss"] for h in history if "loss" in h]
    evals = {h["step"]: h for h in history if "eval_loss" in h}
    assert train_losses[0] == pytest.approx(LN_VOCAB, abs=0.1)  # an untrained model is near uniform
    assert train_losses[-1] < train_losses[0] - 2.0
    assert sorted(evals) == [0, 20, 40, 60]
    assert evals[60]["eval_loss"] < evals[20]["eval_loss"] < evals[0]["eval_loss"] - 1.0
    for entry in evals.values():
        assert entry["eval_perplexity"] == pytest.approx(math.exp(entry["eval_loss"]), rel=1e-6)
    assert record["eval_metrics"]["eval_loss"] == evals[60]["eval_loss"]

    assert record["world_size"] == 1
    assert record["data"]["block_size"] == 64 and record["data"]["eval_blocks"] == 32
    assert record["resolved"]["learning_rate"] == get_preset("tiny").learning_rate
    groups = record["model"]["trainable_parameters_by_group"]
    assert groups["qkmap"] == 2 * 2 * (16 + 2 * 2 * 16)  # layers x kv heads x (omega + q/k gains)
    assert record["model"]["qk_mode"] == "qk_map" and "transformers" in record["versions"]


def test_output_folder_holds_no_pickle_and_push_skips_checkpoints(tiny_run):
    """Train then push works: no pickle beside the weights, and Trainer checkpoints are not uploaded."""
    from qkmap_hf.hub import files_to_upload
    from qkmap_hf.safety import find_pickles

    out, _ = tiny_run
    assert (out / "checkpoint-30" / "trainer_state.json").is_file()
    names = files_to_upload(out)
    assert "model.safetensors" in names and not any(name.startswith("checkpoint-") for name in names)
    assert find_pickles(out, names) == []


@pytest.mark.slow
def test_output_loads_with_trust_remote_code_and_reproduces_eval_loss(tiny_run, corpus, tmp_path):
    out, record = tiny_run
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-30", "checkpoint-60"}
    for name in ("config.json", "model.safetensors", "modeling_qkmap.py", "configuration_qkmap.py", "tokenizer.json"):
        assert (out / name).exists(), name
    assert json.loads((out / "config.json").read_text())["use_cache"] is True

    # The same held-out blocks the run evaluated on, scored in an interpreter where qkmap_hf cannot be imported.
    _, eval_set, _ = build_datasets([corpus], byte_level_tokenizer(), 64, max_eval_blocks=32, split_seed=0)
    torch.save(eval_set.blocks, tmp_path / "eval_blocks.pt")
    result = run_clean_python(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
        blocks = torch.load({str(tmp_path / "eval_blocks.pt")!r})
        with torch.no_grad():
            losses = [model(input_ids=blocks[i:i + 8], labels=blocks[i:i + 8]).loss.item() for i in range(0, len(blocks), 8)]
        print(json.dumps({{"loss": sum(losses) / len(losses), "module": type(model).__module__,
                          "ids": tokenizer("To be", add_special_tokens=False)["input_ids"]}}))
        """,
        cwd=tmp_path,
    )
    assert not result["module"].startswith("qkmap_hf")
    assert result["ids"] == [84, 111, 32, 98, 101]
    assert result["loss"] == pytest.approx(record["eval_metrics"]["eval_loss"], abs=1e-4)


# --------------------------------------------------------------------------------------------------
# Resume and gradient checkpointing
# --------------------------------------------------------------------------------------------------


def _short_run(corpus: Path, out: Path, callbacks=None, **overrides) -> dict:
    settings = dict(max_steps=8, logging_steps=1, save_steps=4, eval_fraction=0.0, disable_tqdm=True, max_tokens=60_000)
    options = TrainOptions(model="tiny", data=[str(corpus)], output_dir=str(out), **{**settings, **overrides})
    train(options, callbacks=callbacks)
    return json.loads((out / PROVENANCE_FILE).read_text())


def _losses(record: dict) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in record["log_history"] if "loss" in h}


@pytest.mark.slow
def test_resume_continues_from_the_saved_step_with_the_same_losses(corpus, tmp_path):
    full = _short_run(corpus, tmp_path / "full")
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", resumed_dir / "checkpoint-4")
    from transformers import TrainerCallback

    class RecordSteps(TrainerCallback):
        steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    recorder = RecordSteps()
    resumed = _short_run(corpus, resumed_dir, callbacks=[recorder], resume="latest")

    assert Path(resumed["resumed_from"]).name == "checkpoint-4"
    assert recorder.steps == [5, 6, 7, 8]  # it continued from the saved step, it did not start over
    full_losses, resumed_losses = _losses(full), _losses(resumed)
    # Same losses after the restart: weights, optimizer moments, schedule and the data position were all restored.
    for step in (5, 6, 7, 8):
        assert resumed_losses[step] == pytest.approx(full_losses[step], abs=1e-6)
    assert full_losses[8] < full_losses[1]
    # The attention monitor's log continues: step 1 measured before the checkpoint, step 8 (the last) after it.
    monitor_steps = [h["step"] for h in resumed["log_history"] if "monitor/max_logit" in h]
    assert monitor_steps == [1, 8]
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(
            TrainOptions(
                model="tiny", data=[str(corpus)], output_dir=str(tmp_path / "empty"), resume="latest", max_tokens=10_000
            )
        )


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_losses(corpus, tmp_path):
    plain = _short_run(corpus, tmp_path / "plain", max_steps=3, save_steps=0)
    checkpointed = _short_run(corpus, tmp_path / "ckpt", max_steps=3, save_steps=0, gradient_checkpointing=True)
    assert checkpointed["model"]["activation_checkpointing"] and not plain["model"]["activation_checkpointing"]
    assert _losses(checkpointed) == pytest.approx(_losses(plain), abs=1e-5)


def test_qkmap_hf_registers_before_training():
    # The Trainer builds presets through AutoModelForCausalLM, which knows "qkmap" once the package is imported.
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_config(preset_config("tiny"))) is qkmap_hf.QKMapForCausalLM


def test_qkmap_cli_train_command(corpus, tmp_path):
    from qkmap_hf.cli import main

    out = tmp_path / "cli"
    argv = ["train", "--model", "tiny", "--qk-mode", "qk_norm", "--config", "num_hidden_layers=1", "--data", str(corpus),
            "--output-dir", str(out), "--max-steps", "2", "--max-tokens", "20000", "--eval-fraction", "0",
            "--save-steps", "0", "--disable-tqdm"]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["qk_mode"], config["num_hidden_layers"], config["vocab_size"]) == ("qk_norm", 1, 257)
    record = json.loads((out / PROVENANCE_FILE).read_text())
    assert record["options"]["config"] == {"num_hidden_layers": 1} and record["data"]["eval_blocks"] == 0
