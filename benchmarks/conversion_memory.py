#!/usr/bin/env python
"""Peak memory and time of ``convert_checkpoint`` on a synthetic 7B-shaped sharded checkpoint.

Builds a Llama checkpoint with real tensor names and Llama-2-7B shapes (32 layers, hidden 4096, MLP 11008,
32 heads, vocab 32000, bfloat16: ~13.5 GB in ~3 GB shards) in a temporary folder, then measures, each in a
fresh subprocess, the peak RSS (``VmHWM`` of ``/proc/self/status``, which also counts mapped file pages; not
``ru_maxrss``, which a child started by ``subprocess`` inherits from its parent's peak across ``exec``, so it
reported the benchmark's own 3.5 GB of checkpoint building for every method) and wall time of

- ``convert``: ``qkmap_hf.convert_checkpoint(src, dst, init="exact")`` (streams tensor by tensor; with
  ``--also-code DIR`` also the ``qkmap_hf`` in DIR, e.g. an older commit unpacked by ``git archive``),
- ``load+save``: the plain way, ``safetensors.torch.load_file`` of every shard into one dict, then
  ``save_file`` of the same shards (left in the page cache, as ``save_pretrained`` leaves them), and
- ``load+save+fsync``: the same, then ``fsync`` of every file, the durability the conversion gives
  (it syncs every file before renaming its folder into place).

Each method also reports MB/s (checkpoint bytes / wall time) and its wall-time and RSS ratios to
``load+save``. The methods run interleaved for ``--repeats`` rounds (the table shows medians, the CSV
every round); before each, the source is read once so every method starts with it in the page cache, and
after each the output is deleted and ``os.sync`` waits for its write-back.

Writes a CSV and prints a table. Not a test: it needs ~30 GB of free disk and, for the baseline, memory
of the full model. The multi-GB files are deleted at the end (unless ``--keep``)::

    python benchmarks/conversion_memory.py [--layers 32] [--repeats 3] [--workdir /tmp] [--keep | --reuse SRC]
        [--also-code DIR] [--csv benchmarks/results/conversion_memory.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

GB = 10**9

CONVERT = """
import time, json, sys
import qkmap_hf
start = time.perf_counter()
qkmap_hf.convert_checkpoint(sys.argv[1], sys.argv[2], init="exact", progress=False)
print(json.dumps({"wall_s": time.perf_counter() - start,
                  "peak_rss_bytes": next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                                         if line.startswith("VmHWM:"))}))
"""

LOAD_AND_SAVE = """
import time, json, sys, os, shutil
from pathlib import Path
from safetensors.torch import load_file, save_file
start = time.perf_counter()
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
index = json.loads((src / "model.safetensors.index.json").read_text())
files = sorted(set(index["weight_map"].values()))
tensors = {}
for name in files:
    tensors.update(load_file(src / name))
dst.mkdir()
for name in files:
    save_file({k: tensors[k] for k, f in index["weight_map"].items() if f == name}, dst / name, metadata={"format": "pt"})
for extra in ("model.safetensors.index.json", "config.json"):
    shutil.copyfile(src / extra, dst / extra)
if len(sys.argv) > 3 and sys.argv[3] == "fsync":
    for path in dst.iterdir():
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
print(json.dumps({"wall_s": time.perf_counter() - start,
                  "peak_rss_bytes": next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                                         if line.startswith("VmHWM:"))}))
"""


def llama_tensors(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    """(name, shape) in the order transformers saves a LlamaForCausalLM (untied, like Llama 2)."""
    head_dim = hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (heads * head_dim, hidden)
        yield p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)
        yield p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield p + "mlp.gate_proj.weight", (intermediate, hidden)
        yield p + "mlp.up_proj.weight", (intermediate, hidden)
        yield p + "mlp.down_proj.weight", (hidden, intermediate)
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def build_checkpoint(folder: Path, args: argparse.Namespace) -> dict:
    """Write config.json, shards of about ``--shard-gb`` and the index; random bf16 data, one shard in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder.mkdir(parents=True)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    limit = int(args.shard_gb * GB)
    shapes = list(llama_tensors(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab))
    for name, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    generator = torch.Generator().manual_seed(0)
    for number, group in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16) for name, shape in group}
        save_file(shard, folder / file, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in shard.values())
        weight_map.update({name: file for name in shard})
        del shard
        print(f"  wrote {file} ({(folder / file).stat().st_size / GB:.2f} GB)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shard_sizes = [(folder / f).stat().st_size for f in sorted(set(weight_map.values()))]
    return {"total_bytes": total, "num_shards": len(groups), "largest_shard_bytes": max(shard_sizes)}


def measure(code: str, src: Path, dst: Path, *extra: str, pythonpath: str | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(src), str(dst), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=src.parent,  # not the repository: `python -c` puts the cwd first on sys.path, before PYTHONPATH
    )
    if result.returncode != 0:
        raise RuntimeError(f"measurement failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm_page_cache(folder: Path) -> None:
    """Read every file of ``folder`` once, so no method pays for (or profits from) a cold source."""
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as handle:
            while handle.read(64 * 2**20):
                pass


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-gb", type=float, default=3.0, help="target shard size in GB (default 3)")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--csv", default=str(Path(__file__).parent / "results" / "conversion_memory.csv"))
    parser.add_argument("--skip-baseline", action="store_true", help="measure the conversion only")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the table shows medians")
    parser.add_argument("--reuse", default=None, metavar="SRC", help="measure on a checkpoint an earlier --keep kept")
    parser.add_argument(
        "--also-code",
        default=None,
        metavar="DIR",
        help="also time convert_checkpoint of the qkmap_hf found in DIR (e.g. an older commit's `git archive`)",
    )
    args = parser.parse_args(argv)

    params = args.vocab * args.hidden * 2 + args.layers * (
        2 * args.hidden * args.hidden
        + 2 * args.kv_heads * (args.hidden // args.heads) * args.hidden
        + 3 * args.hidden * args.intermediate
    )
    need = 2 * params * 2 + 2 * GB  # source + one output at a time
    free = shutil.disk_usage(args.workdir).free
    print(
        f"model: {params / 1e9:.2f} B parameters, {2 * params / GB:.1f} GB in bf16; {free / GB:.0f} GB free in {args.workdir}"
    )
    if free < need:
        print(f"not enough disk: need {need / GB:.0f} GB; use fewer --layers or another --workdir", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="qkmap-conversion-bench-", dir=Path(args.workdir).absolute()))
    rows = []
    try:
        if args.reuse:  # a checkpoint kept by an earlier --keep run with the same shape flags
            src = Path(args.reuse).absolute()
            shard_sizes = [p.stat().st_size for p in src.glob("*.safetensors")]
            total = json.loads((src / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
            info = {"total_bytes": total, "num_shards": len(shard_sizes), "largest_shard_bytes": max(shard_sizes)}
        else:
            src = work / "src"
            start = time.perf_counter()
            info = build_checkpoint(src, args)
            print(
                f"built {info['num_shards']} shards, {info['total_bytes'] / GB:.2f} GB in "
                f"{time.perf_counter() - start:.0f} s"
            )
        shape = (
            f"{args.layers}L h{args.hidden} mlp{args.intermediate} {args.heads}/{args.kv_heads}heads v{args.vocab} bf16"
        )
        methods = [("convert_checkpoint (streaming)", CONVERT, (), None)]
        if args.also_code:
            methods.append((f"convert_checkpoint ({args.also_code})", CONVERT, (), str(Path(args.also_code).resolve())))
        if not args.skip_baseline:
            methods.append(("load_file + save_file (plain)", LOAD_AND_SAVE, (), None))
            methods.append(("load_file + save_file + fsync", LOAD_AND_SAVE, ("fsync",), None))
        if mem_available_bytes() < info["total_bytes"] + 3 * GB:
            print(f"skipping the plain methods: MemAvailable {mem_available_bytes() / GB:.1f} GB < model + 3 GB")
            methods = [m for m in methods if not m[0].startswith("load")]
        runs: dict[str, list[dict]] = {method[0]: [] for method in methods}
        for repeat in range(args.repeats):  # interleaved: every method sees the same machine, round by round
            for method, code, extra, pythonpath in methods:
                dst = work / "dst"
                print(f"round {repeat + 1}/{args.repeats}: measuring {method} ...", flush=True)
                warm_page_cache(src)  # every method starts with SRC in the page cache, as after a download
                runs[method].append(measure(code, src, dst, *extra, pythonpath=pythonpath))
                shutil.rmtree(dst)
                os.sync()  # the next method starts without this one's dirty pages still being written back
        for method, results in runs.items():
            wall = statistics.median(r["wall_s"] for r in results)
            peak = max(r["peak_rss_bytes"] for r in results)
            rows.append(
                {
                    "method": method,
                    "shape": shape,
                    "total_gb": round(info["total_bytes"] / GB, 2),
                    "num_shards": info["num_shards"],
                    "largest_shard_gb": round(info["largest_shard_bytes"] / GB, 2),
                    "wall_s": round(wall, 1),
                    "wall_s_rounds": " ".join(f"{r['wall_s']:.1f}" for r in results),
                    "mb_per_s": round(info["total_bytes"] / wall / 1e6),
                    "peak_rss_gb": round(peak / GB, 2),
                    "rss_over_largest_shard": round(peak / info["largest_shard_bytes"], 2),
                }
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    csv_path = Path(args.csv)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plain = next((row for row in rows if row["method"].endswith("(plain)")), None)
    print(
        "\n| method | total GB | shards | largest shard GB | wall s | MB/s | wall / plain | peak RSS GB | "
        "RSS / largest shard |\n|---|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        ratio = f"{row['wall_s'] / plain['wall_s']:.2f}" if plain else "-"
        print(
            f"| {row['method']} | {row['total_gb']} | {row['num_shards']} | {row['largest_shard_gb']} | "
            f"{row['wall_s']} | {row['mb_per_s']} | {ratio} | {row['peak_rss_gb']} | {row['rss_over_largest_shard']} |"
        )
    print(f"\nshape: {rows[0]['shape']}; CSV: {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
