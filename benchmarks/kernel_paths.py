"""Check that every attention kernel path of the wide QK-MAP layout runs and agrees with eager, on one device.

For each ``attn_implementation`` (sdpa, flex_attention, flash_attention_2): the wide layout (keys twice as wide
as values) in the given dtype, against eager in the same dtype and weights: logits of a forward pass, gradients
of one training step (where the backend has a backward pass on that device), and greedy decoding through the
cache (sdpa decodes with ``single_query_attention``). Prints one line per path, PASS / FAIL / MISSING with the
reason, and exits non-zero if any path that should run did not: benchmarks/gpu_check.sh fails loudly on it.

    python benchmarks/kernel_paths.py --device cuda --dtype bfloat16
    python benchmarks/kernel_paths.py --device cpu --dtype float32 --paths sdpa flex_attention   # CPU smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback

import torch
from transformers import AutoModelForCausalLM

from qkmap_hf import QKMapConfig

PATHS = ("sdpa", "flex_attention", "flash_attention_2")
CONFIG = dict(
    qk_mode="qk_map",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    eos_token_id=None,
)
# Relative tolerances against eager in the same dtype (different summation orders and kernels).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def missing_reason(path: str, device: str) -> str | None:
    """Why a path cannot run here at all (its package or device is absent), or None."""
    if path == "flash_attention_2":
        if not device.startswith("cuda"):
            return "flash-attention 2 needs a CUDA device"
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package is not installed (pip install flash-attn --no-build-isolation)"
    return None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / (want.float().abs().max() + 1e-6)).item()


def check_path(path: str, device: str, dtype: torch.dtype) -> str:
    """Forward, training step and decoding of ``path`` against eager; raises AssertionError on a disagreement."""
    torch.manual_seed(0)
    config = QKMapConfig(**CONFIG)
    assert config.query_key_dim == 2 * config.head_dim, "the check wants keys wider than values"
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device=device, dtype=dtype)
    other = AutoModelForCausalLM.from_config(config, attn_implementation=path).to(device=device, dtype=dtype)
    other.load_state_dict(eager.state_dict())
    ids = torch.randint(3, config.vocab_size, (2, 64), device=device)
    tolerance = TOLERANCE[dtype]
    with torch.no_grad():
        error = relative_error(other(ids).logits, eager(ids).logits)
    assert error < tolerance, f"forward logits differ from eager by {error:.2e} (relative; tolerance {tolerance})"
    notes = [f"forward {error:.1e}"]
    trains = not (path == "flex_attention" and not device.startswith("cuda"))  # torch: no flex backward on CPU
    if trains:
        grads = []
        for model in (eager, other):
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
        error = relative_error(grads[1], grads[0])
        assert error < 10 * tolerance, f"q_proj gradient differs from eager by {error:.2e} (relative)"
        notes.append(f"backward {error:.1e}")
    else:
        notes.append("backward not run (torch has no flex backward on CPU)")
    with torch.no_grad():
        prompt = ids[:1, :16]
        tokens = [m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0) for m in (eager, other)]
    agree = (tokens[0] == tokens[1]).float().mean().item()
    assert agree >= (1.0 if dtype == torch.float32 else 0.9), f"greedy decoding agrees with eager on {agree:.0%}"
    notes.append(f"decode tokens {agree:.0%} equal")
    return "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"FAIL all paths: --device {args.device} but torch sees no CUDA device (torch {torch.__version__})")
        return 1
    dtype = getattr(torch, args.dtype)
    failed = 0
    for path in args.paths:
        reason = missing_reason(path, args.device)
        if reason is not None:
            print(f"MISSING {path}: {reason}", flush=True)
            failed += 1
            continue
        try:
            print(f"PASS {path} ({args.device}, {args.dtype}): {check_path(path, args.device, dtype)}", flush=True)
        except Exception as error:  # every path is reported, then the exit code says whether all ran
            traceback.print_exc()
            print(f"FAIL {path} ({args.device}, {args.dtype}): {type(error).__name__}: {error}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
