"""Serving: transformers' continuous batching (``generate_batch``, ``transformers serve``) gives ``generate``'s
tokens; ``qkmap serve`` picks the engine and refuses what it cannot serve; the vLLM plugin's checks.
vLLM itself is exercised in tests/plugin/test_serving_vllm.py."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from qkmap_hf import QKMapConfig
from qkmap_hf.modeling.modeling_qkmap import paged_cache_width
from qkmap_hf.serving import (
    best_engine,
    check_servable,
    complete,
    serve_command,
    start_server,
    vllm_python,
    wait_until_ready,
)
from qkmap_hf_serving.vllm_plugin import check_folder_code, forward_dispatches, query_key_width
from tests.utils import tiny_config_kwargs

PROMPTS = [[5, 17, 42, 99, 7, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 8
LAYOUTS = {
    # head_dim 16: wide keys 2 * 2 * 16 = 64 wide (values 16); compact keys 2 * 2 * 4 = 16 (= head_dim)
    "wide": dict(qkmap_num_frequencies=2),
    "compact": dict(qkmap_num_frequencies=2, qkmap_input_dim=4),
}


def tiny_model(layout: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(**LAYOUTS[layout]))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # random gains, so every parameter is at work
        for name, param in model.named_parameters():
            if name.endswith(("query_gain", "key_gain")):
                param.mul_(1 + 0.3 * torch.randn_like(param))
    model.generation_config.eos_token_id = None
    return model


def generate_each(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``generate``, one prompt at a time: the reference every serving path must reproduce."""
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])  # eager runs paged|eager
def test_generate_batch_gives_generates_tokens(layout, attn):
    model = tiny_model(layout, attn)
    expected = generate_each(model, PROMPTS, NEW_TOKENS)
    settings = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=settings,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64),
        max_new_tokens=NEW_TOKENS,
    )
    got = [outputs[request].generated_tokens for request in sorted(outputs, key=lambda r: int(r.split("_")[-1]))]
    assert got == expected
    assert len(expected) == 3 and all(len(tokens) == NEW_TOKENS for tokens in expected)
    assert model.config.head_dim == 16  # the paged cache saw the key width only while it was built


def test_paged_cache_width_is_the_key_width_while_sizing_only():
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(**LAYOUTS["wide"]))
    with paged_cache_width(config):
        assert config.head_dim == 64
    assert (config.head_dim, config.query_key_dim) == (16, 64)


# --- qkmap serve: engine choice and one-line refusals ---------------------------------------------------


def saved_folder(root: Path, layout: str, *, tokenizer: bool = True, **overrides) -> Path:
    """A tiny QK-MAP folder as save_pretrained writes it, with the byte-level tokenizer (the training default)."""
    from qkmap_hf.training.data import byte_level_tokenizer

    torch.manual_seed(0)
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(**{**LAYOUTS[layout], **overrides}))
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root)
    if tokenizer:
        byte_level_tokenizer().save_pretrained(root)
    return root


def test_serve_refuses_in_one_line_what_it_cannot_serve(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope: no such model folder"):
        check_servable(tmp_path / "nope", "transformers")
    bare = saved_folder(tmp_path / "bare", "wide", tokenizer=False)
    with pytest.raises(ValueError, match=r"bare: no tokenizer \(tokenizer.json"):
        check_servable(bare, "transformers")
    # head_dim 16, F = 2, m = 4: keys 16 wide, a head size vLLM's CPU backend does not allocate
    compact = saved_folder(tmp_path / "compact", "compact")
    with pytest.raises(ValueError, match=r"config.json: QK-MAP keys are 16 wide .* --engine transformers"):
        check_servable(compact, "vllm")
    check_servable(compact, "transformers")
    wide = saved_folder(tmp_path / "wide", "wide")  # keys 64 wide
    check_servable(wide, "vllm")
    with pytest.raises(ValueError, match=r"--engine 'tgi': choose one of vllm, transformers"):
        check_servable(wide, "tgi")


def test_serve_refuses_folder_code_vllm_cannot_dispatch(tmp_path):
    folder = saved_folder(tmp_path / "old", "wide")
    attention = folder / "attention_qkmap.py"
    source = attention.read_text()
    # the layout before issue 20: forward called a helper that did the ALL_ATTENTION_FUNCTIONS lookup
    old = source.replace(
        "attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)",
        "attention_interface: Callable = self.kernel_for(implementation)",
    )
    assert old != source
    attention.write_text(old)
    assert forward_dispatches(source) and not forward_dispatches(old)
    with pytest.raises(ValueError, match=r"attention_qkmap.py: written by an older qkmap-hf"):
        check_servable(folder, "vllm")
    with pytest.raises(ValueError, match=r"attention_qkmap.py: QKMapAttention.forward predates vLLM support"):
        check_folder_code(folder)


def test_vllm_plugin_sizes_heads_by_key_width_and_names_differing_code(tmp_path, caplog):
    wide = saved_folder(tmp_path / "wide", "wide")
    converted_like = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs())  # F = 1, m = head_dim = 16
    assert query_key_width(QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(**LAYOUTS["wide"]))) == 64
    assert query_key_width(converted_like) == 32
    assert query_key_width(QKMapConfig(qk_mode="standard", **tiny_config_kwargs())) == 16
    assert check_folder_code(wide) == []  # the package's own copy: nothing to say
    modeling = wide / "modeling_qkmap.py"
    modeling.write_text(modeling.read_text() + "\n# edited by hand\n")
    with caplog.at_level("WARNING", logger="qkmap_hf_serving.vllm_plugin"):
        assert check_folder_code(wide) == ["modeling_qkmap.py"]
    assert "modeling_qkmap.py differ from qkmap-hf's copy" in caplog.text
    assert "vLLM runs the folder's own code" in caplog.text


def test_best_engine_is_transformers_without_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("QKMAP_VLLM_VENV", str(tmp_path / "no-venv"))
    if importlib.util.find_spec("vllm") is not None:  # vLLM in this environment: it is the best engine
        assert best_engine() == "vllm"
        return
    assert vllm_python() is None and best_engine() == "transformers"
    folder = saved_folder(tmp_path / "wide", "wide")
    command = serve_command(folder, host="127.0.0.1", port=8123)
    assert command.engine == "transformers" and command.url == "http://127.0.0.1:8123/v1"
    assert command.argv[1:5] == [
        "-m",
        "qkmap_hf_serving.transformers_serve",
        str(folder.resolve()),
        "--continuous-batching",
    ]
    assert "--trust-remote-code" in command.argv
    with pytest.raises(
        ImportError, match=r"vLLM is not installed here nor in .*no-venv; run `bash scripts/setup_vllm.sh`"
    ):
        serve_command(folder, "vllm")


def test_qkmap_serve_command_refuses_with_exit_code_2(tmp_path, capsys):
    from qkmap_hf.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "qkmap serve: error: " in capsys.readouterr().err


# --- the servers themselves, on 127.0.0.1 ---------------------------------------------------------------

SERVER_PROMPTS = ("To be, or not to be", "Full fathom five")
# transformers serve sizes its paged cache from free memory by default (the first request then waits ~15 s on CPU)
SMALL_CB = ("--cb-num-blocks", "64", "--cb-max-batch-tokens", "256")
SERVER_TOKENS = 12


def expected_completions(folder: Path, prompts=SERVER_PROMPTS, new_tokens: int = SERVER_TOKENS) -> list[str]:
    """``generate``'s greedy continuations of the text prompts, decoded as the servers decode them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def served_completions(folder: Path, engine: str, port: int, log: Path, extra: dict | None = None, **options) -> list:
    """Start ``qkmap serve``'s server for ``folder`` on 127.0.0.1, ask for each prompt once, stop it by its PID;
    the answers' texts (with ``extra`` request fields: the answers' first choices whole)."""
    command = serve_command(folder, engine, host="127.0.0.1", port=port, dtype="float32", **options)
    process = start_server(command, log=log, env={"HF_HUB_OFFLINE": "1"})
    try:
        wait_until_ready(command.url, process, timeout=240)
        answers = [
            complete(command.url, str(folder.resolve()), p, SERVER_TOKENS, **(extra or {})) for p in SERVER_PROMPTS
        ]
    except Exception as error:
        raise AssertionError(f"{error}\n--- server log ---\n{log.read_text()[-4000:]}") from error
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return [answer["choices"][0] if extra else answer["choices"][0]["text"] for answer in answers]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["compact"])  # wide: test_qkmap_serve_prints_engine_and_url_and_serves
def test_transformers_serve_continuous_batching_gives_generates_text(layout, tmp_path):
    folder = saved_folder(tmp_path / layout, layout)
    expected = expected_completions(folder)
    got = served_completions(folder, "transformers", free_port(), tmp_path / "server.log", engine_args=SMALL_CB)
    assert got == expected
    assert all(len(text) > 0 for text in expected)


@pytest.mark.slow
def test_qkmap_serve_prints_engine_and_url_and_serves(tmp_path):
    """``qkmap serve`` on the transformers engine (transformers serve --continuous-batching), wide layout."""
    folder = saved_folder(tmp_path / "wide", "wide")
    expected = expected_completions(folder, SERVER_PROMPTS[:1])
    port = free_port()
    command = [sys.executable, "-m", "qkmap_hf", "serve", str(folder), "--engine", "transformers", "--port", str(port)]
    command += ["--dtype", "float32", f"--engine-args={' '.join(SMALL_CB)}"]  # handed to transformers serve
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        first = process.stdout.readline().strip()
        url = f"http://127.0.0.1:{port}/v1"
        assert first == f"serving {folder} with transformers at {url} (Ctrl-C stops it)"
        wait_until_ready(url, process, timeout=120)
        answer = complete(url, str(folder.resolve()), SERVER_PROMPTS[0], SERVER_TOKENS)
        assert answer["choices"][0]["text"] == expected[0]
    finally:
        process.terminate()
        process.wait(60)
    assert process.returncode == 128 + 15  # stopped by SIGTERM, and the server with it
    with pytest.raises(OSError):
        complete(url, str(folder.resolve()), SERVER_PROMPTS[0], 1, timeout=5)
