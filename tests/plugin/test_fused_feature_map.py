"""``qkmap_fused_feature_map``: the fused CPU kernel (qkmap_hf/kernels) against the written-out formula and the eager
map, in the model (training, prefill, decoding, bf16, trust_remote_code), where it steps aside, and how it is built
and loaded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM, kernels
from qkmap_hf.cli import main as cli_main
from qkmap_hf.modeling import feature_map_qkmap
from qkmap_hf.modeling.attention_qkmap import FUSED_ATTENTION_OPS
from qkmap_hf.modeling.feature_map_qkmap import FUSED_NAMESPACE, qkmap_features, qkmap_query_key_features
from tests.utils import run_clean_python, tiny_config_kwargs, written_out_features

CASES = [  # heads, kv_heads, F, frequency width, m (m / 2 below, at and above a vector of floats), rotate, table batch
    pytest.param(2, 2, 1, 6, 6, True, 1, id="mha-F1-m6"),
    pytest.param(4, 2, 2, 12, 12, False, 2, id="gqa-F2-unrotated-batched-tables"),
    pytest.param(6, 2, 3, 1, 40, True, 1, id="gqa-F3-per-block-m40"),
    pytest.param(2, 1, 1, 64, 64, True, 2, id="gqa-m64"),
]


def float32_inputs(heads, kv_heads, num_freq, freq_width, m, table_batch, seq=7, batch=2, seed=0):
    """float32 inputs as the model passes them: ``z`` a transposed view of token-major projections."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    z = rand(batch, seq, heads, m).transpose(1, 2).requires_grad_()
    frequency = (rand(kv_heads, num_freq, freq_width).abs() + 0.3).requires_grad_()
    gain = rand(kv_heads, 2 * num_freq, m).requires_grad_()
    angles = torch.arange(seq)[:, None] * torch.logspace(0, -2, m // 2)[None] + rand(table_batch, 1, 1)
    angles = torch.cat((angles, angles), dim=-1)
    return z, frequency, gain, angles.cos(), angles.sin()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width,m,rotate,table_batch", CASES)
def test_fused_map_equals_the_written_out_formula_and_its_gradients(
    fused_calls, heads, kv_heads, num_freq, freq_width, m, rotate, table_batch
):
    """float32 through the fused kernel both ways against docs/method.md's phi written out in float64: values and the
    gradients of ``z``, omega and the gains of a random weighting, to float32 rounding."""
    inputs = float32_inputs(heads, kv_heads, num_freq, freq_width, m, table_batch)
    features = qkmap_features(*inputs, rotate_cos_blocks=rotate)
    reference_inputs = [tensor.detach().double().requires_grad_(tensor.requires_grad) for tensor in inputs]
    expected = written_out_features(*reference_inputs, rotate_cos_blocks=rotate)
    assert features.shape == expected.shape and features.dtype == torch.float32
    assert features.transpose(1, 2).is_contiguous()  # token-major, as the eager map hands it to the kernel
    assert relative_error(features, expected) < 1e-6
    weights = torch.randn(features.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((features * weights).sum(), inputs[:3])
    want = torch.autograd.grad((expected * weights.double()).sum(), reference_inputs[:3])
    for name, a, b in zip(("z", "frequency", "gain"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert relative_error(a, b) < 1e-5, name
    assert fused_calls == ["features", "feature_gradients"]


def test_fused_map_sums_omega_and_gain_gradients_over_many_positions_and_threads(fused_kernel):
    """8 query heads on 2 key heads, 700 positions, 2 threads: the sums per chunk of rows, added in row order, give
    the float64 eager map's gradients to float32 rounding and the same bits on a second call; the values are the
    eager float32 map's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        inputs = [t.detach() for t in float32_inputs(8, 2, 1, 64, 64, 1, seq=700, batch=1, seed=1)]
        grad = torch.randn(1, 8, 700, 128, generator=torch.Generator().manual_seed(2))
        needs = (True, True, True, False, False)
        fused = feature_map_qkmap._fused_gradients(grad, *inputs, True, needs[:3])[:3]
        reference = feature_map_qkmap._feature_gradients(
            grad.double(), *(t.double() for t in inputs), True, needs
        )[:3]  # fmt: skip
        for name, a, b in zip(("z", "frequency", "gain"), fused, reference, strict=True):
            assert relative_error(a, b) < 2e-5, name
        again = feature_map_qkmap._fused_gradients(grad, *inputs, True, needs[:3])[:3]
        assert all(torch.equal(a, b) for a, b in zip(fused, again, strict=True))  # chunks' sums added in row order
        eager = feature_map_qkmap._features(*inputs, True)
        assert relative_error(feature_map_qkmap._fused_features(*inputs, True), eager) < 1e-6
    finally:
        torch.set_num_threads(threads)


def pair_of_models(fields: dict, dtype=torch.float32) -> tuple[QKMapForCausalLM, QKMapForCausalLM]:
    """The same weights with the eager map and with the fused kernel."""
    eager = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(**fields), qkmap_fused_feature_map=False))
    fused = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(**fields)))
    fused.load_state_dict(eager.state_dict())
    with torch.no_grad():  # omega and gains away from their init, so every gradient is exercised
        for a, b in zip(eager.parameters(), fused.parameters(), strict=True):
            if a.dim() == 3:
                noise = 0.2 * torch.randn(a.shape, generator=torch.Generator().manual_seed(a.numel()))
                a.add_(noise), b.add_(noise)
    return eager.to(dtype), fused.to(dtype)


@pytest.mark.parametrize(
    "fields",
    [pytest.param({}, id="wide-recomputing"), pytest.param({"qkmap_input_dim": 4}, id="compact")],
)
def test_a_model_trains_and_decodes_with_the_fused_map_as_with_the_eager_one(fused_calls, fields):
    """A float32 training step (the wide layout's default recomputing node, the compact layout's query/key node): the
    eager map's loss and every gradient to float32 rounding; greedy decoding the same tokens. The kernel runs in
    training both ways, in the prefill per query and key, and once per layer for each decoded token."""
    eager, fused = pair_of_models(fields)
    layers = fused.config.num_hidden_layers
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, fused):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(eager.named_parameters(), fused.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max().item() <= 1e-5 * (1 + a.grad.abs().max().item()), name
    assert fused_calls == ["features"] * 2 * layers + ["feature_gradients"] * 2 * layers
    fused_calls.clear()
    with torch.no_grad():
        generated = [model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False) for model in (eager, fused)]
    assert torch.equal(generated[0], generated[1])
    assert fused_calls == ["features"] * (2 * layers + 5 * layers)  # the prefill's q and k, then 5 one-token steps


def test_a_bfloat16_model_runs_the_fused_map_in_float32(fused_calls):
    """bf16 weights: queries and keys reach the kernel in float32 (as the eager map computes them) and come back in
    bf16; the logits are the eager bf16 model's up to bf16 rounding."""
    eager, fused = pair_of_models({}, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = [model(ids).logits.float() for model in (eager, fused)]
    assert fused_calls == ["features"] * 2 * fused.config.num_hidden_layers
    assert relative_error(logits[1], logits[0]) < 2e-2


def test_the_fused_map_steps_aside_where_it_does_not_apply(fused_calls, monkeypatch):
    """float64 inputs (gradcheck's), the field off, RoPE tables that need gradients (backward only) and a process
    without the ops all run the eager map, with its values."""
    inputs = float32_inputs(4, 2, 1, 6, 6, 1)
    qkmap_features(*(t.detach().double() for t in inputs))
    qkmap_features(*inputs, fused=False)
    assert fused_calls == []

    z, frequency, gain, cos, sin = inputs
    cos, sin = cos.requires_grad_(), sin.requires_grad_()
    features = qkmap_features(z, frequency, gain, cos, sin)
    grads = torch.autograd.grad(features.square().sum(), (z, frequency, gain, cos, sin))
    assert fused_calls == ["features"]  # the backward pass ran the eager map: the tables' gradients are its own
    eager = qkmap_features(z, frequency, gain, cos, sin, fused=False)
    eager_grads = torch.autograd.grad(eager.square().sum(), (z, frequency, gain, cos, sin))
    assert relative_error(features, eager) < 1e-6
    assert all(relative_error(a, b) < 1e-5 for a, b in zip(grads, eager_grads, strict=True))

    monkeypatch.setattr(feature_map_qkmap, "FUSED_OPS", lambda: None)
    query, key = inputs[0].detach(), inputs[0].detach()[:, ::2]
    shared = (frequency.detach(), gain.detach(), gain.detach(), *(t.detach() for t in inputs[3:]))
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            qkmap_query_key_features(query, key, *shared),
            qkmap_query_key_features(query, key, *shared, fused=False),
            strict=True,
        )
    )


def test_the_ops_are_looked_up_again_only_when_a_library_loads(fused_kernel, monkeypatch):
    """``FusedOps`` caches its lookup (a failed ``torch.ops`` lookup searches the registry each time) and looks again
    when ``torch.ops.loaded_libraries`` grows."""
    lookups = []

    class CountingOps:
        def __init__(self, ops):
            self.ops, self.loaded_libraries = ops, set(ops.loaded_libraries)

        def __getattr__(self, name):
            lookups.append(name)
            return getattr(self.ops, name)

    counting = CountingOps(torch.ops)
    monkeypatch.setattr(torch, "ops", counting)
    ops = feature_map_qkmap.FusedOps(("features", "feature_gradients"))
    assert ops() is not None and ops() is not None
    assert lookups == [FUSED_NAMESPACE]
    counting.loaded_libraries.add("/another/library.so")
    assert ops() is not None
    assert lookups == [FUSED_NAMESPACE] * 2


REMOTE_CODE_WITH_THE_KERNEL = """
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM
torch.ops.load_library({library!r})  # as qkmap_hf's import does; qkmap_hf itself cannot be imported here
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True)

class Ops(TorchDispatchMode):
    names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {{}}))

ids = torch.tensor({ids!r})
with Ops() as ops, torch.no_grad():
    logits = model(ids).logits
print(json.dumps({{"module": type(model).__module__, "ops": ops.names, "logits": logits.flatten().tolist()}}))
"""


@pytest.mark.slow  # a fresh interpreter (~5 s of imports)
def test_a_checkpoint_loaded_with_remote_code_runs_the_fused_ops_where_they_are_loaded(fused_kernel, tmp_path):
    """The checkpoint's copies of the model files import only torch and find the kernel through ``torch.ops``: loaded
    with trust_remote_code where qkmap_hf cannot be imported, they run it, with this process's logits."""
    model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs())).eval()
    model.save_pretrained(tmp_path / "model")
    ids = [[5, 17, 42, 99, 7, 3, 250, 11]]
    code = REMOTE_CODE_WITH_THE_KERNEL.format(library=str(fused_kernel.path), folder=str(tmp_path / "model"), ids=ids)
    result = run_clean_python(code, cwd=tmp_path)
    assert result["module"].startswith("transformers_modules")
    assert result["ops"].count(f"{FUSED_NAMESPACE}.features.default") == 2 * model.config.num_hidden_layers
    assert model.config.query_key_dim > model.config.head_dim  # the wide layout: the fused attention runs too
    assert result["ops"].count(f"{FUSED_NAMESPACE}.causal_attention.default") == model.config.num_hidden_layers
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.flatten()
    assert torch.allclose(torch.tensor(result["logits"]), expected, atol=1e-5)


def test_the_kernel_sources_register_the_ops_the_model_files_look_up():
    """One library, one namespace: the feature map's file claims it, the attention's adds to it."""
    feature_map, attention = (source.read_text() for source in kernels.SOURCES)
    assert re.findall(r"TORCH_LIBRARY(?:_IMPL)?\((\w+),", feature_map) == [FUSED_NAMESPACE, FUSED_NAMESPACE]
    assert set(re.findall(r'impl\("(\w+)"', feature_map)) == {"features", "feature_gradients"}
    assert re.findall(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\((\w+),", attention) == [
        ("FRAGMENT", FUSED_NAMESPACE),
        ("IMPL", FUSED_NAMESPACE),
    ]
    assert set(re.findall(r'impl\("(\w+)"', attention)) == set(FUSED_ATTENTION_OPS.names)


def test_a_build_is_keyed_by_source_torch_and_flags(monkeypatch, tmp_path):
    """A torch upgrade or an edited source builds anew rather than loading a library built against another ABI."""
    monkeypatch.setenv("QKMAP_HF_CACHE", str(tmp_path))
    path = kernels.kernel_path()
    assert path.parent == tmp_path / "kernels" and path.suffix == ".so"
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert kernels.kernel_path() != path
    monkeypatch.undo()
    monkeypatch.setenv("QKMAP_HF_CACHE", str(tmp_path))
    for index, source in enumerate(kernels.SOURCES):  # an edit of either source
        edited = tmp_path / source.name
        edited.write_text(source.read_text() + "\n// edited\n")
        monkeypatch.setattr(kernels, "SOURCES", (*kernels.SOURCES[:index], edited, *kernels.SOURCES[index + 1 :]))
        assert kernels.kernel_path() != path
        monkeypatch.undo()
        monkeypatch.setenv("QKMAP_HF_CACHE", str(tmp_path))


def test_a_failed_build_leaves_no_file_and_loading_says_why(monkeypatch, tmp_path):
    """A compiler that fails or is missing: ``build_fused_kernel`` raises one line naming it and leaves nothing that
    looks like a build; ``load_fused_kernel(build=True)`` warns and reports the reason, never raises."""
    monkeypatch.setenv("QKMAP_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "fused_kernel_loaded", lambda: False)
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(kernels.KernelBuildError, match=r"^/bin/false failed to build the fused kernels"):
        kernels.build_fused_kernel()
    assert list((tmp_path / "kernels").iterdir()) == []
    with pytest.warns(RuntimeWarning, match="failed to build"):
        status = kernels.load_fused_kernel(build=True)
    assert not status.loaded and "failed to build" in status.reason and "eager" in status.line()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(kernels.KernelBuildError, match=r"no C\+\+ compiler found \(CXX='.*no-such-compiler' is not"):
        kernels.build_fused_kernel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading without building never compiles, never warns
        status = kernels.load_fused_kernel()
    assert not status.loaded and "qkmap kernels" in status.reason


def test_a_build_others_could_have_written_is_not_loaded(monkeypatch, tmp_path, fused_kernel):
    """Loading a library runs it: a build writable by other users, or in a folder they may write to, is refused with
    the reason, as ssh refuses such keys."""
    monkeypatch.setenv("QKMAP_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "fused_kernel_loaded", lambda: False)
    path = kernels.kernel_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a library")
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    for target, mode in ((path, 0o666), (path.parent, 0o777)):
        target.chmod(mode)
        with pytest.warns(RuntimeWarning, match="writable by other users"):
            status = kernels.load_fused_kernel()
        assert not status.loaded and f"writable by other users (mode {mode:o})" in status.reason
        target.chmod(0o755 if target.is_dir() else 0o644)
    assert loaded == []
    assert kernels.load_fused_kernel().reason == "no ops registered" and loaded == [str(path)]


def test_qkmap_kernels_builds_loads_and_checks_the_kernel(fused_kernel, capsys, monkeypatch, tmp_path):
    assert cli_main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert f"torch.ops.{FUSED_NAMESPACE} loaded from {kernels.kernel_path()}" in out
    difference = float(re.search(r"largest relative difference (\S+) ", out).group(1))
    assert 0 < difference < 1e-5
    monkeypatch.setenv("QKMAP_HF_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    assert cli_main(["kernels"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "qkmap kernels: error: /bin/false failed to build the fused kernels: exit status 1"


@pytest.mark.slow  # two fresh interpreters (~4 s of imports each)
def test_importing_qkmap_hf_loads_this_machines_build_and_never_compiles(fused_kernel, tmp_path):
    code = "import json, qkmap_hf; from qkmap_hf.kernels import fused_kernel_loaded; print(json.dumps(fused_kernel_loaded()))"

    def run(env: dict) -> str:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    assert run({**os.environ}) == "true"
    empty = tmp_path / "cache"
    assert run({**os.environ, "QKMAP_HF_CACHE": str(empty), "CXX": "/bin/false"}) == "false"
    assert not empty.exists()  # looking for a build creates nothing


def test_the_feature_map_benchmark_times_both_paths_per_direction(fused_kernel, tmp_path, one_thread):
    """benchmarks/feature_map_kernel.py on a tiny grid: a row per shape, layout, length and direction with both
    paths' times and their per-repeat ratio, as CSV and Markdown."""
    import csv

    sys.path.insert(0, str(kernels.SOURCES[0].parents[2] / "benchmarks"))
    import feature_map_kernel

    args = ["--head-dims", "16", "--heads", "4", "--kv-ratios", "1", "4", "--seq-lens", "8", "--repeats", "2"]
    assert feature_map_kernel.main([*args, "--calls", "1", "--output-dir", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "feature_map_kernel.csv").open()))
    assert [(r["shape"], r["layout"], r["direction"]) for r in rows] == [
        (shape, layout, direction)
        for shape in ("d16 h4/kv4", "d16 h4/kv1")
        for layout in ("qk_map_wide", "qk_map_compact")
        for direction in ("forward", "backward")
    ]
    for row in rows:
        eager, fused, ratio = float(row["eager_us"]), float(row["fused_us"]), float(row["ratio"])
        assert eager > 0 and fused > 0 and float(row["ratio_min"]) <= ratio <= float(row["ratio_max"])
    assert (tmp_path / "feature_map_kernel.md").read_text().count("\n") == 2 + len(rows)
