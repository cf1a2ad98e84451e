"""Core behaviour under whatever transformers version is importable; run by test_transformers_range.py.

Prints one JSON line: the transformers version and the measured numbers.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import qkmap_hf

KW = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    eos_token_id=None,
)


def main() -> None:
    report: dict = {"transformers": transformers.__version__}
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**KW)).eval()
    standard = qkmap_hf.QKMapForCausalLM(qkmap_hf.QKMapConfig(qk_mode="standard", **KW)).eval()
    standard.load_state_dict(llama.state_dict())
    x = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        report["standard_vs_llama"] = (llama(x).logits - standard(x).logits).abs().max().item()
    for mode in ("standard", "qk_norm", "qk_map"):
        model = AutoModelForCausalLM.from_config(qkmap_hf.QKMapConfig(qk_mode=mode, **KW)).eval()
        with torch.no_grad():
            cached = model.generate(x[:1, :5], max_new_tokens=12, do_sample=False, pad_token_id=0)
            uncached = model.generate(x[:1, :5], max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False)
            static = model.generate(
                x[:1, :5], max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static"
            )
            report[f"{mode}_cache_equal"] = bool(torch.equal(cached, uncached) and torch.equal(cached, static))
            with tempfile.TemporaryDirectory() as folder:
                model.save_pretrained(folder)
                loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
                report[f"{mode}_reload_diff"] = (loaded(x).logits - model(x).logits).abs().max().item()
            model.set_attn_implementation("eager")  # sdpa returns no attention weights
            out = model(x, output_attentions=True)
            report[f"{mode}_attentions"] = len(out.attentions or ())
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
