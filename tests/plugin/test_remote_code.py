"""Checkpoints load anywhere with trust_remote_code, without qkmap_hf installed."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import qkmap_hf
from qkmap_hf import QKMapConfig
from qkmap_hf.cleanroom import run_without_qkmap_hf
from tests.utils import run_clean_python, tiny_config_kwargs

# Every file of qkmap_hf/modeling is checkpoint-carried (its __init__ only re-exports them for the package).
REMOTE_CODE_FILES = tuple(
    sorted(p.name for p in (Path(qkmap_hf.__file__).parent / "modeling").glob("*.py") if p.name != "__init__.py")
)
INPUT_IDS = [[5, 17, 42, 99, 7, 3, 250, 11], [9, 8, 7, 6, 5, 4, 3, 2]]

LOAD_AND_RUN = """
import json, torch
from transformers import AutoModelForCausalLM, AutoConfig
source = {source!r}
model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True, attn_implementation="eager").eval()
config = AutoConfig.from_pretrained(source, trust_remote_code=True)
ids = torch.tensor({ids!r})
with torch.no_grad():
    logits = model(ids).logits
    generated = model.generate(ids[:1, :4], max_new_tokens=10, do_sample=False, pad_token_id=0)
print(json.dumps({{
    "class": type(model).__name__, "module": type(model).__module__, "config_class": type(config).__name__,
    "logits": logits.flatten().tolist(), "generated": generated.tolist(),
}}))
"""


@pytest.fixture(scope="module", params=["standard", "qk_norm", "qk_map"])
def saved(request, tmp_path_factory, fused_kernel):
    """A checkpoint of each mode, saved with the default config, and its outputs; the fused kernel is loaded here, so
    ``package_logits`` of qk_map are the kernel's."""
    torch.manual_seed(0)
    config = QKMapConfig(qk_mode=request.param, qkmap_num_frequencies=2, **tiny_config_kwargs())
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gain" in name or "norm" in name:
                param.mul_(1 + 0.2 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    model.save_pretrained(folder)
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        package_logits = model(ids).logits  # the fused CPU kernel where this process loaded it
        # A process without qkmap_hf has no kernel: the copied files run the eager map, which must match bit for bit.
        model.config.qkmap_fused_feature_map = False
        expected = {
            "logits": model(ids).logits,
            "generated": model.generate(ids[:1, :4], max_new_tokens=10, do_sample=False, pad_token_id=0),
            "package_logits": package_logits,
        }
    return folder, expected


def test_the_package_and_remote_code_give_the_same_logits_up_to_the_kernels_rounding(saved):
    """The saved checkpoint keeps the default (fused) config; the package's logits (the fused kernel, loaded by the
    fixture) differ from the eager map's only by float32 rounding."""
    folder, expected = saved
    assert json.loads((folder / "config.json").read_text()).get("qkmap_fused_feature_map", True) is True
    torch.testing.assert_close(expected["package_logits"], expected["logits"], atol=1e-5, rtol=1e-5)


def test_checkpoint_carries_code_and_auto_map(saved):
    folder, _ = saved
    for name in REMOTE_CODE_FILES:
        assert (folder / name).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qkmap"
    assert config["auto_map"]["AutoConfig"] == "configuration_qkmap.QKMapConfig"
    assert config["auto_map"]["AutoModel"] == "modeling_qkmap.QKMapModel"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qkmap.QKMapForCausalLM"
    assert (folder / "model.safetensors").is_file()
    assert not list(folder.glob("*.bin"))


def test_remote_code_imports_only_torch_transformers_and_siblings():
    allowed_roots = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
    package_dir = Path(qkmap_hf.__file__).parent / "modeling"
    for name in REMOTE_CODE_FILES:
        tree = ast.parse((package_dir / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:  # relative: must be a sibling that is copied too
                    assert f"{node.module}.py" in REMOTE_CODE_FILES, (name, node.module)
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed_roots, (name, roots)


@pytest.mark.slow
def test_loads_in_a_clean_process_without_qkmap_hf(saved, tmp_path):
    folder, expected = saved
    result = run_clean_python(
        LOAD_AND_RUN.format(source=str(folder), ids=INPUT_IDS),
        cwd=tmp_path,
        env={"HF_MODULES_CACHE": str(tmp_path / "modules")},
    )
    assert result["class"] == "QKMapForCausalLM" and result["config_class"] == "QKMapConfig"
    assert result["module"].startswith("transformers_modules")  # the copied file, not the package
    logits = torch.tensor(result["logits"]).view_as(expected["logits"])
    assert torch.equal(logits, expected["logits"])
    assert result["generated"] == expected["generated"].tolist()


@pytest.mark.slow
def test_loads_from_a_repo_id_in_an_offline_hub_cache(saved, tmp_path):
    folder, expected = saved
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--qkmap-test--tiny"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "home"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = run_clean_python(LOAD_AND_RUN.format(source="qkmap-test/tiny", ids=INPUT_IDS), cwd=tmp_path, env=env)
    logits = torch.tensor(result["logits"]).view_as(expected["logits"])
    assert torch.equal(logits, expected["logits"])
    assert result["generated"] == expected["generated"].tolist()


@pytest.mark.slow
def test_resaving_a_remote_code_model_keeps_it_loadable(saved, tmp_path):
    """A model loaded through trust_remote_code (no package) saves a checkpoint that loads the same way."""
    folder, expected = saved
    code = f"""
    import json, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
    model.save_pretrained({str(tmp_path / "resaved")!r})
    again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "resaved")!r}, trust_remote_code=True, attn_implementation="eager").eval()
    with torch.no_grad():
        print(json.dumps({{"logits": again(torch.tensor({INPUT_IDS!r})).logits.flatten().tolist()}}))
    """
    result = run_clean_python(code, cwd=tmp_path, env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert torch.equal(torch.tensor(result["logits"]).view_as(expected["logits"]), expected["logits"])
    assert (tmp_path / "resaved" / "modeling_qkmap.py").is_file()


TOKENIZE_SILENTLY = """
import json, sys
from transformers import AutoTokenizer, PreTrainedTokenizerFast
text = "To be, or not to be: that is the question."
folder, source = sys.argv[1], sys.argv[2]
ids = {
    "source": AutoTokenizer.from_pretrained(source)(text).input_ids,
    "trusted": AutoTokenizer.from_pretrained(folder, trust_remote_code=True)(text).input_ids,
    "fast": PreTrainedTokenizerFast.from_pretrained(folder)(text).input_ids,
}
print("SPLIT", flush=True)
print("SPLIT", file=sys.stderr, flush=True)
ids["untrusted"] = AutoTokenizer.from_pretrained(folder)(text).input_ids
print("\\nIDS", json.dumps(ids))  # a prompt above may have left its line open
"""


@pytest.mark.slow
def test_converted_folder_tokenizer_loads_as_the_sources(tmp_path):
    """The tokenizer of a converted folder gives the source's ids, silently with trust_remote_code=True or through
    PreTrainedTokenizerFast. Without the flag transformers 5.x still asks about remote code (AutoTokenizer reads
    the model config through AutoConfig first, and config.json's auto_map names the folder's config class); with
    stdin closed it answers no and falls back. Asserted so that docs/serving.md's limit is noticed when it lifts."""
    from tests.utils import tiny_llama_converted_exactly

    paths = tiny_llama_converted_exactly(tmp_path, initializer_range=0.02)
    config = json.loads((paths["conv"] / "config.json").read_text())
    assert "AutoTokenizer" not in config["auto_map"]  # only the model needs remote code
    tokenizer_config = json.loads((paths["conv"] / "tokenizer_config.json").read_text())
    assert (
        tokenizer_config["tokenizer_class"]
        == json.loads((paths["src"] / "tokenizer_config.json").read_text())["tokenizer_class"]
    )
    result = run_without_qkmap_hf(TOKENIZE_SILENTLY, [paths["conv"], paths["src"]])
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout.rsplit("IDS", 1)[1])
    assert ids["trusted"] == ids["fast"] == ids["untrusted"] == ids["source"]
    assert len(ids["source"]) == len("To be, or not to be: that is the question.")  # byte-level: one id per byte
    (out_before, out_after), (err_before, err_after) = result.stdout.split("SPLIT"), result.stderr.split("SPLIT")
    assert "custom code" not in out_before + err_before and "model of type" not in err_before  # silent
    assert "Do you wish to run the custom code?" in out_after + err_after  # transformers' prompt, see docstring
