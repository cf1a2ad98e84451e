"""``qkmap heal``: up-train an exactly converted model into the periodic QK-MAP regime, distilling from its source.

An exact conversion is standard attention in disguise (phases ~1e-3 rad) and plain up-training keeps it so: the
frequency gradient sits below Adam's epsilon and the cos rows have zero gain on both sides, hence zero gradient.
Healing is ``qkmap train`` (same options, data, optimizer groups, checkpoints) with three additions:

- schedules (``schedules.py``) set the frequencies from progress, ``omega_c -> alpha / p90|z_c|`` log-linearly
  (inverse-frequency gains keep ``(1/omega) sin(omega z)`` a soft clip of ``z`` on the way), and switch on the
  dead rows once the phases have grown;
- the loss is ``CE + lambda * KL(teacher || student)`` with the source model as teacher (no grad, eval mode). Its
  memory cost is one more copy of the source weights in float32 plus one ``(batch, block, vocab)`` logits tensor
  (SmolLM2-135M: 0.54 GB + 0.2 GB at batch 8 x 128);
- every evaluation adds a row (``OUT/heal.json``, ``OUT/heal.csv``): per-layer median/p90 phase, regime and cos
  energy share (``qkmap_hf.phases``), held-out perplexity and KL to the teacher.

A converted QK-Norm (Qwen3) model (``qkmap_input_norm``) also gets ``NormAnnealSchedule``: its norm power goes
1 -> 0 over ``norm_ramp`` and the norm is folded into ``q_proj``/``k_proj`` before the final save (plain QK-MAP).

The healed model is saved with absolute gains (the native parametrization; the frequencies are fixed at the end,
so it is the same function) and ``qkmap_healing.json`` with source, recipe and tokens seen for the card.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from transformers import TrainerCallback

from ..fileio import atomic_copy, atomic_write_csv, atomic_write_json
from ..flags import check_numbers, fraction_window, parsed_by
from ..loading import load_causal_lm, load_gguf_causal_lm, load_source_tokenizer
from ..phases import PhaseRecorder, feature_map_layers
from ..provenance import PROVENANCE_FILES, HealingRecord
from ..safety import (
    Vocabulary,
    check_not_escaping,
    check_same_vocabulary,
    tokenizer_file,
)
from .guards import check_output_dir, check_train_options
from .optim import QKMapTrainer
from .schedules import GainSwitchOnSchedule, NormAnnealSchedule, PhaseScaleSchedule, Ramp, ValueSchedule
from .trainer import TrainOptions, load_tokenizer, resume_checkpoint, train

HEAL_RECORD = "heal.json"
HEAL_TABLE = "heal.csv"
HEAL_PROVENANCE = PROVENANCE_FILES["healing"]
STATE_FILE = "heal_state.safetensors"
TENSOR_LIST = "tensor_list"  # metadata marker: this state entry is a list of that many tensors in the file


WINDOW = parsed_by(fraction_window)


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class HealOptions:
    """What ``qkmap heal`` adds to ``qkmap train``'s options; field ``phase_ramp`` is flag ``--phase-ramp``.

    Schedules are fractions of ``--max-steps``, so a short run goes all the way.
    """

    teacher: str = field(metadata=_help("the source model folder (the converted model's origin)"))
    alpha: float = field(default=1.1, metadata=_help("target p90 phase per channel, rad"))
    phase_ramp: tuple[float, float] = field(
        default=(0.0, 0.5),
        metadata=_help("window over which omega goes to alpha / p90|z|", action=WINDOW, metavar="START:END"),
    )
    phase_ramp_space: str = field(
        default="linear",
        metadata=_help(
            "linear: phases grow linearly over the window; log: equal time per decade of phase",
            choices=("linear", "log"),
        ),
    )
    compensate_gains: bool = field(
        default=True,
        metadata=_help("scale each sine gain by its least-squares fit of z as the sine bends (keeps the logit scale)"),
    )
    layerwise: bool = field(default=False, metadata=_help("ramp the layers one after another, first to last"))
    block_spread: float = field(default=2.0, metadata=_help("phase ratio between frequency blocks"))
    recalibrate_every: int = field(
        default=10, metadata=_help("re-measure p90|z| every N steps to hold the phases (0: calibrate once)")
    )
    calibration_blocks: int = field(default=8, metadata=_help("held-out blocks that measure p90|z|"))
    switch_on_ramp: tuple[float, float] = field(
        default=(0.4, 0.6),
        metadata=_help(
            "window over which dead (cos, extra-block) key gains ramp to --switch-on-key-gain",
            action=WINDOW,
            metavar="START:END",
        ),
    )
    switch_on_key_gain: float = field(
        default=0.3, metadata=_help("key gain of dead sine rows (extra frequency blocks) after switch-on")
    )
    cos_share: float = field(
        default=0.12,
        metadata=_help(
            "cos rows switched on (both sides) to carry this share of the feature energy; 0: key side only, at "
            "--switch-on-key-gain"
        ),
    )
    kl_weight: float = field(default=1.0, metadata=_help("lambda in CE + lambda * KL(teacher||student)"))
    kl_weight_end: float | None = field(
        default=0.0,
        metadata=_help(
            "lambda at the end of the run, reached linearly (give the --kl-weight value for a constant weight)"
        ),
    )
    native_gains: bool = field(
        default=True,
        metadata=_help(
            "save with the native absolute gains (--keep-inverse-frequency-gains: the inverse-frequency ones)",
            negated_by={
                "--keep-inverse-frequency-gains": "save with inverse-frequency gains instead of the native absolute ones"
            },  # the old spelling of --no-native-gains
        ),
    )
    norm_ramp: tuple[float, float] = field(
        default=(0.0, 0.8),
        metadata=_help(
            "converted QK-Norm models: window over which the norm power goes 1 -> 0 (folded away at the end)",
            action=WINDOW,
            metavar="START:END",
        ),
    )

    def __post_init__(self) -> None:
        """Refuse, naming the flag, what would train a NaN model or mean nothing (checked before any loading)."""
        check_numbers(
            self,
            positive=("alpha", "block_spread", "calibration_blocks"),
            non_negative=("recalibrate_every", "switch_on_key_gain", "kl_weight", "kl_weight_end", "cos_share"),
            fractions=("phase_ramp", "switch_on_ramp", "norm_ramp", "cos_share"),
        )
        for name in ("phase_ramp", "switch_on_ramp", "norm_ramp"):
            start, end = getattr(self, name)
            if start > end:
                raise ValueError(f"--{name.replace('_', '-')} {start}:{end}: START must not exceed END.")

    def schedules(self) -> tuple[PhaseScaleSchedule, GainSwitchOnSchedule, ValueSchedule]:
        phase = PhaseScaleSchedule(self.alpha, Ramp(*self.phase_ramp), layerwise=self.layerwise,
                                   block_spread=self.block_spread, recalibrate_every=self.recalibrate_every,
                                   space=self.phase_ramp_space, compensate_gains=self.compensate_gains)  # fmt: skip
        switch = GainSwitchOnSchedule(self.switch_on_key_gain, Ramp(*self.switch_on_ramp), layerwise=self.layerwise,
                                      cos_share=self.cos_share, phase=phase)  # fmt: skip
        end = self.kl_weight if self.kl_weight_end is None else self.kl_weight_end
        return phase, switch, ValueSchedule(self.kl_weight, end, Ramp(0.0, 1.0), name="kl_weight")


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(teacher || student) = sum_v p_t (log p_t - log p_s)``, in float32."""
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    student = F.log_softmax(student_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def set_gain_parametrization(model: torch.nn.Module, parametrization: str) -> None:
    """Re-express every layer's stored gains as ``absolute`` or ``inverse_frequency`` without changing the function."""
    inverse = parametrization == "inverse_frequency"
    with torch.no_grad():
        for attention in feature_map_layers(model):
            feature_map = attention.qk_map
            if feature_map.inverse_frequency_gains == inverse:
                continue
            omega = feature_map.frequency().repeat_interleave(2, dim=1)
            for gain in (feature_map.query_gain, feature_map.key_gain):
                gain.copy_(gain.float() * omega if inverse else gain.float() / omega)
            feature_map.inverse_frequency_gains = inverse
    model.config.qkmap_gain_parametrization = parametrization


def load_teacher(path: str, dtype: torch.dtype = torch.float32):
    """The source model in eval mode with gradients off (safetensors folder, or a folder with one GGUF file)."""
    return load_teacher_with_vocabulary(path, dtype)[0]


def load_teacher_with_vocabulary(path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Vocabulary]:
    """``load_teacher`` plus what ``heal`` compares with the student before training: its tokenizer and width."""
    folder = Path(path)
    if not (folder / "config.json").exists():
        ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if len(ggufs) != 1:
            raise FileNotFoundError(f"--teacher {path}: expected a model folder with config.json (or one .gguf file).")
        teacher, tokenizer = load_gguf_causal_lm(folder, ggufs[0].name, dtype=dtype)
        config_file = tokenizer_source = str(ggufs[0])
    else:
        teacher = load_causal_lm(folder, dtype=dtype)
        tokenizer_source, config_file = tokenizer_file(folder), str(folder / "config.json")
        tokenizer = load_source_tokenizer(folder)
    teacher.eval().requires_grad_(False)
    width = teacher.get_output_embeddings().weight.shape[0]
    return teacher, Vocabulary(tokenizer_source, tokenizer, config_file, width)


def check_teacher_vocabulary(options: TrainOptions, student_tokenizer, teacher: Vocabulary) -> None:
    """Distillation compares logits id by id: the teacher must have the student's tokens at the same ids."""
    student_folder = Path(options.tokenizer or options.model)
    config = Path(options.model) / "config.json"
    width = json.loads(config.read_text(encoding="utf-8")).get("vocab_size") if config.is_file() else None
    student = Vocabulary(tokenizer_file(student_folder), student_tokenizer, str(config), width)
    check_same_vocabulary(
        teacher,
        student,
        purpose="distillation compares their logits token by token; pass the converted model's own source as --teacher",
    )


def _save_state(path: Path, schedules: list, extra: dict[str, Any]) -> None:
    """Schedule state as safetensors (tensors) plus JSON metadata; never pickled."""
    from safetensors.torch import save_file

    tensors, meta = {}, dict(extra)
    for schedule in schedules:
        for key, value in schedule.state_dict().items():
            name = f"{schedule.name}.{key}"
            if isinstance(value, list) and value and all(isinstance(t, torch.Tensor) for t in value):
                meta[name] = {TENSOR_LIST: len(value)}
                tensors.update({f"{name}.{i}": t.contiguous() for i, t in enumerate(value)})
            else:  # JSON: numbers, strings, lists of them (an empty list stays a list)
                meta[name] = value
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"heal": json.dumps(meta)})
    tmp.replace(path)


def _load_state(path: Path, schedules: list) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["heal"])
        for schedule in schedules:
            keys = {key.split(".", 1)[1] for key in meta if key.startswith(f"{schedule.name}.")}
            state = {}
            for key in keys:
                name = f"{schedule.name}.{key}"
                value = meta[name]
                if isinstance(value, dict) and TENSOR_LIST in value:
                    value = [handle.get_tensor(f"{name}.{i}") for i in range(value[TENSOR_LIST])]
                elif isinstance(value, int) and f"{name}.0" in handle.keys():  # noqa: SIM118  (files before TENSOR_LIST)
                    value = [handle.get_tensor(f"{name}.{i}") for i in range(value)]
                state[key] = value
            schedule.load_state_dict(state)
    return meta


class HealTrainer(QKMapTrainer):
    """``QKMapTrainer`` with the heal schedules applied before every step and distillation in the loss."""

    def __init__(self, *args, heal_options: HealOptions, teacher, resumed_from: str | None = None,
                 registry: dict | None = None, extra_schedules: tuple = (), **kwargs):  # fmt: skip
        model = kwargs["model"]
        set_gain_parametrization(model, "inverse_frequency")
        self.heal_options = heal_options
        self.phase_schedule, self.switch_schedule, self.kl_schedule = heal_options.schedules()
        if getattr(model.config, "qkmap_input_norm", False) and not any(
            isinstance(schedule, NormAnnealSchedule) for schedule in extra_schedules
        ):  # a converted QK-Norm model: anneal its norm away (folded before the final save)
            extra_schedules = (*extra_schedules, NormAnnealSchedule(Ramp(*heal_options.norm_ramp)))
        self.schedules = [self.phase_schedule, self.switch_schedule, *extra_schedules]
        self.rows: list[dict[str, Any]] = []
        self.last_kl: float | None = None
        self._eval_kl = [0.0, 0]
        self.tokens_seen = 0
        if resumed_from is not None:
            meta = _load_state(Path(resumed_from) / STATE_FILE, self.schedules)
            self.rows = [row for row in meta.get("rows", []) if row["step"] <= meta["step"]]
            self.tokens_seen = int(meta.get("tokens_seen", 0))
        for schedule in self.schedules:
            schedule.prepare(model)  # fresh: remembers start values; resumed: only freezes the frequencies
        super().__init__(*args, **kwargs)
        self.teacher = teacher.to(self.args.device)
        blocks = (
            self.train_dataset.blocks[: heal_options.calibration_blocks] if self.train_dataset is not None else None
        )
        self.calibration_blocks = blocks
        self.add_callback(_ScheduleCallback(self))
        if registry is not None:  # lets ``heal`` read the rows after ``train`` returns
            registry["trainer"] = self

    # ---- schedules -------------------------------------------------------------------------------
    def progress(self) -> float:
        return min(1.0, self.state.global_step / max(1, self.state.max_steps))

    def apply_schedules(self) -> None:
        step = self.state.global_step
        for schedule in self.schedules:  # the ones that measure something on the calibration blocks
            if hasattr(schedule, "due") and schedule.due(step) and self.calibration_blocks is not None:
                schedule.calibrate(self.model, self.calibration_blocks, step)
        for schedule in self.schedules:
            schedule.apply(self.model, self.progress())

    def save_heal_state(self, folder: Path) -> None:
        extra = {"step": self.state.global_step, "tokens_seen": self.tokens_seen, "rows": self.rows}
        _save_state(folder / STATE_FILE, self.schedules, extra)

    # ---- loss ------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        weight = self.kl_schedule.value(self.progress())
        if model.training and weight == 0.0:  # no distillation at this step: skip the teacher's forward pass
            self.tokens_seen += inputs["input_ids"].numel()
            return (loss, outputs) if return_outputs else loss
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=inputs["input_ids"], use_cache=False).logits
        kl = distillation_kl(outputs.logits, teacher_logits)
        if model.training:
            self.last_kl = float(kl.detach())
            self.tokens_seen += inputs["input_ids"].numel()
            loss = loss + weight * kl
        else:  # evaluation: the loss stays CE (perplexity); KL is accumulated for the heal row
            self._eval_kl[0] += float(kl) * inputs["input_ids"].numel()
            self._eval_kl[1] += inputs["input_ids"].numel()
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.last_kl is not None:
            logs["kl_to_teacher"] = self.last_kl
            logs["kl_weight"] = self.kl_schedule.value(self.progress())
        super().log(logs, start_time)

    # ---- evaluation rows -------------------------------------------------------------------------
    def evaluation_loop(self, *args, **kwargs):
        self._eval_kl = [0.0, 0]
        with PhaseRecorder(self.model) as recorder:
            output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        phases = recorder.summary() or {}
        loss = output.metrics.get(f"{prefix}_loss")
        row = {
            "step": self.state.global_step,
            "progress": self.progress(),
            "tokens_seen": self.tokens_seen,
            "loss": loss,
            "perplexity": math.exp(min(loss, 50.0)) if loss is not None else None,
            "kl_to_teacher": self._eval_kl[0] / max(1, self._eval_kl[1]),
            "regime": phases.get("regime"),
            "phase_median": phases.get("phase_median"),
            "phase_p90": phases.get("phase_p90"),
            "cos_energy_share": phases.get("cos_energy_share"),
            "alpha": self.heal_options.alpha,
            "norm_power": self.model.config.qkmap_input_norm_power if self.model.config.qkmap_input_norm else None,
        }
        output.metrics[f"{prefix}_kl_to_teacher"] = row["kl_to_teacher"]
        if phases:
            output.metrics[f"{prefix}_phase_p90_min"] = min(row["phase_p90"])
            output.metrics[f"{prefix}_cos_energy_share_min"] = min(row["cos_energy_share"])
        self.rows = [r for r in self.rows if r["step"] != row["step"]] + [row]
        if self.is_world_process_zero():
            write_rows(Path(self.args.output_dir), self.rows)
        return output


class _ScheduleCallback(TrainerCallback):
    """Applies the schedules at the start of training (before the step-0 evaluation) and of every step."""

    def __init__(self, trainer: HealTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.apply_schedules()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.apply_schedules()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir() and self.trainer.is_world_process_zero():
            self.trainer.save_heal_state(folder)

    def on_train_end(self, args, state, control, **kwargs):
        model = self.trainer.model
        if self.trainer.heal_options.native_gains:
            set_gain_parametrization(model, "absolute")
        if getattr(model.config, "qkmap_input_norm", False) and model.config.qkmap_input_norm_power == 0:
            from ..surgery.input_norm import fold_input_norm

            fold_input_norm(model)  # the same function without the norm: saves as plain QK-MAP


def write_rows(folder: Path, rows: list[dict[str, Any]]) -> None:
    """``heal.json`` (``{"evaluations": rows}``) and ``heal.csv`` (lists joined by spaces), atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / HEAL_RECORD, {"evaluations": rows})
    flat = [{k: " ".join(f"{x:.6g}" for x in v) if isinstance(v, list) else v for k, v in row.items()} for row in rows]
    atomic_write_csv(folder / HEAL_TABLE, list(rows[0]), flat)


def heal(
    options: TrainOptions,
    heal_options: HealOptions,
    *,
    datasets=None,
    tokenizer=None,
    callbacks=None,
    extra_schedules: tuple = (),
):
    """Heal ``options.model`` (a converted QK-MAP folder) with ``qkmap train``'s machinery; returns its TrainResult.

    ``extra_schedules``: more ``Schedule`` objects (``schedules.py``), applied after the phase and switch-on ones and
    checkpointed alike (e.g. a QK-Norm annealing schedule).
    """
    from ..cards import check_card_replaceable

    check_train_options(options)  # train() checks them again; here they come before the teacher is loaded
    check_output_dir(options.model, options.output_dir, is_checkpoint=True)
    out = Path(options.output_dir)
    check_card_replaceable(out)  # before the run, not after it (the card is part of the final save)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(options)
    teacher, teacher_vocabulary = load_teacher_with_vocabulary(heal_options.teacher)
    check_teacher_vocabulary(options, tokenizer, teacher_vocabulary)
    registry: dict[str, HealTrainer] = {}

    def finalize(folder: Path) -> None:  # inside train's staged final save: in OUT only once all is written
        trainer = registry["trainer"]
        if trainer.rows:
            write_rows(folder, trainer.rows)
        _write_provenance(folder, options, heal_options, trainer, name=out.resolve().name)

    result = train(
        options,
        datasets=datasets,
        tokenizer=tokenizer,
        callbacks=callbacks,
        trainer_class=HealTrainer,
        trainer_kwargs={
            "heal_options": heal_options,
            "teacher": teacher,
            "resumed_from": resume_checkpoint(options),
            "registry": registry,
            "extra_schedules": extra_schedules,
        },
        command="qkmap heal",
        finalize=finalize,
    )
    return result


def _write_provenance(
    out: Path, options: TrainOptions, heal_options: HealOptions, trainer: HealTrainer, name: str | None = None
) -> None:
    """The conversion record (copied), the healing record and the card (named ``name``) into ``out``."""
    if not (out / "config.json").exists():
        return
    converted = Path(options.model) / PROVENANCE_FILES["conversion"]
    if converted.exists() and not (out / converted.name).exists():
        check_not_escaping(options.model, converted.name, option="CONVERTED")
        atomic_copy(converted, out / converted.name)
    final = trainer.rows[-1] if trainer.rows else {}
    HealingRecord(
        command="qkmap heal",
        converted_model=options.model,
        source=heal_options.teacher,
        recipe=asdict(heal_options),
        tokens_seen=trainer.tokens_seen,
        steps=trainer.state.global_step,
        final={k: final.get(k) for k in ("step", "perplexity", "kl_to_teacher", "regime")},
        gain_parametrization=trainer.model.config.qkmap_gain_parametrization,
    ).save(out)
    from ..cards import write_model_card

    write_model_card(out, model_name=name)


__all__ = ["HealOptions", "HealTrainer", "distillation_kl", "heal", "load_teacher", "set_gain_parametrization"]
