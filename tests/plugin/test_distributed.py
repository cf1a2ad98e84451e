"""Distributed training on CPU (gloo): the same entry point under torchrun, and FSDP by decoder layer.

Tolerance: two processes with half the batch each see the same global batch as one process, so every logged loss
must agree to float32 reduction noise. Measured differences are ~1e-6; the tests allow 1e-4.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training.presets import preset_config
from qkmap_hf.training.trainer import PROVENANCE_FILE, TrainOptions, fsdp_settings, training_arguments

TOLERANCE = 1e-4
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(_free_port())]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ddp-corpus") / "hamlet.txt"
    path.write_text(shakespeare_text(max_chars=120_000, plays=("hamlet_gut",)), encoding="utf-8")
    return path


def test_two_process_ddp_matches_one_process_on_the_same_global_batch(corpus, tmp_path):
    common = ["--model", "tiny", "--data", str(corpus), "--max-steps", "6", "--logging-steps", "1", "--eval-steps", "3",
              "--max-eval-blocks", "16", "--save-steps", "0", "--disable-tqdm"]  # fmt: skip
    _run(
        [
            sys.executable,
            "-m",
            "qkmap_hf",
            "train",
            *common,
            "--batch-size",
            "8",
            "--output-dir",
            str(tmp_path / "one"),
        ],
        tmp_path,
    )
    _run(
        [*_torchrun(2), "-m", "qkmap_hf", "train", *common, "--batch-size", "4", "--output-dir", str(tmp_path / "two")],
        tmp_path,
    )
    one = json.loads((tmp_path / "one" / PROVENANCE_FILE).read_text())
    two = json.loads((tmp_path / "two" / PROVENANCE_FILE).read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert two["parallel"]["parallel_mode"] == "distributed"

    def series(record, key):
        return [(h["step"], h[key]) for h in record["log_history"] if key in h]

    for key in ("loss", "eval_loss"):
        a, b = series(one, key), series(two, key)
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 3
        for (step, x), (_, y) in zip(a, b, strict=True):
            assert abs(x - y) < TOLERANCE, (key, step, x, y)
    losses = [v for _, v in series(one, "loss")]
    assert losses[-1] < losses[0] - 0.3  # it learned, so equal losses mean equal updates

    from transformers import AutoModelForCausalLM

    batch = torch.tensor(list(corpus.read_bytes()[:256])).view(2, 128)
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(tmp_path / d)(input_ids=batch).logits for d in ("one", "two")]
    assert (logits[0] - logits[1]).abs().max() < 1e-3


def test_fsdp_config_wraps_decoder_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(preset_config("tiny"))
    options = TrainOptions(model="tiny", data=[], output_dir=str(tmp_path), fsdp=True)
    assert fsdp_settings(options, model) == {
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["QKMapDecoderLayer"],
    }
    args = training_arguments(options, {"batch_size": 2, "learning_rate": 1e-3}, model, has_eval=False)
    assert args.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "QKMapDecoderLayer"
    assert args.fsdp_plugin_args["fsdp_version"] == 2


# accelerate turns FSDP on only for accelerator backends, so on CPU the wrapping plan runs through torch's own
# fully_shard: one unit per class in fsdp_settings()["transformer_layer_cls_to_wrap"], then the root, and the
# optimizer built from our parameter groups (which must find the QK-MAP group among sharded DTensors).
FSDP_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import qkmap_hf
    from transformers import AutoModelForCausalLM, set_seed
    from qkmap_hf.training.optim import parameter_groups
    from qkmap_hf.training.presets import preset_config
    from qkmap_hf.training.trainer import TrainOptions, fsdp_settings

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    set_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny", "qk_map"), attn_implementation="sdpa")
    wrapped = []
    if distributed:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        classes = set(fsdp_settings(TrainOptions("tiny", [], "."), model)["transformer_layer_cls_to_wrap"])
        for module in list(model.modules()):
            if type(module).__name__ in classes:
                fully_shard(module)
        fully_shard(model)
        wrapped = sorted({type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)})
    groups = parameter_groups(model, learning_rate=3e-3, weight_decay=0.1, qkmap_learning_rate=3e-2)
    sizes = {g["name"]: len(g["params"]) for g in groups}
    optimizer = torch.optim.AdamW(groups)
    data = torch.tensor(list(open(sys.argv[1], "rb").read()[: 6 * 8 * 64])).view(6, 8, 64)
    losses = []
    for step in range(6):
        batch = data[step].chunk(world)[rank]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if distributed:
            dist.all_reduce(value)
        losses.append(value.item() / world)
    if rank == 0:
        with open(sys.argv[2], "w") as handle:
            json.dump({"losses": losses, "wrapped": wrapped, "groups": sizes}, handle)
    if distributed:
        dist.destroy_process_group()
    """
)


def test_fsdp_by_decoder_layer_matches_one_process(corpus, tmp_path):
    worker = tmp_path / "fsdp_worker.py"
    worker.write_text(FSDP_WORKER)
    _run([sys.executable, str(worker), str(corpus), str(tmp_path / "one.json")], tmp_path)
    _run([*_torchrun(2), str(worker), str(corpus), str(tmp_path / "two.json")], tmp_path)
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["wrapped"] == ["FSDPQKMapDecoderLayer", "FSDPQKMapForCausalLM"]
    assert one["groups"] == two["groups"] == {"decay": 15, "no_decay": 5, "qkmap": 6}
    assert one["losses"][-1] < one["losses"][0] - 0.3
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) < TOLERANCE
