"""Serving throughput, side by side: a Llama and its QK-MAP versions on vLLM and transformers' continuous batching.

The same batch (``--prompts`` prompts x ``--new-tokens`` greedy tokens, prompts of ``--prompt-len`` tokens; run a
second time with a long ``--prompt-len`` for the long-context case) is timed for each model on each engine,
interleaved (round r runs every model once, in rotating order), and reported as the median seconds, the ratio to
Llama's median and the KV-cache tokens per GiB the engine allocates (vLLM: read from its allocation log line;
transformers: the paged cache's bytes per token, keys and values at the key width).

Models (SmolLM2-135M geometry: 30 layers, 9/3 heads, head_dim 64; ``--layers`` shrinks it for a smoke run):
  llama            the source (random weights: throughput does not depend on them)
  qkmap-wide       its exact conversion (``qkmap convert``: F = 1, m = head_dim, keys 128 wide)
  qkmap-compact    a native QK-MAP with m = head_dim / 2 (keys 64 wide, Llama's KV bytes)

    python benchmarks/serving.py --output-dir runs/serving --rounds 5
    python benchmarks/serving.py --output-dir runs/serving-smoke --layers 2 --rounds 2 --new-tokens 8   # smoke
    python benchmarks/serving.py --engines vllm --prompts 4 --prompt-len 1024 --new-tokens 16 --rounds 1 \
        --profile --output-dir runs/serving-profile                      # where vLLM spends each model's time

``--profile`` (vLLM): after the timed rounds, one more batch per model under torch.profiler, the engine core in the
worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set for every round of a profiled run): each model's op
table goes to ``profile-vllm-<model>.txt`` and one Markdown table of the top ops' self time, per model and
against Llama, to ``profile-vllm.md``. transformers' continuous batching runs the model in a thread of its own,
which torch.profiler does not follow; sample it one model per process instead (``pip install py-spy``):

    py-spy record --rate 50 --format raw --threads -o wide.raw -- python benchmarks/serving.py --engines transformers \
        --models qkmap-wide --prompts 4 --prompt-len 1024 --new-tokens 32 --rounds 1 --output-dir runs/cb-profile

Needs the vLLM venv for the vLLM engine (``bash scripts/setup_vllm.sh``); ``--engines transformers`` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LlamaConfig

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from qkmap_hf import QKMapConfig, convert_checkpoint  # noqa: E402
from qkmap_hf.serving import vllm_python  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip

VLLM_WORKER = """
import json, re, sys, time
from vllm import LLM, SamplingParams
folder, prompts, new_tokens, max_len = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=folder, trust_remote_code=True, model_impl="transformers", dtype="float32", max_model_len=max_len,
          seed=0, max_num_seqs=len(prompts))
params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
batch = [{"prompt_token_ids": p} for p in prompts]
llm.generate(batch, params, use_tqdm=False)  # warm-up, before answering: the next model's start must not overlap it
config = llm.llm_engine.vllm_config.cache_config
blocks = getattr(config, "num_gpu_blocks", None) or getattr(config, "num_cpu_blocks", None)
print("@@", json.dumps({"kv_tokens": blocks * config.block_size if blocks else None}), flush=True)
for line in sys.stdin:
    if line.strip() == "profile":
        from torch.profiler import profile
        with profile() as prof:
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        events = prof.key_averages()
        self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in events}
        table = events.table(sort_by="self_cpu_time_total", row_limit=25)
        print("@@", json.dumps({"seconds": seconds, "self_ms": self_ms, "table": table}), flush=True)
        continue
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("@@", json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)
"""


MODELS = ("llama", "qkmap-wide", "qkmap-compact")


def build_models(root: Path, layers: int) -> dict[str, Path]:
    """The three folders (random weights, seed 0), written once under ``root``."""
    from qkmap_hf.training.data import byte_level_tokenizer

    folders = {name: root / name for name in MODELS}
    if all((folder / "config.json").is_file() for folder in folders.values()):
        return folders
    tokenizer = byte_level_tokenizer()  # any tokenizer: prompts are token ids
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2, num_hidden_layers=layers))
    llama.save_pretrained(folders["llama"])
    tokenizer.save_pretrained(folders["llama"])
    convert_checkpoint(folders["llama"], folders["qkmap-wide"], init="exact", progress=False)
    compact = QKMapConfig(qk_mode="qk_map", qkmap_input_dim=32, **SMOLLM2, num_hidden_layers=layers)
    AutoModelForCausalLM.from_config(compact).save_pretrained(folders["qkmap-compact"])
    tokenizer.save_pretrained(folders["qkmap-compact"])
    return folders


def paged_kv_bytes_per_token(folder: Path) -> int:
    """Bytes per token of transformers' paged cache in float32: keys and values at the key width, every layer."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = head_dim
    if config.get("model_type") == "qkmap":
        width = 2 * config["qkmap_num_frequencies"] * (config.get("qkmap_input_dim") or head_dim)
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * width * 4


class TransformersEngine:
    """transformers' continuous batching (``generate_batch``), one model in memory at a time per call."""

    def __init__(self, folder: Path, prompts: list[list[int]], new_tokens: int):
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.prompts, self.new_tokens = prompts, new_tokens
        self.settings = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        self.kv_tokens_per_gib = 2**30 // paged_kv_bytes_per_token(folder)
        self.run()  # warm-up

    def run(self) -> dict:
        start = time.perf_counter()
        outputs = self.model.generate_batch(
            self.prompts,
            generation_config=self.settings,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512),
            max_new_tokens=self.new_tokens,
        )
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        return {"seconds": time.perf_counter() - start, "tokens": tokens}


class VLLMEngine:
    """A vLLM worker process per model (its venv), told to run the batch one line at a time (interleaving)."""

    def __init__(self, folder: Path, prompts: list[list[int]], new_tokens: int, log: Path, in_process: bool = False):
        python = vllm_python()
        if python is None:
            raise SystemExit("vLLM is not installed: run `bash scripts/setup_vllm.sh` or pass --engines transformers")
        max_len = max(len(p) for p in prompts) + new_tokens + 16
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
        if in_process:  # the engine core in this worker, so that torch.profiler sees the model's ops
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [python, "-c", VLLM_WORKER, str(folder), json.dumps(prompts), str(new_tokens), str(max_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
        )  # fmt: skip
        kv_tokens = json.loads(self.read_line())["kv_tokens"]
        self.kv_tokens_per_gib = kv_tokens  # VLLM_CPU_KVCACHE_SPACE=1: the tokens 1 GiB holds

    def read_line(self) -> str:
        """The worker's next answer (lines starting with @@; vLLM logs to stdout too)."""
        while line := self.process.stdout.readline():
            if line.startswith("@@ "):
                return line[3:]
        self.log.flush()
        raise RuntimeError(f"the vLLM worker exited; see {self.log.name}")

    def ask(self, command: str) -> dict:
        """Send the worker one command line and return its JSON answer."""
        self.process.stdin.write(f"{command}\n")
        self.process.stdin.flush()
        return json.loads(self.read_line())

    def run(self) -> dict:
        return self.ask("run")

    def profile(self) -> dict:
        """One batch under torch.profiler: ``{"seconds", "self_ms": {op: self CPU ms}, "table"}``."""
        return self.ask("profile")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)
        self.log.close()


def measure(engine: str, folders: dict[str, Path], args, output_dir: Path) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 256, (args.prompts, args.prompt_len), generator=generator).tolist()
    engines = {}
    for name, folder in folders.items():
        if engine == "vllm":
            log = output_dir / f"vllm-{name}.log"
            engines[name] = VLLMEngine(folder, prompts, args.new_tokens, log, in_process=args.profile)
        else:
            engines[name] = TransformersEngine(folder, prompts, args.new_tokens)
    times: dict[str, list[float]] = {name: [] for name in folders}
    names = list(folders)
    for round_index in range(args.rounds):
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            result = engines[name].run()
            assert result["tokens"] == args.prompts * args.new_tokens, result
            times[name].append(result["seconds"])
            print(f"[{engine}] round {round_index + 1} {name}: {result['seconds']:.3f} s", flush=True)
    if args.profile and engine == "vllm":
        profiles = {name: engines[name].profile() for name in names}
        for name, result in profiles.items():
            (output_dir / f"profile-vllm-{name}.txt").write_text(result["table"])
        table = profile_table({name: result["self_ms"] for name, result in profiles.items()}, reference=names[0])
        (output_dir / "profile-vllm.md").write_text(table)
        print(table, flush=True)
    rows = []
    base = statistics.median(times[names[0]])  # llama unless --models leaves it out
    for name in names:
        median = statistics.median(times[name])
        rows.append({
            "engine": engine, "model": name, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "rounds": args.rounds, "median_s": round(median, 4),
            "ratio_to_llama": round(median / base, 3), "kv_tokens_per_gib": engines[name].kv_tokens_per_gib,
            "times_s": [round(t, 4) for t in times[name]],
        })  # fmt: skip
        if hasattr(engines[name], "close"):
            engines[name].close()
    return rows


def profile_table(self_ms: dict[str, dict[str, float]], top: int = 8, reference: str = "llama") -> str:
    """Markdown: the ``top`` ops by self time over every model, each model's ms and its difference to ``reference``'s,
    then the total; the ops that explain where one model's extra time goes."""
    names = list(self_ms)
    ops = sorted(
        {op for times in self_ms.values() for op in times},
        key=lambda op: -max(t.get(op, 0.0) for t in self_ms.values()),
    )
    header = "| op | " + " | ".join(f"{name} ms" for name in names) + " |"
    lines = [header, "|" + "---|" * (len(names) + 1)]

    def cells(values: dict[str, float]) -> str:
        base = values[reference]
        return " | ".join(f"{values[n]:.1f}" + ("" if n == reference else f" ({values[n] - base:+.1f})") for n in names)

    for op in ops[:top]:
        lines.append(f"| `{op}` | " + cells({n: self_ms[n].get(op, 0.0) for n in names}) + " |")
    lines.append("| all ops | " + cells({n: sum(self_ms[n].values()) for n in names}) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--engines", nargs="+", default=["vllm", "transformers"], choices=["vllm", "transformers"])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (30: SmolLM2-135M; 2 for a smoke run)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="vLLM: one more batch per model under torch.profiler")
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), choices=MODELS,
        help="models to run (ratios are to the first); one model per process is what a sampling profiler needs",
    )  # fmt: skip
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    folders = build_models(args.output_dir / f"models-{args.layers}l", args.layers)
    folders = {name: folders[name] for name in args.models}
    rows = [row for engine in args.engines for row in measure(engine, folders, args, args.output_dir)]
    out = args.output_dir / f"serving-p{args.prompts}x{args.prompt_len}-n{args.new_tokens}.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"{'engine':12} {'model':14} {'median s':>9} {'x llama':>8} {'KV tok/GiB':>11}")
    for row in rows:
        print(
            f"{row['engine']:12} {row['model']:14} {row['median_s']:9.3f} {row['ratio_to_llama']:8.3f} "
            f"{row['kv_tokens_per_gib'] or 0:11,}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
