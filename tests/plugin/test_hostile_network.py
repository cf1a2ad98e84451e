"""Hostile networks: an endpoint that accepts connections and never answers fails in one line after the timeout
(never a hang), and an answer that is not the Hub's (an HTML page, an empty body, a proxy's bare 404) is named as
such rather than read as the Hub rejecting the card. The folder and the files beside it are never modified."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qkmap_hf import QKMapConfig, QKMapForCausalLM, hub
from qkmap_hf.cards import write_model_card
from qkmap_hf.hub import hub_timeouts
from tests.hostile import assert_refused, run_cli, tree_digest
from tests.utils import tiny_config_kwargs


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-network") / "tiny"
    QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs())).save_pretrained(folder)
    write_model_card(folder)
    return folder


@pytest.fixture
def folder(pristine, tmp_path, monkeypatch):
    """A copy of the checkpoint, a file beside it, and the clean-load check stubbed (test_push.py runs it)."""
    monkeypatch.setattr(
        hub,
        "clean_load_check",
        lambda folder: {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "finite_logits": True},
    )
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    (tmp_path / "beside.txt").write_text("not part of the push\n")
    return shutil.copytree(pristine, tmp_path / "tiny")


def _use_endpoint(monkeypatch, url: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", url)


@pytest.fixture
def silent_endpoint(monkeypatch):
    """A loopback server that accepts every connection, reads, and never answers (closed after the test)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    _use_endpoint(monkeypatch, url)
    yield url
    stop.set()
    thread.join(timeout=5)
    for connection in held:
        connection.close()
    listener.close()


def _serving(status: int, body: bytes, content_type: str | None):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            if content_type:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_HEAD = _answer

    return Handler


@pytest.fixture
def impostor(monkeypatch):
    """Start a loopback server answering every request with one fixed response; all stopped after the test."""
    servers = []

    def start(status: int, body: bytes, content_type: str | None) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _serving(status, body, content_type))
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        _use_endpoint(monkeypatch, url)
        return url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("how", ["option", "environment"])
def test_an_endpoint_that_never_answers_times_out_in_one_line(how, folder, silent_endpoint, capsys, monkeypatch):
    from huggingface_hub.utils import _http

    factory = _http._GLOBAL_CLIENT_FACTORY
    extra = ("--timeout", "0.5,1") if how == "option" else ()
    if how == "environment":
        monkeypatch.setenv("QKMAP_HUB_TIMEOUT", "1")
    before = tree_digest(folder.parent)
    started = time.monotonic()
    code, out, err = run_cli(capsys, "push", folder, "org/name", "--token", "hf_x", *extra)
    elapsed = time.monotonic() - started
    assert_refused(
        code,
        err,
        f"the endpoint at {silent_endpoint} (POST /api/validate-yaml) did not answer within the timeouts",
        "read 1 s",
        "ReadTimeout",
        "--timeout / QKMAP_HUB_TIMEOUT",
    )
    assert elapsed < 15, f"took {elapsed:.1f} s with a 1 s read timeout"
    assert "pushed" not in out
    assert tree_digest(folder.parent) == before
    assert _http._GLOBAL_CLIENT_FACTORY is factory  # huggingface_hub's client is as it was after the push


@pytest.mark.parametrize(
    "status, body, content_type, named",
    [
        (404, b"", None, "HTTP 404 with an empty body"),
        (404, b"", "text/plain", "HTTP 404 with an empty body"),
        (200, b"<!DOCTYPE html><html><body>Sign in to the proxy</body></html>", "text/html", "HTTP 200 with an HTML"),
        (502, b"<html><body>Bad Gateway</body></html>", "text/html; charset=utf-8", "HTTP 502 with an HTML page"),
        (200, b"", "application/json", "HTTP 200 with an empty body"),
    ],
    ids=["proxy-404", "plain-404", "portal-page", "gateway-page", "empty-200"],
)
def test_an_answer_that_is_not_the_hubs_is_named_as_such(status, body, content_type, named, folder, impostor, capsys):
    url = impostor(status, body, content_type)
    before = tree_digest(folder.parent)
    code, out, err = run_cli(capsys, "push", folder, "org/name", "--token", "hf_x", "--timeout", "5")
    line = assert_refused(
        code,
        err,
        f"the endpoint at {url} did not answer like the Hugging Face Hub: {named}",
        "POST /api/validate-yaml",
        "Check HF_ENDPOINT",
    )
    assert "rejects the README.md metadata" not in line
    assert tree_digest(folder.parent) == before


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1,2,3", "5,"])
def test_a_bad_timeout_is_refused_naming_the_setting(value, folder, capsys, monkeypatch):
    with socket.socket() as probe:  # should the check ever be skipped, the push would fail to connect, not leave
        probe.bind(("127.0.0.1", 0))
        _use_endpoint(monkeypatch, f"http://127.0.0.1:{probe.getsockname()[1]}")
    before = tree_digest(folder.parent)
    code, _, err = run_cli(capsys, "push", folder, "org/name", "--token", "hf_x", "--timeout", value)
    assert_refused(code, err, f"--timeout {value!r}: give seconds as READ or CONNECT,READ")
    monkeypatch.setenv("QKMAP_HUB_TIMEOUT", value)
    with pytest.raises(ValueError, match="QKMAP_HUB_TIMEOUT"):
        hub_timeouts()
    assert tree_digest(folder.parent) == before


def test_timeouts_settings(monkeypatch):
    monkeypatch.delenv("QKMAP_HUB_TIMEOUT", raising=False)
    assert hub_timeouts() == (10.0, 60.0)
    monkeypatch.setenv("QKMAP_HUB_TIMEOUT", " ")  # set but empty: the defaults
    assert hub_timeouts() == (10.0, 60.0)
    assert hub_timeouts("300") == (10.0, 300.0)
    assert hub_timeouts("2") == (2.0, 2.0)
    assert hub_timeouts(" 3, 120 ") == (3.0, 120.0)
    monkeypatch.setenv("QKMAP_HUB_TIMEOUT", "4,40")
    assert hub_timeouts() == (4.0, 40.0)
    assert hub_timeouts(7) == (7.0, 7.0)  # the option wins over the environment
