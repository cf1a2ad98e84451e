"""Synthetic tasks (issue 24): generators checked by brute force, disjoint splits, the accuracy measure on answers
that are known, the constant-cos control against standard_prior, and ``qkmap compare --task`` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import EvalPrediction

from qkmap_hf.modeling.configuration_qkmap import QKMapConfig
from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM
from qkmap_lab.synthetic import (
    IGNORE_INDEX,
    CopyTask,
    MQARTask,
    SalienceTask,
    TaskDataset,
    answer_accuracy,
    heldout_dataset,
    parse_task,
    task_spec,
)
from tests.utils import tiny_config_kwargs

TASK_CASES = [
    (MQARTask(num_pairs=4), 96),
    (MQARTask(num_pairs=8, num_queries=3), 64),
    (MQARTask(num_pairs=2, num_queries=8), 64),  # more queries than pairs: keys asked with replacement
    (SalienceTask(), 48),
    (CopyTask(), 40),
]


def _mqar_answers(task: MQARTask, ids: np.ndarray) -> dict[int, int]:
    """Brute force: for every key in the query region, the token after its first appearance in the context."""
    context = len(ids) - 2 * task.queries
    answers = {}
    for position in range(context, len(ids), 2):
        key = ids[position]
        first = next(i for i in range(context) if ids[i] == key)
        answers[position + 1] = ids[first + 1]
    return answers


def _copy_answers(task: CopyTask, ids: np.ndarray) -> dict[int, int]:
    """Brute force: the chunk's second occurrence is the only ``chunk``-long run that occurred before (random ids
    repeat a run of 16 with negligible probability); every token of it but the first is a label."""
    n = task.chunk
    first = {}
    for i in range(len(ids) - n + 1):
        first.setdefault(ids[i : i + n].tobytes(), i)
    repeat = next(j for j in range(n, len(ids) - n + 1) if first[ids[j : j + n].tobytes()] <= j - n)
    return {j: int(ids[j]) for j in range(repeat + 1, repeat + n)}


def _salience_answer(task: SalienceTask, ids: np.ndarray) -> int:
    priority = task.priority()
    return max(ids[:-2], key=lambda item: priority[item])


@pytest.mark.parametrize(("task", "length"), TASK_CASES)
def test_generators_are_deterministic_and_agree_with_a_brute_force_reference(task, length):
    dataset = TaskDataset(task, length, count=50, seed=3, split="train")
    again = TaskDataset(task, length, count=50, seed=3, split="train")
    for index in range(50):
        ids, labels = dataset.example(index)
        assert np.array_equal(ids, again.example(index)[0]) and np.array_equal(labels, again.example(index)[1])
        assert ids.shape == labels.shape == (length,) and ids.min() >= 0 and ids.max() < 256
        answered = {int(i): int(labels[i]) for i in np.flatnonzero(labels != IGNORE_INDEX)}
        if isinstance(task, CopyTask):
            assert answered == _copy_answers(task, ids)
        elif isinstance(task, MQARTask):
            assert answered == {int(k): int(v) for k, v in _mqar_answers(task, ids).items()}
            keys = ids[: length - 2 * task.queries]
            assert (
                len([t for t in keys if task.filler_vocab <= t < task.filler_vocab + task.key_vocab]) == task.num_pairs
            )
        else:
            assert answered == {length - 1: int(_salience_answer(task, ids))}
            assert ids[-2] == task.levels  # the query token
    item = dataset[0]
    assert item["input_ids"].dtype == torch.int64 and item["labels"].shape == (length,)


def test_repeated_queries_ask_every_pair_and_leave_no_answer_to_elimination():
    task, length = MQARTask(num_pairs=2, num_queries=6), 64
    data = TaskDataset(task, length, 200, 0, "train")
    repeats, both_asked = 0, 0
    for index in range(200):
        ids, _ = data.example(index)
        asked = ids[length - 2 * task.queries :: 2].tolist()
        repeats += len(asked) > len(set(asked))
        both_asked += len(set(asked)) == 2
    # Six draws from two keys always repeat one; both keys are asked unless all six draws agree (p = 1/32).
    assert repeats == 200 and 170 < both_asked < 200


def test_copy_warmup_is_a_curriculum_of_the_training_split_read_in_order():
    """The first copy_warmup training sequences are copy sequences (over MQAR's ids), the rest MQAR's; held-out splits
    are MQAR only; the training split is read in order, so the warm-up comes first in training."""
    from torch.utils.data import RandomSampler, SequentialSampler
    from transformers import TrainingArguments

    from qkmap_hf.training.optim import QKMapTrainer

    task, length = MQARTask(num_pairs=2, num_queries=8, copy_warmup=5), 64
    train = TaskDataset(task, length, 12, seed=0, split="train")
    for index in range(12):
        ids, labels = train.example(index)
        rng = np.random.default_rng([0, 0, index])
        expected = task.warmup_task().sequence(rng, length) if index < 5 else task.sequence(rng, length)
        assert np.array_equal(ids, expected[0]) and np.array_equal(labels, expected[1])
        assert ((labels != IGNORE_INDEX).sum() == (15 if index < 5 else 8)) and ids.max() < 192
    assert train.ordered and not TaskDataset(MQARTask(), length, 12, 0, "train").ordered
    report = TaskDataset(task, length, 5, seed=0, split="report")
    assert not report.ordered and all((report.example(i)[1] != IGNORE_INDEX).sum() == 8 for i in range(5))

    model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs()))
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    assert isinstance(QKMapTrainer(model=model, args=args, train_dataset=train)._get_train_sampler(), SequentialSampler)
    plain = TaskDataset(MQARTask(), length, 12, 0, "train")
    assert isinstance(QKMapTrainer(model=model, args=args, train_dataset=plain)._get_train_sampler(), RandomSampler)


def test_evidence_depth_and_answer_levels_are_spread():
    task, length = MQARTask(num_pairs=2), 128
    depths = []
    for index in range(400):
        ids, _ = TaskDataset(task, length, 400, 0, "train").example(index)
        keys = np.flatnonzero((ids[: length - 4] >= 64) & (ids[: length - 4] < 128))
        depths.extend(keys.tolist())
    assert min(depths) < 10 and max(depths) > length - 20  # pairs anywhere in the context
    salience = SalienceTask(levels=64)
    levels = {
        int(salience.priority()[TaskDataset(salience, 32, 300, 0, "train").example(i)[1][-1]]) for i in range(300)
    }
    assert min(levels) >= 16 and len(levels) > 40  # the top three quarters of the ranking, most levels reached


@pytest.mark.parametrize(("task", "length"), TASK_CASES)
def test_tuning_and_report_splits_share_no_sequence_with_each_other_or_training(task, length):
    def fingerprints(split: str, count: int) -> set[bytes]:
        data = TaskDataset(task, length, count, seed=0, split=split)
        return {data.example(i)[0].tobytes() for i in range(count)}

    tune, report, train = fingerprints("tune", 200), fingerprints("report", 200), fingerprints("train", 2000)
    assert len(tune) == 200 and len(report) == 200
    assert tune.isdisjoint(report) and tune.isdisjoint(train) and report.isdisjoint(train)
    heldout = heldout_dataset(task, length, 4, seed=0)
    assert heldout.blocks.shape == (8, length) and (heldout.labels != IGNORE_INDEX).any()
    assert heldout.subset(slice(0, 4))[0]["labels"].tolist() == heldout.labels[0].tolist()


def test_parse_task_and_spec():
    assert parse_task("mqar:num_pairs=4") == MQARTask(num_pairs=4)
    assert task_spec(parse_task("salience")) == "salience:levels=128,ranking_seed=0"
    for task in (MQARTask(num_pairs=3), MQARTask(num_pairs=3, num_queries=2), SalienceTask(levels=16)):
        assert parse_task(task_spec(task)) == task
    assert parse_task("mqar:copy_warmup=100") == MQARTask(copy_warmup=100)
    assert "copy_warmup" not in task_spec(MQARTask())  # recorded specs of tasks without the curriculum unchanged
    with pytest.raises(ValueError, match="unknown task 'recall'; choose one of: mqar, salience, copy"):
        parse_task("recall")
    with pytest.raises(ValueError, match="block 24 cannot hold a chunk of 16 twice"):
        TaskDataset(MQARTask(copy_warmup=10), 24, 1, 0, "train")
    with pytest.raises(ValueError, match="pairs not a field of mqar"):
        parse_task("mqar:pairs=4")
    with pytest.raises(ValueError, match=r"num_queries >= 1 \(0\)"):
        TaskDataset(MQARTask(num_pairs=2, num_queries=0), 64, 1, 0, "train")
    with pytest.raises(ValueError, match="cannot hold 40 pairs"):
        TaskDataset(MQARTask(num_pairs=40), 64, 1, 0, "train")


def test_accuracy_of_a_copying_model_is_one_and_of_a_constant_answer_its_share():
    task, length = MQARTask(num_pairs=4), 64
    heldout = heldout_dataset(task, length, 32, seed=0)
    labels = heldout.labels.numpy()
    # A model that copies the right value: at position t it predicts the label of t + 1.
    perfect = np.zeros_like(labels)
    perfect[:, :-1] = np.where(labels[:, 1:] != IGNORE_INDEX, labels[:, 1:], 0)
    assert answer_accuracy(EvalPrediction(predictions=perfect, label_ids=labels))["accuracy"] == 1.0
    constant_value = 64 + 64 + 5  # always the same value token
    constant = np.full_like(labels, constant_value)
    answers = labels[labels != IGNORE_INDEX]
    share = float((answers == constant_value).mean())
    assert answer_accuracy(EvalPrediction(predictions=constant, label_ids=labels))["accuracy"] == pytest.approx(share)


def test_constant_cos_control_at_zero_sine_gain_equals_standard_prior():
    # Content off in both (zero q/k projections in standard_prior, zero sine gains in the control): what is left
    # is scale * RoPE(c_q) . RoPE(c_k) in both, with c = the control's cos gains.
    common = tiny_config_kwargs()
    control = QKMapForCausalLM(
        QKMapConfig(qk_mode="qk_map", qkmap_cos_block="constant", qkmap_logit_scale=None, **common)
    )
    prior = QKMapForCausalLM(QKMapConfig(qk_mode="standard", qk_position_prior="constant", **common))
    groups = common["num_attention_heads"] // common["num_key_value_heads"]
    with torch.no_grad():
        state = {k: v for k, v in control.state_dict().items() if "qk_map" not in k and "q_proj" not in k}
        prior.load_state_dict(state, strict=False)
        for a, b in zip(control.model.layers, prior.model.layers, strict=True):
            feature_map = a.self_attn.qk_map
            feature_map.query_gain.copy_(torch.randn_like(feature_map.query_gain))
            feature_map.key_gain.copy_(torch.randn_like(feature_map.key_gain))
            feature_map.query_gain[:, 1::2] = 0.0  # no sine rows: z reaches nothing
            feature_map.key_gain[:, 1::2] = 0.0
            b.self_attn.q_proj.weight.zero_()
            b.self_attn.k_proj.weight.zero_()
            b.self_attn.position_prior.query_prior.copy_(feature_map.query_gain[:, 0].repeat_interleave(groups, 0))
            b.self_attn.position_prior.key_prior.copy_(feature_map.key_gain[:, 0])
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        expected = prior.eval()(input_ids=ids).logits
        got = control.eval()(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    # The constant rows do not depend on z: scaling the queries and keys changes nothing with zero sine gains.
    with torch.no_grad():
        for layer in control.model.layers:
            layer.self_attn.q_proj.weight.mul_(7.0)
        assert torch.allclose(control(input_ids=ids).logits, expected, atol=1e-5)


def test_constant_cos_rows_get_gradients_and_sine_rows_see_z():
    model = QKMapForCausalLM(QKMapConfig(qkmap_cos_block="constant", **tiny_config_kwargs()))
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    gain = model.model.layers[0].self_attn.qk_map.key_gain.grad
    assert gain[:, 0::2].abs().sum() > 0 and gain[:, 1::2].abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.usefixtures("one_thread")
def test_compare_task_logs_answer_accuracy(tmp_path):
    from qkmap_hf.training.compare import CompareOptions, parse_variant, run_comparison

    options = CompareOptions(
        output_dir=str(tmp_path / "out"), task="mqar:num_pairs=2", preset="tiny", block_size=32, steps=6, seeds=1,
        max_eval_blocks=8, variants=[parse_variant("qk_map_constant_cos")], monitor_steps=0,
    )  # fmt: skip
    result = run_comparison(options)
    assert result.summary[0]["mode"] == "qk_map_constant_cos"
    record = json.loads((tmp_path / "out" / "runs" / "qk_map_constant_cos-seed0" / "qkmap_training.json").read_text())
    accuracies = [h["eval_accuracy"] for h in record["log_history"] if "eval_accuracy" in h]
    assert accuracies and all(0.0 <= a <= 1.0 for a in accuracies)
    assert record["data"]["extra"]["task"].startswith("mqar:num_pairs=2")


# The smallest size that learns: salience over 16 levels in 32-token sequences, QK-Norm at the synthetic sweep's
# tuned rate (3e-3), which passes 90 % by step 150 and holds 100 % after it. The reported instances' long runs
# (salience:levels=128 at 2000 steps, MQAR through the copy curriculum) are benchmarks:
# benchmarks/synthetic_tasks.sh and benchmarks/mqar_curriculum_pilot.py.
LEARNED_TASK, LEARNED_LENGTH, LEARNED_STEPS = "salience:levels=16", 32, 240
LEARNED_ARM, LEARNED_RATE = "qk_norm", 3e-3


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_the_smallest_instance_that_learns_is_learned_above_90_percent(tmp_path):
    from qkmap_hf.training.compare import CompareOptions, parse_variant, run_comparison

    options = CompareOptions(
        output_dir=str(tmp_path / "out"), task=LEARNED_TASK, preset="tiny", block_size=LEARNED_LENGTH, batch_size=16,
        steps=LEARNED_STEPS, seeds=1, first_seed=7, learning_rate=LEARNED_RATE, eval_steps=LEARNED_STEPS // 4,
        max_eval_blocks=256, variants=[parse_variant(LEARNED_ARM)], monitor_steps=0,
    )  # fmt: skip
    run_comparison(options)
    record = json.loads((tmp_path / "out" / "runs" / f"{LEARNED_ARM}-seed7" / "qkmap_training.json").read_text())
    accuracies = [(h["step"], h["eval_accuracy"]) for h in record["log_history"] if "eval_accuracy" in h]
    assert accuracies[0] == (0, pytest.approx(0.0, abs=0.1))  # untrained: about chance
    assert accuracies[-1][0] == LEARNED_STEPS and accuracies[-1][1] > 0.9


def test_evidence_layouts_find_the_asked_pair_or_the_top_item_and_the_distractors():
    from qkmap_lab.task_probes import evidence_layouts

    task = MQARTask(num_pairs=4, num_queries=2)
    ids, labels = TaskDataset(task, 48, 1, 0, "report").example(0)
    answers = evidence_layouts(task, ids)
    assert len(answers) == 2
    for answer in answers:
        asked = answer.key
        assert ids[asked] == ids[answer.position] and ids[asked + 1] == labels[answer.position + 1]
        assert answer.evidence == (asked, asked + 1) and len(answer.distractors) == 6
        assert not set(answer.evidence) & set(answer.distractors)
    # Queries drawn with replacement: a key asked again has its earlier query and answer as evidence too.
    task = MQARTask(num_pairs=2, num_queries=8)
    ids, _ = TaskDataset(task, 32, 1, 0, "report").example(0)
    answers = evidence_layouts(task, ids)
    for index, answer in enumerate(answers):
        earlier = [a.position for a in answers[:index] if ids[a.position] == ids[answer.position]]
        assert answer.evidence == (answer.key, answer.key + 1, *(p for q in earlier for p in (q, q + 1)))
        assert len(answer.distractors) == 2 and not set(answer.evidence) & set(answer.distractors)
    assert max(len(a.evidence) for a in answers) >= 6  # some key was asked at least three times
    salience = SalienceTask(levels=16)
    for index in range(8):
        ids, labels = TaskDataset(salience, 24, 8, 0, "report").example(index)
        (answer,) = evidence_layouts(salience, ids)
        priority = salience.priority()
        # Brute force: the context item of highest priority is the answer, and it is the evidence.
        context = ids[: answer.position]
        assert answer.position == 22 and labels[answer.position + 1] == context[np.argmax(priority[context])]
        assert answer.evidence == (answer.key,) and ids[answer.key] == labels[answer.position + 1]
        assert sorted((*answer.evidence, *answer.distractors)) == list(range(22))


def _probe_qk_norm_and_standard(task, length: int) -> dict[str, dict]:
    """The probes of an untrained QK-Norm and standard model (seed 0), with the key-scale facts both must show."""
    from qkmap_lab.task_probes import task_probes

    results = {}
    for mode in ("qk_norm", "standard"):
        torch.manual_seed(0)
        model = QKMapForCausalLM(QKMapConfig(qk_mode=mode, **tiny_config_kwargs(vocab_size=257)))
        results[mode] = task_probes(model, task, length=length, examples=6, key_scales=(4.0,))
    qk_norm, standard = (results[m]["evidence_key_scale"]["by_factor"]["4"] for m in ("qk_norm", "standard"))
    assert max(abs(c) for c in qk_norm["layer_key_mass_change"]) < 1e-5 and qk_norm["answers_changed"] == 0.0
    assert max(abs(c) for c in standard["layer_key_mass_change"]) > 1e-4
    return results


@pytest.mark.parametrize(("task", "length"), [(MQARTask(num_pairs=3), 32), (SalienceTask(levels=16), 24)])
def test_key_scale_probe_qk_norm_divides_the_scale_out_and_standard_does_not(task, length):
    contrast = _probe_qk_norm_and_standard(task, length)["standard"]["evidence_contrast"]
    assert len(contrast["per_head_log2_lift"]) == 2 and len(contrast["per_head_log2_lift"][0]) == 4
    assert contrast["best_head_log2_lift"] >= contrast["mean_log2_lift"]


@pytest.mark.slow
def test_analyze_task_writes_the_probes_of_every_saved_model(tmp_path):
    from qkmap_hf.cli import main
    from qkmap_hf.training.data import byte_level_tokenizer

    results = _probe_qk_norm_and_standard(MQARTask(num_pairs=3), 32)
    for mode in ("qk_norm", "standard"):
        torch.manual_seed(0)
        QKMapForCausalLM(QKMapConfig(qk_mode=mode, **tiny_config_kwargs(vocab_size=257))).save_pretrained(
            tmp_path / mode
        )
        byte_level_tokenizer().save_pretrained(tmp_path / mode)
    out = tmp_path / "analysis"
    code = main(["analyze", str(tmp_path / "qk_norm"), "--compare", str(tmp_path / "standard"), "--task",
                 "mqar:num_pairs=3", "--task-length", "32", "--task-examples", "6", "--output-dir", str(out)])  # fmt: skip
    written = json.loads((out / "task_analysis.json").read_text())
    assert code == 0 and [m["model"] for m in written["models"]] == [
        str(tmp_path / "qk_norm"),
        str(tmp_path / "standard"),
    ]
    expected = results["standard"]["evidence_contrast"]["mean_log2_lift"]
    assert written["models"][1]["evidence_contrast"]["mean_log2_lift"] == pytest.approx(expected)


def test_task_report_reads_report_runs_steps_to_thresholds_and_paired_intervals(tmp_path):
    from qkmap_lab.task_report import build_report

    curves = {
        ("standard", 0): [0.1, 0.3, 0.6, 0.7],
        ("standard", 1): [0.1, 0.2, 0.4, 0.45],
        ("qk_map", 0): [0.2, 0.55, 0.92, 0.95],
        ("qk_map", 1): [0.1, 0.6, 0.8, 0.91],
    }
    for (arm, seed), accuracies in curves.items():
        folder = tmp_path / "mqar" / "runs" / "report" / arm / f"seed{seed}"
        folder.mkdir(parents=True)
        history = [{"step": 100 * i, "eval_accuracy": a, "eval_loss": 1.0} for i, a in enumerate(accuracies)]
        (folder / "qkmap_training.json").write_text(json.dumps({"log_history": history}))
    # Each shard's summary.json holds its arms' tuning: the choice, its tuning losses, the grid.
    grid = {"learning_rate": [1e-3, 3e-3, 1e-2], "logit_scale_multiplier": [1, 4]}
    shard = {
        "standard": ({"learning_rate": 3e-3, "logit_scale_multiplier": 4}, [0.5, 0.7]),
        "qk_map": ({"learning_rate": 1e-3, "logit_scale_multiplier": 1}, [0.2, 0.4]),
    }
    for index, (arm, (values, losses)) in enumerate(shard.items()):
        choice = ";".join(f"{k}={v}" for k, v in values.items())
        tuning_losses = {choice: {"1000": losses[0], "1001": losses[1]}, "other": {"1000": 9.0, "1001": 9.0}}
        if arm == "standard":  # the same learning rate at the other temperature, a little worse: the edge's margin
            tuning_losses["learning_rate=0.003;logit_scale_multiplier=1"] = {"1000": 0.62, "1001": 0.64}
        summary = {"settings": {"tune": grid}, "arms": {arm: {"choice": choice, "choice_values": values,
                                                             "tuning_losses": tuning_losses}}}  # fmt: skip
        (tmp_path / "mqar" / f"shard-{index}").mkdir()
        (tmp_path / "mqar" / f"shard-{index}" / "summary.json").write_text(json.dumps(summary))
    built = build_report([tmp_path / "mqar"], tmp_path / "out")
    assert {k: v for k, v in built["tuning"]["mqar"]["standard"].items() if k != "profiles"} == {
        "choice": shard["standard"][0], "tuning_loss": pytest.approx(0.6), "points": 3, "edges": ["logit_scale_multiplier"],
        "edge_margins": {"logit_scale_multiplier": pytest.approx(0.03)},
    }  # fmt: skip
    assert built["tuning"]["mqar"]["qk_map"]["edges"] == ["learning_rate", "logit_scale_multiplier"]
    assert built["tuning"]["mqar"]["qk_map"]["edge_margins"] == {"learning_rate": None, "logit_scale_multiplier": None}
    assert built["tuning"]["mqar"]["standard"]["profiles"] == {
        "learning_rate": {"0.003": pytest.approx(0.6)},
        "logit_scale_multiplier": {"1": pytest.approx(0.63), "4": pytest.approx(0.6)},
    }  # per value of a knob, the best loss over the other knobs ("other" names no setting: left out)
    text = (tmp_path / "out" / "task_report.md").read_text()
    assert (
        "| qk_map | 0.001* | 1* | 0.3000 | 2 |" in text and "| standard | 0.003 | 4* (by 0.03) | 0.6000 | 3 |" in text
    )
    assert "best tuning loss at each logit_scale_multiplier" in text and "| standard | 0.6300 | 0.6000 |" in text
    report = built["mqar"]
    assert report["standard"]["steps_to_50"] == {"mean": 200.0, "reached": "1/2"}
    assert report["qk_map"]["steps_to_50"] == {"mean": 100.0, "reached": "2/2"}
    assert report["qk_map"]["steps_to_90"] == {"mean": 250.0, "reached": "2/2"}
    assert report["qk_map"]["final_accuracy_mean"] == pytest.approx(0.93)
    assert report["qk_map"]["vs_standard"]["mean"] == pytest.approx(((0.95 - 0.7) + (0.91 - 0.45)) / 2)
    assert (tmp_path / "out" / "accuracy_curves.png").exists()


class _StubLM(torch.nn.Module):
    """A forward that answers from the sequence itself: ``oracle`` predicts token t + 1 at t, else a constant."""

    def __init__(self, oracle: bool, constant: int = 0):
        super().__init__()
        self.oracle, self.constant = oracle, constant
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        predicted = torch.roll(input_ids, -1, dims=1) if self.oracle else torch.full_like(input_ids, self.constant)
        return type("Output", (), {"logits": torch.nn.functional.one_hot(predicted, 257).float()})()


@pytest.mark.parametrize(("task", "length"), [(MQARTask(num_pairs=4), 64), (SalienceTask(levels=16), 32)])
def test_task_accuracy_of_an_oracle_is_one_and_of_a_constant_answer_its_share(task, length):
    from qkmap_lab.task_probes import evidence_layouts, task_accuracy

    assert task_accuracy(_StubLM(oracle=True), task, length, examples=20, batch_size=7) == 1.0
    data = TaskDataset(task, length, 20, 0, "report")
    answers = [int(ids[a.position + 1]) for ids, _ in map(data.example, range(20)) for a in evidence_layouts(task, ids)]
    constant = max(set(answers), key=answers.count)
    share = answers.count(constant) / len(answers)
    assert 0 < share < 1
    assert task_accuracy(_StubLM(oracle=False, constant=constant), task, length, examples=20) == pytest.approx(share)


def test_task_report_generalization_scores_saved_models_on_other_instances(tmp_path):
    from qkmap_hf.training.data import byte_level_tokenizer
    from qkmap_lab.task_generalization import model_digest, parse_generalize
    from qkmap_lab.task_probes import task_accuracy
    from qkmap_lab.task_report import build_report, main

    sweep = tmp_path / "mqar"
    for arm, seed in (("standard", 0), ("qk_map", 0), ("qk_map", 1)):
        torch.manual_seed(seed)
        model = QKMapForCausalLM(QKMapConfig(qk_mode=arm, **tiny_config_kwargs(vocab_size=257)))
        folder = sweep / "shard-0" / "models" / arm / f"seed{seed}"
        model.save_pretrained(folder)
        byte_level_tokenizer().save_pretrained(folder)
        history = [{"step": 10, "eval_accuracy": 0.5}]
        record = {"log_history": history, "data": {"extra": {"task": "mqar:num_pairs=2"}}}
        (folder / "qkmap_training.json").write_text(json.dumps(record))
    specs = [parse_generalize("mqar:num_pairs=4@16,32"), parse_generalize("salience@16")]
    report = build_report([sweep], tmp_path / "out", specs)["generalization"]["mqar"]
    assert list(report) == ["mqar:num_pairs=4,key_vocab=64,value_vocab=64,filler_vocab=64"]
    (scored,) = report.values()
    assert sorted(scored) == ["qk_map", "standard"] and len(scored["qk_map"]["32"]) == 2
    reloaded = QKMapForCausalLM.from_pretrained(sweep / "shard-0" / "models" / "standard" / "seed0")
    assert scored["standard"]["16"] == [task_accuracy(reloaded, MQARTask(num_pairs=4), 16, 128)]
    assert (tmp_path / "out" / "generalization.png").exists()
    assert "scored on mqar:num_pairs=4" in (tmp_path / "out" / "task_report.md").read_text()

    # The scores are kept by model digest: a rerun reuses them, and scores again only a model whose bytes changed.
    scores_path = tmp_path / "out" / "generalization_scores.json"
    kept = json.loads(scores_path.read_text())
    assert len(kept) == 3 * 2  # 3 models x 2 lengths (the salience spec is not the sweep's task)
    qk_map_digest = model_digest(sweep / "shard-0" / "models" / "qk_map" / "seed1")
    scores_path.write_text(json.dumps({k: (0.123 if k.startswith(qk_map_digest) else v) for k, v in kept.items()}))
    torch.manual_seed(7)
    retrained = QKMapForCausalLM(QKMapConfig(qk_mode="standard", **tiny_config_kwargs(vocab_size=257)))
    retrained.save_pretrained(sweep / "shard-0" / "models" / "standard" / "seed0")
    again = build_report([sweep], tmp_path / "out", specs)["generalization"]["mqar"]
    (rescored,) = again.values()
    assert rescored["qk_map"]["16"][1] == rescored["qk_map"]["32"][1] == 0.123  # kept, not recomputed
    assert rescored["standard"]["16"] == [task_accuracy(retrained, MQARTask(num_pairs=4), 16, 128)]
    assert len(json.loads(scores_path.read_text())) == 3 * 2 + 2  # the retrained model's scores added
    with pytest.raises(SystemExit):
        main([str(sweep), "--output-dir", str(tmp_path / "bad"), "--generalize", "mqar:num_pairs=4"])
    with pytest.raises(ValueError, match="expected TASK@LENGTH"):
        parse_generalize("mqar@0")


def test_task_report_summarises_the_probes_per_arm_over_seeds_with_paired_intervals(tmp_path):
    from qkmap_lab.task_report import build_report

    sweep = tmp_path / "salience"
    lifts = {("standard", 0): 0.5, ("standard", 1): 0.6, ("standard", 2): 0.7, ("qk_map", 0): 1.5, ("qk_map", 1): 1.6}
    lifts |= {("qk_map", 2): 1.8, ("qk_norm", 0): 0.0, ("qk_norm", 1): 0.1, ("qk_norm", 2): 0.2}
    models = []
    for (arm, seed), lift in lifts.items():
        run = sweep / "shard-0" / "runs" / "report" / arm / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "qkmap_training.json").write_text(json.dumps({"log_history": [{"step": 10, "eval_accuracy": 0.9}]}))
        scale = {"by_factor": {"2": {"answers_changed": lift / 4, "layer_key_mass_change": [lift, 3 * lift]}}}
        scale["accuracy_first_query"] = 0.5 + seed / 10
        contrast = {"mean_log2_lift": lift, "best_head_log2_lift": 2 * lift}
        model = str(sweep / "shard-0" / "models" / arm / f"seed{seed}")
        models.append({"model": model, "accuracy": 0.8, "evidence_contrast": contrast, "evidence_key_scale": scale})
    (sweep / "analysis").mkdir()
    (sweep / "analysis" / "task_analysis.json").write_text(json.dumps({"task": "salience", "models": models}))
    report = build_report([sweep], tmp_path / "out")
    probes = report["probes"]["salience"]
    assert probes["qk_map"]["evidence_log2_lift"]["mean"] == pytest.approx(4.9 / 3)
    assert probes["qk_map"]["evidence_log2_lift"]["vs_standard"]["mean"] == pytest.approx(3.1 / 3)
    assert probes["qk_map"]["evidence_log2_lift"]["vs_standard"]["n"] == 3
    assert probes["qk_map"]["key_mass_change_x2"]["mean"] == pytest.approx(2 * 4.9 / 3)
    assert probes["standard"]["answers_changed_x2"]["mean"] == pytest.approx(1.8 / 12)
    assert probes["qk_norm"]["first_answer_accuracy"]["mean"] == pytest.approx(0.6)
    verdicts = report["verdicts"]["salience"]
    # qk_map's lift is above both baselines on every seed, with a tight spread: the rule says supported; the
    # accuracies are equal, so that claim is inconclusive.
    assert verdicts["stronger contrast on the evidence (claim 4)"] == "supported"
    assert verdicts["higher accuracy (claim 1 on the task)"] == "inconclusive"
    assert verdicts["answers follow the evidence key's scale, x2 (claim 2)"] == "supported"
    assert "vs_standard" not in probes["standard"]["accuracy"]
    text = (tmp_path / "out" / "task_report.md").read_text()
    assert "salience: probes" in text and "answers changed, key x2" in text
    assert "| qk_norm | 3 | 0.800 | 0.600 | +0.10 |" in text  # accuracy, first answer, lift


def test_task_report_profiles_read_every_tuning_run_finished_so_far_while_a_widened_sweep_runs(tmp_path):
    """summary.json is written when a sweep ends; a sweep widening its grid has newer tuning runs in
    sweep_losses.csv, and the per-knob profiles show them (only final-step tuning losses count)."""
    from qkmap_lab.task_tuning import tuning_choices

    shard = tmp_path / "mqar" / "shard-0"
    shard.mkdir(parents=True)
    old_point, new_point = (
        "learning_rate=0.001;logit_scale_multiplier=1",
        "learning_rate=0.001;logit_scale_multiplier=0.5",
    )
    summary = {
        "settings": {"tune": {"learning_rate": [1e-3], "logit_scale_multiplier": [1, 4]}, "steps": 2000},
        "arms": {"qk_map": {"choice": old_point, "choice_values": {"learning_rate": 1e-3, "logit_scale_multiplier": 1},
                            "tuning_losses": {old_point: {"1000": 0.2}}}},
    }  # fmt: skip
    (shard / "summary.json").write_text(json.dumps(summary))
    rows = [
        f"qk_map,tune,{old_point},1000,2000,validation,0.2",
        f"qk_map,tune,{new_point},1000,1000,validation,0.01",  # not the final step
        f"qk_map,tune,{new_point},1000,2000,validation,0.05",
        f"qk_map,report,{new_point},0,2000,validation,0.001",  # a report run: not tuning
    ]
    (shard / "sweep_losses.csv").write_text("arm,phase,setting,seed,step,split,loss\n" + "\n".join(rows) + "\n")
    profiles = tuning_choices(tmp_path / "mqar")["qk_map"]["profiles"]
    assert profiles["logit_scale_multiplier"] == {"0.5": pytest.approx(0.05), "1": pytest.approx(0.2)}


def test_task_report_tuning_only_reads_the_csvs_of_a_running_or_restored_sweep(tmp_path, capsys):
    """No summary.json and no report run: the choices so far, every grid point, and a heatmap, from the CSVs."""
    import math

    from qkmap_lab.task_report import main

    losses = {  # (arm, shard, learning_rate, temperature) -> final tuning loss
        ("qk_map", 0, "0.001", "0.5"): 0.004,
        ("qk_map", 0, "0.001", "1"): 0.2,
        ("qk_map", 0, "0.001", "4"): 2.1,
        ("qk_map", 0, "0.01", "0.5"): 0.9,
        ("qk_map", 0, "0.01", "1"): 1.5,
        ("qk_map", 0, "0.01", "4"): 3.0,
        ("standard", 1, "0.001", "1"): float("nan"),  # diverged: ranks last
        ("standard", 1, "0.001", "4"): 0.8,
    }
    rows = {0: [], 1: []}
    for (arm, shard, rate, temperature), loss in losses.items():
        setting = f"learning_rate={rate};logit_scale_multiplier={temperature}"
        rows[shard] += [
            f"{arm},tune,{setting},1000,5,validation,0.01",
            f"{arm},tune,{setting},1000,10,validation,{loss}",
        ]
    rows[0].append("qk_map,report,learning_rate=0.01;logit_scale_multiplier=4,0,10,validation,0.0001")
    for shard, lines in rows.items():
        folder = tmp_path / "mqar" / f"shard-{shard}"
        folder.mkdir(parents=True)
        (folder / "sweep_losses.csv").write_text("arm,phase,setting,seed,step,split,loss\n" + "\n".join(lines) + "\n")

    out = tmp_path / "out"
    assert main([str(tmp_path / "mqar"), "--output-dir", str(out), "--tuning-only"]) == 0
    tuning = json.loads((out / "tuning.json").read_text())["mqar"]
    finite = {key: loss for key, loss in losses.items() if key[0] == "qk_map"}
    best = min(finite, key=finite.get)
    assert tuning["qk_map"]["choice"] == {"learning_rate": float(best[2]), "logit_scale_multiplier": float(best[3])}
    assert tuning["qk_map"]["points"] == 6 and tuning["qk_map"]["tuning_loss"] == pytest.approx(finite[best])
    assert tuning["qk_map"]["edges"] == ["learning_rate", "logit_scale_multiplier"]  # 0.001 and 0.5: both edges
    other_temperatures = min(v for k, v in finite.items() if k[3] != best[3])
    assert tuning["qk_map"]["edge_margins"]["logit_scale_multiplier"] == pytest.approx(
        other_temperatures - finite[best]
    )
    assert tuning["standard"]["choice"]["logit_scale_multiplier"] == 4.0  # the diverged run did not win
    assert math.isnan(tuning["standard"]["losses"]["learning_rate=0.001;logit_scale_multiplier=1"])

    text = (out / "tuning.md").read_text()
    assert text in capsys.readouterr().out  # printed too
    grid = "| learning_rate (rows) / logit_scale_multiplier (columns) | 0.5 | 1 | 4 |"
    assert grid in text
    assert "| 0.001 | **0.0040** | 0.2000 | 2.1000 |" in text and "| 0.01 | 0.9000 | 1.5000 | 3.0000 |" in text
    assert "| 0.001 | nan | **0.8000** |" in text
    assert (out / "tuning_grid-mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit) as error:
        main([str(tmp_path / "mqar"), "--output-dir", str(out), "--tuning-only", "--generalize", "mqar@64"])
    assert error.value.code == 2
    with pytest.raises(FileNotFoundError, match="no finished tuning run"):
        main([str(tmp_path / "empty"), "--output-dir", str(out), "--tuning-only"])


def test_task_report_grid_marks_the_sweeps_choice_where_its_tie_rule_passed_over_the_lowest(tmp_path):
    """A sweep with --tie-tolerance can choose a setting whose tuning loss is not the lowest: the full report's grid
    tables (and heatmap) mark the sweep's choice, as its choices table does, not the lowest loss."""
    from qkmap_lab.task_report import build_report

    shard = tmp_path / "mqar" / "shard-0"
    run = shard / "models" / "qk_map" / "seed0"
    run.mkdir(parents=True)
    history = [{"step": 0, "eval_accuracy": 0.0}, {"step": 10, "eval_accuracy": 1.0}]
    (run / "qkmap_training.json").write_text(json.dumps({"log_history": history}))
    chosen, lowest = "learning_rate=0.003;logit_scale_multiplier=1", "learning_rate=0.001;logit_scale_multiplier=1"
    losses = {chosen: 0.0007, lowest: 0.0002}
    rows = [f"qk_map,tune,{setting},1000,10,validation,{loss}" for setting, loss in losses.items()]
    (shard / "sweep_losses.csv").write_text("arm,phase,setting,seed,step,split,loss\n" + "\n".join(rows) + "\n")
    summary = {
        "settings": {"tune": {"learning_rate": [1e-3, 3e-3], "logit_scale_multiplier": [1]}, "steps": 10},
        "arms": {"qk_map": {"choice": chosen, "choice_values": {"learning_rate": 3e-3, "logit_scale_multiplier": 1},
                            "tuning_losses": {s: {"1000": loss} for s, loss in losses.items()}}},
    }  # fmt: skip
    (shard / "summary.json").write_text(json.dumps(summary))

    build_report([tmp_path / "mqar"], tmp_path / "out")
    text = (tmp_path / "out" / "task_report.md").read_text()
    grid = text[text.index("every tuning loss so far") :]
    assert "| 0.003 | **0.0007** |" in grid and "| 0.001 | 0.0002 |" in grid
    assert "| qk_map | 0.003* (by -0.0005) | 1 | 0.0007 | 2 |" in text  # the choices table: an edge, lost by 5e-4
    assert (tmp_path / "out" / "tuning_grid-mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
