"""lm-eval integration: `qkmap eval` (lm-eval's CLI) and the Python path on the bundled tasks, offline.

The perplexity numbers are checked against an independent log-likelihood computed here with the model itself,
so the test proves the whole path (task data, tokenisation, model type, metric) rather than "a number came out".
"""

from __future__ import annotations

import json
import math
import os

import lm_eval
import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer

import qkmap_hf.lm_eval as qkmap_lm_eval
from qkmap_hf.cards import write_model_card
from qkmap_hf.commands.eval import translate_argv
from qkmap_hf.tasks import data_file, task_pack_dir
from tests.eval_utils import cached_models, run_command, single_thread

LIMIT = 4
_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return cached_models(tmp_path_factory)


def _expected_bits_per_byte(model_dir, limit: int) -> float:
    """Rolling log-likelihood of the first ``limit`` passages, computed directly (lm-eval's definition)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    passages = [json.loads(line)["text"] for line in data_file("shakespeare_passages.jsonl").read_text().splitlines()]
    total_ll, total_bytes = 0.0, 0
    for text in passages[:limit]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        inputs = torch.tensor([[tokenizer.bos_token_id] + ids[:-1]])  # lm-eval's prefix token, then the text
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=inputs).logits.double(), dim=-1)
        total_ll += logprobs[0, torch.arange(len(ids)), torch.tensor(ids)].sum().item()
        total_bytes += len(text.encode("utf-8"))
    return -total_ll / total_bytes / math.log(2)


def test_translate_argv_maps_model_and_dashed_flags():
    argv = ["ckpt", "--tasks", "hellaswag,arc_easy", "--output-path", "out", "--batch-size", "8", "--num_fewshot", "5"]
    assert translate_argv(argv) == [
        "run", "--model", "qkmap", "--model_args", "pretrained=ckpt",
        "--tasks", "hellaswag,arc_easy", "--output_path", "out", "--batch_size", "8", "--num_fewshot", "5",
    ]  # fmt: skip
    assert translate_argv(["--model", "hf", "--model_args", "pretrained=gpt2", "--tasks", "x"])[:3] == [
        "run",
        "--model",
        "hf",
    ]
    assert translate_argv(["ls", "tasks"]) == ["ls", "tasks"]
    with pytest.raises(SystemExit, match="keep one"):
        translate_argv(["ckpt", "--model_args", "pretrained=other"])


def test_dashed_flags_with_values_after_equals_sign_are_translated():
    argv = translate_argv(["ckpt", "--tasks=qkmap_next_line", "--output-path=out-dir", "-o", "x-y", "--log-samples"])
    assert argv[5:] == ["--tasks=qkmap_next_line", "--output_path=out-dir", "-o", "x-y", "--log_samples"]


def test_user_include_path_is_combined_with_the_task_pack(tmp_path):
    from lm_eval.tasks import TaskManager

    user = tmp_path / "my_tasks" / "nested"
    user.mkdir(parents=True)
    yaml_text = (task_pack_dir() / "qkmap_next_line.yaml").read_text()
    yaml_text = yaml_text.replace("task: qkmap_next_line", "task: my_next_line").replace(
        "qkmap_hf.tasks.loaders.load_next_line", "my_loader.load"
    )
    (user / "my_next_line.yaml").write_text(yaml_text)
    (user / "my_loader.py").write_text("from qkmap_hf.tasks.loaders import load_next_line as load\n")
    folder = qkmap_lm_eval.linked_task_folder([task_pack_dir(), tmp_path / "my_tasks"], tmp_path / "linked")
    loaded = TaskManager(include_path=str(folder), include_defaults=False).load(["my_next_line", "qkmap_next_line"])
    mine, ours = (list(loaded["tasks"][name].test_docs()) for name in ("my_next_line", "qkmap_next_line"))
    assert len(mine) == len(ours) == 160 and mine == ours  # the user's loader, found beside its linked YAML
    with pytest.raises(FileNotFoundError, match="--include_path"):
        qkmap_lm_eval.linked_task_folder([tmp_path / "missing"], tmp_path / "linked2")


def test_task_pack_is_package_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may resolve against the working directory
    manager = qkmap_lm_eval.task_manager(include_defaults=False)
    loaded = manager.load(["qkmap_local"])["tasks"]
    assert set(loaded) == {
        "qkmap_shakespeare_ppl",
        "qkmap_next_line",
        "qkmap_needle_256",
        "qkmap_needle_512",
        "qkmap_needle_1024",
    }
    needle = list(loaded["qkmap_needle_1024"].test_docs())
    assert len(needle) == 100
    assert all(900 <= doc["length"] <= 1100 for doc in needle)
    assert all(doc["choices"][doc["label"]] in doc["prompt"] for doc in needle)
    assert all(sum(c in doc["prompt"] for c in doc["choices"]) == 1 for doc in needle)  # only the answer occurs
    next_line = list(loaded["qkmap_next_line"].test_docs())
    assert len(next_line) == 160 and all(len(doc["choices"]) == 4 for doc in next_line)
    # the generic task takes its length from --metadata, the fixed variants do not
    custom = qkmap_lm_eval.task_manager(
        include_defaults=False, metadata={"needle_words": 96, "needle_examples": 3}
    ).load(["qkmap_needle", "qkmap_needle_256"])
    docs = list(custom["tasks"]["qkmap_needle"].test_docs())
    assert len(docs) == 3 and all(80 <= doc["length"] <= 110 for doc in docs)
    assert all(230 <= doc["length"] <= 280 for doc in custom["tasks"]["qkmap_needle_256"].test_docs())


@pytest.mark.slow
def test_qkmap_eval_cli_offline(models, tmp_path, monkeypatch):
    assert os.environ.get("HF_HUB_OFFLINE") == "1" and os.environ.get("HF_DATASETS_OFFLINE") == "1"
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    code = run_command(
        "eval",
        [
            str(models["qk_map"]),
            "--tasks", "qkmap_shakespeare_ppl,qkmap_next_line,qkmap_needle_256",
            "--limit", str(LIMIT),
            "--batch-size", "4",
            "--model-args", "dtype=float32",
            "--output-path", str(out),
        ],
    )  # fmt: skip
    assert code == 0
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1 and files[0].parent.parent == out  # lm-eval's layout: OUT/<model name>/results_*.json
    results = json.loads(files[0].read_text())
    assert results["config"]["model"] == "qkmap"
    assert results["config"]["model_args"]["pretrained"] == str(models["qk_map"])
    scores = results["results"]
    assert set(scores) == {"qkmap_shakespeare_ppl", "qkmap_next_line", "qkmap_needle_256"}
    assert all(scores[t]["sample_len"] == LIMIT for t in scores)
    assert 0.0 <= scores["qkmap_next_line"]["acc,none"] <= 1.0
    assert 0.0 <= scores["qkmap_needle_256"]["acc,none"] <= 1.0
    bits = scores["qkmap_shakespeare_ppl"]["bits_per_byte,none"]
    assert bits == pytest.approx(_expected_bits_per_byte(models["qk_map"], LIMIT), rel=1e-4)
    assert 1.0 < bits < 8.0  # trained a little: below 8 bits per byte, far from a perfect model
    # the card's model-index carries exactly these numbers
    card = ModelCard.load(write_model_card(models["qk_map"], eval_results=out))
    by_metric = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert by_metric[("qkmap_shakespeare_ppl", "bits_per_byte")] == pytest.approx(bits, rel=1e-6)
    assert by_metric[("qkmap_next_line", "acc")] == pytest.approx(scores["qkmap_next_line"]["acc,none"])
    (models["qk_map"] / "README.md").unlink()


@pytest.mark.slow
def test_python_path_with_and_without_remote_code(models):
    manager = qkmap_lm_eval.task_manager(include_defaults=False)
    path = str(models["qk_map"])
    by_name = lm_eval.simple_evaluate(
        model="qkmap",
        model_args=f"pretrained={path},dtype=float32",
        tasks=["qkmap_next_line"],
        limit=8,
        task_manager=manager,
    )
    remote = qkmap_lm_eval.QKMapLM(pretrained=path, trust_remote_code=True, dtype="float32")
    assert type(remote.model).__module__.startswith("transformers_modules")  # the checkpoint's own files
    by_instance = lm_eval.simple_evaluate(model=remote, tasks=["qkmap_next_line"], limit=8, task_manager=manager)
    a, b = by_name["results"]["qkmap_next_line"], by_instance["results"]["qkmap_next_line"]
    assert by_name["config"]["model"] == "qkmap"
    assert a["acc,none"] == b["acc,none"] and a["acc_norm,none"] == b["acc_norm,none"]


def test_model_options_checked_before_loading(models):
    path = str(models["qk_norm"])
    lm = qkmap_lm_eval.QKMapLM(pretrained=path, attn_implementation="eager", torch_dtype="bfloat16")
    assert lm.model.config._attn_implementation == "eager"
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert type(lm.model).__module__ == "qkmap_hf.modeling.modeling_qkmap"  # no remote code by default
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="qk_mode"):
        qkmap_lm_eval.QKMapLM(pretrained=path, qk_mode="qk_map")
    with pytest.raises(ValueError, match="not_an_option"):
        qkmap_lm_eval.QKMapLM(pretrained=path, not_an_option=1)
    with pytest.raises(ValueError, match="attn_implementation='fast'"):
        qkmap_lm_eval.QKMapLM(pretrained=path, attn_implementation="fast")
    assert str(task_pack_dir()) in {str(p) for p in qkmap_lm_eval.task_manager(include_defaults=False).include_path}
