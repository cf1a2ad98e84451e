"""Hostile pushes: bad repo ids are refused locally before anything else, pickled content is found whatever the
file is called, symlinks are refused, a network failure is one line; the folder is never modified."""

from __future__ import annotations

import json
import pickle
import shutil
import socket
import struct

import numpy as np
import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM, hub
from qkmap_hf.cards import write_model_card
from qkmap_hf.hub import push_to_hub, validate_for_push
from qkmap_hf.safety import pickle_reason
from tests.hostile import assert_refused, run_cli, tree_digest
from tests.utils import tiny_config_kwargs


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny QK-MAP checkpoint with a card: passes every static push check."""
    folder = tmp_path_factory.mktemp("hostile-push") / "tiny"
    QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs())).save_pretrained(folder)
    write_model_card(folder)
    assert validate_for_push(folder, load_check=False) == []
    return folder


@pytest.fixture
def folder(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "tiny")


@pytest.fixture
def offline_endpoint(monkeypatch):
    """A Hub endpoint on a closed loopback port: any request fails to connect."""
    from huggingface_hub import constants

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    return constants.ENDPOINT


@pytest.mark.parametrize("repo_id", ["a/b/c", "../x", "org/..", "org/my model", "org/name-", "org/" + "n" * 97, ""])
def test_bad_repo_ids_are_refused_locally(repo_id, folder, capsys, offline_endpoint):
    before = tree_digest(folder)
    code, _, err = run_cli(capsys, "push", folder, repo_id, "--dry-run")
    assert_refused(code, err, f"repo id {repo_id!r} is invalid")
    with pytest.raises(ValueError, match="is invalid"):  # the library refuses before any request (none could connect)
        push_to_hub(folder, repo_id, load_check=False)
    assert tree_digest(folder) == before


def _protocol4(path):
    path.write_bytes(pickle.dumps({"weights": [1.0, 2.0]}, protocol=4))


def _torch_zip(path):
    torch.save({"weight": torch.ones(2)}, path)


def _protocol0(path):
    path.write_bytes(pickle.dumps({"a": [1, 2]}, protocol=0))


def _numpy_objects(path):
    with path.open("wb") as handle:
        np.save(handle, np.array([{"a": 1}], dtype=object), allow_pickle=True)


@pytest.mark.parametrize(
    "name, write, reason",
    [
        ("weights.npy", _protocol4, "protocol-4 pickle"),
        ("model.pth.tar", _torch_zip, "zip archive holding pickled data"),
        ("notes.txt", _protocol0, "protocol-0/1 pickle"),
        ("array.npy", _numpy_objects, "NumPy array of Python objects"),
        ("sub/extra.safetensors", _protocol4, "protocol-4 pickle"),
    ],
)
def test_pickles_are_found_by_content_whatever_the_name(name, write, reason, folder, capsys):
    (folder / name).parent.mkdir(exist_ok=True)
    write(folder / name)
    before = tree_digest(folder)
    problems = validate_for_push(folder, load_check=False)
    assert any(name in p and reason in p and "pickle" in p for p in problems), problems
    code, _, err = run_cli(capsys, "push", folder, "org/name", "--dry-run")
    assert code == 1 and name in err and "nothing was uploaded" in err and "Traceback" not in err
    assert tree_digest(folder) == before


def test_weights_tokenizers_and_text_are_not_taken_for_pickles(pristine, tmp_path):
    for name in ("model.safetensors", "config.json", "README.md", "modeling_qkmap.py"):
        assert pickle_reason(pristine / name) is None, name
    (tmp_path / "hello.txt").write_bytes(b"hello.")  # parses as pickle opcodes, but is not a stack-valid pickle
    assert pickle_reason(tmp_path / "hello.txt") is None
    # a safetensors file whose header length starts with the bytes of a protocol-2 pickle (0x80 0x02)
    header = json.dumps({"__metadata__": {"pad": ""}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    header = header.replace('"pad": ""', '"pad": "' + "x" * (0x0280 - len(header)) + '"')
    data = struct.pack("<Q", len(header)) + header.encode() + struct.pack("<f", 1.0)
    assert data[:2] == b"\x80\x02"
    (tmp_path / "w.safetensors").write_bytes(data)
    assert pickle_reason(tmp_path / "w.safetensors") is None


def test_symlinks_are_refused(folder, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (folder / "extra.txt").symlink_to(secret)
    (folder / "docs").symlink_to(tmp_path, target_is_directory=True)
    before = tree_digest(folder)
    problems = validate_for_push(folder, load_check=False)
    assert any(
        "extra.txt (a symlink to" in p and "outside the folder" in p and "docs (a symlink" in p for p in problems
    )
    code, _, err = run_cli(capsys, "push", folder, "org/name", "--dry-run")
    assert code == 1 and "extra.txt" in err and "Traceback" not in err
    assert tree_digest(folder) == before and secret.read_text() == "not for the Hub"


def _loads_fine(folder):
    """Stand-in for the clean-load check (a fresh interpreter, tested in test_push.py)."""
    return {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "finite_logits": True}


def test_network_failure_is_one_line(folder, capsys, monkeypatch, offline_endpoint):
    """The Hub unreachable: exit 2 and one line naming the network error (the clean-load check is stubbed: it is
    tested in test_push.py and takes a fresh interpreter)."""
    monkeypatch.setattr(hub, "clean_load_check", _loads_fine)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    before = tree_digest(folder)
    code, _, err = run_cli(capsys, "push", folder, "org/name", "--token", "hf_x")
    assert_refused(code, err, "network error", "Check the connection, HF_ENDPOINT")
    assert len([line for line in err.splitlines() if line.strip()]) <= 2, err
    assert tree_digest(folder) == before


def test_hub_error_status_is_one_line(folder, capsys, monkeypatch):
    """The Hub answers 401 to everything (a bad token): exit 2, one line saying the Hub refused and why."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from huggingface_hub import constants

    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _refuse(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps({"error": "Invalid credentials in Authorization header"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setattr(hub, "clean_load_check", _loads_fine)
        before = tree_digest(folder)
        code, _, err = run_cli(capsys, "push", folder, "org/name", "--token", "hf_bad")
        assert_refused(code, err, "the Hub refused the request", "Invalid credentials")
        assert tree_digest(folder) == before
    finally:
        server.shutdown()
        server.server_close()
