"""Model cards: rendered through huggingface_hub's ModelCard, round-tripped through ModelCard.load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from qkmap_hf.analysis import AnalysisSettings, analyze
from qkmap_hf.cards import load_lm_eval_results, template_path, write_model_card
from tests.eval_utils import cached_models, run_command, single_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)
ROOT = Path(__file__).resolve().parents[2]

# The layout lm-eval 0.4.13 writes (trimmed to the fields the card reads, values as it stores them).
LM_EVAL_RESULTS = {
    "results": {
        "hellaswag": {"alias": "hellaswag", "acc,none": 0.2891, "acc_stderr,none": 0.0045, "acc_norm,none": 0.3112,
                      "acc_norm_stderr,none": 0.0046},
        "arc_easy": {"alias": "arc_easy", "acc,none": 0.4415, "acc_stderr,none": 0.0102, "acc_norm,none": 0.3986,
                     "acc_norm_stderr,none": 0.01},
        "qkmap_shakespeare_ppl": {"alias": "qkmap_shakespeare_ppl", "word_perplexity,none": 812.5,
                                  "word_perplexity_stderr,none": "N/A", "bits_per_byte,none": 2.9531,
                                  "bits_per_byte_stderr,none": "N/A"},
    },
    "configs": {
        "hellaswag": {"task": "hellaswag", "dataset_path": "Rowan/hellaswag", "validation_split": "validation"},
        "arc_easy": {"task": "arc_easy", "dataset_path": "allenai/ai2_arc", "dataset_name": "ARC-Easy", "test_split": "test"},
        "qkmap_shakespeare_ppl": {"task": "qkmap_shakespeare_ppl", "dataset_path": "", "test_split": "test"},
    },
    "n-shot": {"hellaswag": 10, "arc_easy": 0, "qkmap_shakespeare_ppl": 0},
    "config": {"model": "qkmap", "model_args": {"pretrained": "x"}, "limit": None},
    "lm_eval_version": "0.4.13",
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return cached_models(tmp_path_factory)


@pytest.fixture
def model_dir(models, tmp_path):
    folder = tmp_path / "tiny-qkmap"
    shutil.copytree(models["qk_map"], folder)
    (folder / "qkmap_conversion.json").write_text(
        json.dumps({"source_model_id": "HuggingFaceTB/SmolLM2-135M", "init": "exact", "exact_frequency": 0.001,
                    "max_kl": 4e-9, "license": "apache-2.0"})
    )  # fmt: skip
    (folder / "qkmap_training.json").write_text(json.dumps({"steps": 30, "final_loss": 3.21, "dataset": "shakespeare"}))
    return folder


def test_card_round_trips_with_eval_results(model_dir, tmp_path):
    results = tmp_path / "eval" / "model"
    results.mkdir(parents=True)
    (results / "results_2026-11-30T10-00-00.json").write_text(json.dumps(LM_EVAL_RESULTS))
    readme = write_model_card(model_dir, eval_results=tmp_path / "eval", model_name="qkmap-test/tiny-qkmap")
    assert readme == model_dir / "README.md"
    card = ModelCard.load(readme, ignore_metadata_errors=False)
    data = card.data
    assert data.license == "apache-2.0"
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M"
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"qk-map", "custom_code", "qk-mode-qk-map"} <= set(data.tags)
    assert data.model_name == "qkmap-test/tiny-qkmap"
    got = {(r.dataset_type, r.metric_type): r for r in data.eval_results}
    assert len(got) == 6  # 2 metrics x 3 tasks: stderr entries and "N/A" are not metrics
    assert got[("Rowan/hellaswag", "acc_norm")].metric_value == pytest.approx(0.3112)
    assert got[("Rowan/hellaswag", "acc_norm")].dataset_args == {"num_few_shot": 10}
    assert got[("Rowan/hellaswag", "acc")].dataset_split == "validation"
    assert got[("allenai/ai2_arc", "acc")].dataset_config == "ARC-Easy"
    assert got[("qkmap_shakespeare_ppl", "bits_per_byte")].metric_value == pytest.approx(2.9531)
    # loading and re-serialising the card changes nothing
    assert str(ModelCard(str(card))) == readme.read_text()
    text = card.text
    config = json.loads((model_dir / "config.json").read_text())
    assert f"| `qkmap_max_frequency` | {config['qkmap_max_frequency']:g} |" in text
    assert "trust_remote_code=True" in text and 'repo = "qkmap-test/tiny-qkmap"' in text
    assert "| hellaswag | acc_norm | 0.3112 | 0.0046 | 10 |" in text
    assert "**init:** exact" in text and "**final_loss:** 3.21" in text  # both provenance records
    assert not list(model_dir.glob(".README.md.*"))  # atomic write left no temporary file


def test_card_embeds_analysis_plots(model_dir, models, tmp_path):
    out = tmp_path / "analysis"
    settings = AnalysisSettings(max_tokens=64, num_windows=1, context_lengths=(64,), needle_examples=1, scales=(2.0,))
    analyze([model_dir, models["standard"]], out, settings=settings, progress=False)
    assert run_command("card", [str(model_dir), "--analysis", str(out), "--license", "mit"]) == 0
    card = ModelCard.load(model_dir / "README.md")
    assert card.data.license == "mit" and card.data.eval_results is None
    images = [line.split("](")[1].rstrip(")") for line in card.text.splitlines() if line.startswith("![")]
    assert len(images) == 4 + 3  # own plots (incl. phase) + comparison plots
    for image in images:
        assert (model_dir / image).read_bytes()[:4] == b"\x89PNG"
    assert "Typical phase" in card.text and "Regime:" in card.text
    assert (model_dir / "analysis" / "analysis.json").is_file()


def test_standard_model_card_and_errors(models, tmp_path):
    folder = tmp_path / "baseline"
    shutil.copytree(models["standard"], folder)
    card = ModelCard.load(write_model_card(folder, provenance={"kind": "training", "steps": 30}))
    assert "qk-mode-standard" in card.data.tags and card.data.base_model is None
    assert "`qk_mode` | standard" in card.text and "QK-MAP settings" not in card.text
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_model_card(tmp_path)
    with pytest.raises(FileNotFoundError, match="results_"):
        load_lm_eval_results(tmp_path)
    assert run_command("card", [str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_wheel_carries_templates_and_task_pack(tmp_path):
    """A non-editable wheel includes the card template and the task pack, and the installed copy finds them."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "qkmap_hf", source / "qkmap_hf", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("qkmap_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "qkmap_hf/model_cards/qkmap_model_card.md" in names
    for name in ("qkmap_next_line.yaml", "_needle_template_yaml", "data/haystack.txt", "data/next_line.jsonl"):
        assert f"qkmap_hf/tasks/{name}" in names
    assert (ROOT / "model_cards" / "qkmap_model_card.md").resolve() == template_path().resolve()
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    probe = (
        "import qkmap_hf, qkmap_hf.cards as c, qkmap_hf.tasks as t; "
        "print(qkmap_hf.__file__); print(c.template_path()); print(t.data_file('haystack.txt'))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    lines = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    assert all(line.startswith(str(site)) for line in lines), lines


def test_a_typed_record_gets_its_section_next_to_the_old_files(model_dir):
    from qkmap_hf.provenance import HealingRecord

    record = HealingRecord(command="qkmap heal", source="src-folder", tokens_seen=3072, final={"regime": "periodic"})
    text = write_model_card(model_dir, provenance=record).read_text()
    for section in ("qkmap_conversion.json", "qkmap_training.json", "qkmap_healing.json"):
        assert section in text
    assert "tokens_seen" in text and "3072" in text and "final.regime" in text
    assert "exact_frequency" in text and "final_loss" in text  # the old hand-made records still render
