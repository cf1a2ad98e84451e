"""vLLM serves QK-MAP folders with greedy tokens identical to ``generate``: offline API and OpenAI server.

vLLM runs in its own virtual environment (``scripts/setup_vllm.sh``; ``.ci/run`` builds it before the suite, and
the fixture below runs the script too, so a fresh machine passes: the first build takes minutes, later runs only
re-install this checkout into it). Folders: a tiny Llama converted exactly (F = 1, keys 32 wide), a tiny native
wide model (GQA 4/2, F = 2, keys 64 wide, values 16), a compact one (F = 2, m = 8: keys 32 = head_dim) and a tiny
Qwen3 converted with its input norm (keys 64 wide).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from qkmap_hf.packaging import convert_checkpoint
from qkmap_hf.training.data import byte_level_tokenizer
from tests.plugin.test_serving import (
    SERVER_PROMPTS,
    SERVER_TOKENS,
    free_port,
    saved_folder,
    served_completions,
)
from tests.utils import tiny_config_kwargs, tiny_llama_converted_exactly

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[72, 101, 108, 108, 111], [5, 17, 42, 99, 7, 3, 250, 11, 9], [84, 111]]
NEW_TOKENS = 10

OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], trust_remote_code=True, model_impl="transformers", dtype="float32", max_model_len=256,
          enforce_eager=True, max_num_seqs=4, seed=0)
prompts = json.loads(sys.argv[2])
params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM venv's python, built (once per machine) or refreshed with this checkout by scripts/setup_vllm.sh."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup_vllm.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"scripts/setup_vllm.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm")
    converted = tiny_llama_converted_exactly(root / "llama", initializer_range=0.1)["conv"]
    wide = saved_folder(root / "wide", "wide")
    compact = saved_folder(root / "compact", "compact", hidden_size=128, qkmap_input_dim=8)  # head_dim 32, keys 32
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(4)
    qwen3 = Qwen3ForCausalLM(
        Qwen3Config(**tiny_config_kwargs(vocab_size=len(tokenizer), head_dim=32, attention_bias=True))
    ).eval()
    with torch.no_grad():
        for name, param in qwen3.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.3, 2.5)  # the input norm must carry real weights
    qwen3.save_pretrained(root / "qwen3-src")
    tokenizer.save_pretrained(root / "qwen3-src")
    convert_checkpoint(root / "qwen3-src", root / "qwen3", progress=False)
    assert json.loads((root / "qwen3" / "config.json").read_text())["qkmap_input_norm"] is True
    return {"converted": converted, "wide": wide, "compact": compact, "qwen3": root / "qwen3"}


def generate_tokens(folder: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]


def vllm_env() -> dict[str, str]:
    """Offline, a small KV cache, and this checkout's plugin and launcher first on the path."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": str(REPO),
    }


@pytest.mark.parametrize("name", ["converted", "wide", "compact", "qwen3"])
def test_vllm_offline_api_gives_generates_tokens(name, folders, vllm_python):
    expected = generate_tokens(folders[name])
    result = subprocess.run(
        [vllm_python, "-c", OFFLINE, str(folders[name]), json.dumps(PROMPTS), str(NEW_TOKENS)],
        env=vllm_env(),
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=folders[name].parent,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == expected
    assert [len(tokens) for tokens in got] == [NEW_TOKENS] * len(PROMPTS)
    log = result.stdout + result.stderr
    assert "Found: self_attn (QKMapAttention) -> attention interface" in log  # the folder's own code
    assert "differ from qkmap-hf's copy" not in log


@pytest.mark.parametrize("name", ["converted", "wide"])
def test_vllm_openai_server_gives_generates_tokens(name, folders, vllm_python, tmp_path):
    """Text prompts in; the token ids vLLM tokenized and generated (``return_token_ids``) against ``generate``'s,
    which stops at the folder's EOS as the server does."""
    choices = served_completions(
        folders[name],
        "vllm",
        free_port(),
        tmp_path / "vllm.log",
        {"return_token_ids": True},
        max_model_len=256,
        enforce_eager=name == "wide",  # converted: vLLM's default torch.compile path; wide: eager, 20 s sooner
    )
    tokenizer = AutoTokenizer.from_pretrained(folders[name], trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
    for prompt, choice in zip(SERVER_PROMPTS, choices, strict=True):
        assert choice["prompt_token_ids"] == tokenizer(prompt).input_ids
        with torch.no_grad():
            ids = torch.tensor([choice["prompt_token_ids"]])
            expected = model.generate(ids, max_new_tokens=SERVER_TOKENS, do_sample=False)[0, ids.shape[1] :]
        assert choice["token_ids"] == expected.tolist()
        assert len(choice["token_ids"]) > 0
