"""Publish a checkpoint folder to the Hugging Face Hub, after checking that it will work for whoever downloads it.

``validate_for_push`` checks, without uploading anything:

- ``config.json`` parses; a QK-MAP config has ``auto_map`` and every remote-code file it names is in the folder
  (and none of them imports ``qkmap_hf``, which the downloader may not have);
- the repo id is valid (huggingface_hub's own validator, before anything else);
- weights are safetensors (all shards of an index present) and no file holds pickled data, judged by content
  whatever its name (``qkmap_hf.safety.pickle_reason``) as well as by the usual names (``*.bin``, ``*.pt``...);
- no symlinks (an upload follows them, so they could publish files from outside the folder);
- ``README.md`` exists and its metadata parses as a ``ModelCard`` (write one with ``qkmap card``);
- config, weights and tokenizer load in a clean Python process in which ``qkmap_hf`` cannot be imported, with
  ``trust_remote_code=True`` and a fresh modules cache, and a forward pass gives finite logits.

``push_to_hub`` refuses (``PushValidationError``, nothing created or uploaded) when any check fails, then uses
``HfApi.create_repo`` and ``HfApi.upload_folder`` with huggingface_hub's usual token (``token=``, ``HF_TOKEN``,
``hf auth login``) and endpoint (``HF_ENDPOINT``) settings.

Every request of a push runs under ``hub_session``: connect and read timeouts (``QKMAP_HUB_TIMEOUT``, seconds:
``READ`` or ``CONNECT,READ``, default 10,60; ``qkmap push --timeout``), so an endpoint that accepts the connection
and never answers fails in one line (``HubTimeoutError``) instead of hanging; and an API answer that is not the
Hub's (an HTML page, an empty body, a proxy's bare error page) is named as such (``NotTheHubError``) instead of
being read as the Hub's verdict on the card.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .cleanroom import run_without_qkmap_hf
from .filenames import TOKENIZER_FILES
from .safety import escape_reason, find_pickles, symlinks_in
from .version import __version__

# checkpoint-*/: Trainer checkpoints (optimizer state, pickled RNG state) stay local, as in Trainer.push_to_hub.
IGNORE_PATTERNS = [
    "__pycache__/*",
    "**/__pycache__/*",
    "*.pyc",
    "**/*.pyc",
    ".DS_Store",
    "**/.DS_Store",
    "checkpoint-*/*",
]
LOAD_CHECK_TIMEOUT_S = 900
_IMPORTS_QKMAP_HF = re.compile(r"^\s*(?:from\s+qkmap_hf[\s.]|import\s+qkmap_hf\b)", re.MULTILINE)

_CLEAN_LOAD = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    folder, has_tokenizer = sys.argv[1], sys.argv[2] == "1"
    report = {}
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
    )
    report["class"] = type(model).__module__ + "." + type(model).__name__
    report["missing_keys"] = sorted(info.get("missing_keys") or [])
    report["unexpected_keys"] = sorted(info.get("unexpected_keys") or [])
    report["mismatched_keys"] = [str(k) for k in info.get("mismatched_keys") or []]
    vocab = getattr(config, "vocab_size", None) or 2
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8).remainder(vocab).unsqueeze(0)).logits
    report["finite_logits"] = bool(torch.isfinite(logits).all())
    if has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        report["tokenizer"] = type(tokenizer).__name__
        report["tokenizer_roundtrip"] = len(tokenizer("To be, or not to be").input_ids) > 0
    print(json.dumps(report))
    """
)


TIMEOUT_ENV = "QKMAP_HUB_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 60.0
_API_PATH = re.compile(r"/api/|/info/lfs/objects/batch$")


class NotTheHubError(ValueError):
    """The endpoint answered, but not as the Hugging Face Hub does (a proxy, a captive portal, a wrong URL)."""


class HubTimeoutError(TimeoutError):
    """The endpoint did not answer within the timeouts; ``str()`` is the whole message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "timed out"


def hub_timeouts(timeout: str | float | None = None) -> tuple[float, float]:
    """``(connect, read)`` seconds: ``timeout`` (``READ`` or ``CONNECT,READ``), else ``QKMAP_HUB_TIMEOUT``, else
    the defaults. ``ValueError`` naming the setting for anything but positive finite numbers."""
    source = "--timeout" if timeout is not None else TIMEOUT_ENV
    text = str(timeout if timeout is not None else os.environ.get(TIMEOUT_ENV, "")).strip()
    if not text:
        return DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(0 < v < float("inf") for v in values):
        raise ValueError(f"{source} {text!r}: give seconds as READ or CONNECT,READ (positive numbers), e.g. 10,60.")
    return (min(DEFAULT_CONNECT_TIMEOUT_S, values[0]), values[0]) if len(values) == 1 else (values[0], values[1])


def _not_the_hub(response) -> str | None:
    """Why an API response cannot be the Hub's (``None``: it may be): HTML, or an empty body where JSON belongs."""
    if not _API_PATH.search(response.request.url.path):
        return None
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    body = response.read()
    if kind in ("text/html", "application/xhtml+xml") or body.lstrip()[:15].lower().startswith(
        (b"<!doctype", b"<html")
    ):
        return f"HTTP {response.status_code} with an HTML page ({kind or 'no content type'})"
    hub_error = any(name.lower().startswith("x-error") for name in response.headers)
    if not body.strip() and not hub_error and (response.status_code >= 400 or response.request.method == "POST"):
        return f"HTTP {response.status_code} with an empty body"
    return None


def _check_answer(response) -> None:
    """httpx response hook: ``NotTheHubError`` for an answer that is not the Hub's."""
    reason = _not_the_hub(response)
    if reason is not None:
        url = response.request.url
        raise NotTheHubError(
            f"the endpoint at {url.scheme}://{url.netloc.decode()} did not answer like the Hugging Face Hub: "
            f"{reason} for {response.request.method} {url.path}. Check HF_ENDPOINT and any proxy in between."
        )


@contextlib.contextmanager
def hub_session(timeout: str | float | None = None) -> Iterator[tuple[float, float]]:
    """huggingface_hub's shared HTTP client, for the block, with connect/read timeouts and ``_check_answer``;
    the previous client factory afterwards. Yields ``(connect, read)``."""
    connect, read = hub_timeouts(timeout)
    try:
        import httpx2 as httpx
    except ImportError:  # pragma: no cover - huggingface_hub < 2 (requests): its own timeouts apply
        yield connect, read
        return
    from huggingface_hub.utils import _http

    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory():
        client = previous()
        client.timeout = httpx.Timeout(read, connect=connect)
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "response": [*hooks.get("response", []), _check_answer]}
        return client

    _http.set_client_factory(factory)
    try:
        yield connect, read
    except httpx.TimeoutException as error:
        try:
            url = error.request.url
            where = f" at {url.scheme}://{url.netloc.decode()} ({error.request.method} {url.path})"
        except RuntimeError:  # an exception raised without its request
            where = ""
        raise HubTimeoutError(
            f"the endpoint{where} did not answer within the timeouts (connect {connect:g} s, read {read:g} s; "
            f"{type(error).__name__}: {' '.join(str(error).split()) or 'no answer'}); check the connection and "
            f"HF_ENDPOINT, or allow longer with --timeout / {TIMEOUT_ENV}."
        ) from error
    finally:
        _http.set_client_factory(previous)


class PushRefusedError(ValueError):
    """The environment forbids the upload (e.g. ``HF_HUB_OFFLINE``); nothing was uploaded."""


class PushValidationError(ValueError):
    """The folder is not fit for publishing; ``problems`` says what to fix. Nothing was uploaded.

    ``qkmap`` exits with ``exit_code`` 1 for it (a validation report, one line per problem), 2 for other refusals.
    """

    exit_code = 1

    def __init__(self, folder: str | Path, problems: list[str]):
        self.folder = str(folder)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{folder} is not ready to publish; nothing was uploaded:\n{lines}")


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if huggingface_hub accepts it (``ORG/NAME`` or ``NAME``), else ``ValueError`` saying why: the push
    target's refusal (``qkmap_hf.loading.is_repo_id`` is the test for a name that may be a model's)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"repo id {repo_id!r} is invalid: {error} Use ORG/NAME, e.g. my-org/my-model.") from error
    return repo_id


def files_to_upload(folder: str | Path) -> list[str]:
    """Relative paths ``upload_folder`` will send: its own listing and filters (.git, .cache/huggingface) plus ours."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    folder = Path(folder).resolve()
    candidates = [p.relative_to(folder).as_posix() for p in sorted(folder.glob("**/*")) if p.is_file()]
    return list(filter_repo_objects(candidates, ignore_patterns=IGNORE_PATTERNS + DEFAULT_IGNORE_PATTERNS))


def _remote_code_files(auto_map: dict) -> set[str]:
    names = set()
    for reference in auto_map.values():
        for item in reference if isinstance(reference, (list, tuple)) else [reference]:
            if isinstance(item, str) and "." in item:
                module = item.split("--")[-1].rsplit(".", 1)[0]
                names.add(f"{module}.py")
    return names


def _check_config(folder: Path, problems: list[str]) -> dict | None:
    from transformers.dynamic_module_utils import get_relative_imports

    path = folder / "config.json"
    if not path.is_file():
        problems.append(f"{path} is missing: save the model with save_pretrained (or `qkmap convert`) first.")
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        problems.append(f"{path} is not valid JSON ({error}).")
        return None
    auto_map = config.get("auto_map") or {}
    if config.get("model_type") == "qkmap":
        for key in ("AutoConfig", "AutoModelForCausalLM"):
            if key not in auto_map:
                problems.append(
                    f"config.json auto_map lacks {key}: without it the model does not load with trust_remote_code. "
                    "Re-save it with qkmap_hf imported (QKMapConfig sets auto_map)."
                )
    pending, seen = sorted(_remote_code_files(auto_map)), set()
    while pending:  # the files auto_map names, and the siblings they import relatively (feature_map_qkmap.py)
        name = pending.pop(0)
        if name in seen:
            continue
        seen.add(name)
        code = folder / name
        if not code.is_file():
            problems.append(
                f"{name} (remote code the model loads) is missing; re-save the model with qkmap_hf imported."
            )
            continue
        text = code.read_text(encoding="utf-8", errors="replace")
        if _IMPORTS_QKMAP_HF.search(text):
            problems.append(
                f"{name} imports qkmap_hf, which downloaders may not have; remote code must import only torch/transformers."
            )
        pending.extend(f"{module}.py" for module in sorted(get_relative_imports(code)))  # transformers' own walk
    return config


def _check_weights(folder: Path, problems: list[str]) -> None:
    names = files_to_upload(folder)
    found = dict(find_pickles(folder, names))
    if found:
        listed = ", ".join(f"{name} ({reason})" for name, reason in sorted(found.items()))
        problems.append(
            f"pickle-based files {listed}: loading them can run arbitrary code. Save with "
            "safe_serialization (safetensors) and remove them."
        )
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        problems.append(
            f"no *.safetensors weights in {folder}: save with save_pretrained (safetensors is its default)."
        )
    for index_path in folder.glob("*.safetensors.index.json"):
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
        except json.JSONDecodeError as error:
            problems.append(f"{index_path.name} is not valid JSON ({error}).")
            continue
        escaping = sorted({f"{f!r} ({why})" for f in weight_map.values() if (why := escape_reason(folder, str(f)))})
        if escaping:
            problems.append(f"{index_path.name} names shards outside the folder: {', '.join(escaping)}.")
            continue
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            problems.append(f"{index_path.name} names shards that are missing: {', '.join(missing)}.")


def _check_card(folder: Path, config: dict | None, problems: list[str]) -> None:
    from huggingface_hub import ModelCard

    readme = folder / "README.md"
    if not readme.is_file():
        problems.append(f"{readme} is missing: write the model card with `qkmap card {folder}`.")
        return
    try:
        card = ModelCard.load(readme, ignore_metadata_errors=False)
    except Exception as error:  # ModelCard raises ValueError/YAMLError/TypeError for broken metadata
        problems.append(
            f"README.md metadata does not parse ({type(error).__name__}: {error}); regenerate it with `qkmap card`."
        )
        return
    data = card.data.to_dict()
    if not data:
        problems.append("README.md has no metadata block (license, tags, ...); regenerate it with `qkmap card`.")
        return
    if not data.get("license"):
        problems.append("README.md metadata has no license; pass --license to `qkmap card`.")
    if config is not None and config.get("auto_map") and "custom_code" not in (data.get("tags") or []):
        problems.append(
            "README.md tags lack 'custom_code' although the model needs trust_remote_code; regenerate the card."
        )


def clean_load_check(folder: str | Path, timeout: float = LOAD_CHECK_TIMEOUT_S) -> dict[str, Any]:
    """Load the folder in a fresh interpreter without qkmap_hf (trust_remote_code, offline, fresh modules cache)."""
    folder = Path(folder).resolve()
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    try:
        result = run_without_qkmap_hf(_CLEAN_LOAD, [str(folder), "1" if has_tokenizer else "0"], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the clean load did not finish within {timeout:.0f} s"}
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {result.returncode}", "stderr": result.stderr[-4000:]}
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"the clean load printed no report: {result.stdout[-500:]!r}"}


def validate_for_push(folder: str | Path, *, load_check: bool = True) -> list[str]:
    """Problems that make ``folder`` unfit for the Hub (empty list: ready). See the module docstring."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder; pass the checkpoint folder (config.json, weights, README.md)."]
    problems: list[str] = []
    links = symlinks_in(folder)
    if links:
        problems.append(
            f"symlinks {', '.join(links)}: the upload would follow them; copy the files into the folder instead."
        )
    config = _check_config(folder, problems)
    _check_weights(folder, problems)
    _check_card(folder, config, problems)
    if load_check and not problems:  # a broken folder fails the load anyway; its static problems say more
        report = clean_load_check(folder)
        if "error" in report:
            problems.append(
                f"the model does not load without qkmap_hf (trust_remote_code=True, offline): {report['error']}"
            )
        else:
            if report["missing_keys"] or report["unexpected_keys"] or report["mismatched_keys"]:
                problems.append(
                    "the weights do not match the model: missing "
                    f"{report['missing_keys'][:5]}, unexpected {report['unexpected_keys'][:5]}, "
                    f"mismatched {report['mismatched_keys'][:5]}."
                )
            if not report["finite_logits"]:
                problems.append("a forward pass gives non-finite logits (NaN/inf in the weights?).")
            if report.get("tokenizer_roundtrip") is False:
                problems.append("the tokenizer loads but encodes text to nothing.")
    return problems


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    load_check: bool = True,
    timeout: str | float | None = None,
):
    """Validate ``folder``, then create ``repo_id`` (if needed) and upload the folder in one commit.

    Returns huggingface_hub's ``CommitInfo``. Raises ``PushValidationError`` (nothing uploaded) when the folder
    fails validation or the Hub rejects the card metadata, ``HubTimeoutError`` when the endpoint does not answer
    within ``timeout`` (see ``hub_timeouts``), ``NotTheHubError`` when something else answers in its place.
    """
    from huggingface_hub import constants

    check_repo_id(repo_id)
    hub_timeouts(timeout)  # a bad setting is refused before the slow checks
    if constants.is_offline_mode():
        raise PushRefusedError("HF_HUB_OFFLINE is set, so huggingface_hub makes no requests; unset it to push.")
    problems = validate_for_push(folder, load_check=load_check)
    if problems:
        raise PushValidationError(folder, problems)
    with hub_session(timeout):
        return _upload(folder, repo_id, private, revision, commit_message, token, endpoint)


def _upload(folder, repo_id, private, revision, commit_message, token, endpoint):
    """The requests of ``push_to_hub``, after validation (inside ``hub_session``)."""
    from huggingface_hub import HfApi, constants

    api = HfApi(endpoint=endpoint, token=token)
    validate_yaml = getattr(api, "_validate_yaml", None)  # the Hub's own metadata check, before the repo exists
    if validate_yaml is not None:
        try:
            validate_yaml((Path(folder) / "README.md").read_text(encoding="utf-8"), repo_type="model", token=token)
        except NotTheHubError:
            raise
        except ValueError as error:
            raise PushValidationError(folder, [f"the Hub rejects the README.md metadata: {error}"]) from error
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision and revision != constants.DEFAULT_REVISION:
        api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        revision=revision,
        commit_message=commit_message or f"Upload QK-MAP model with qkmap-hf {__version__}",
        ignore_patterns=list(IGNORE_PATTERNS),
    )


__all__ = [
    "HubTimeoutError",
    "NotTheHubError",
    "PushValidationError",
    "check_repo_id",
    "clean_load_check",
    "files_to_upload",
    "hub_session",
    "hub_timeouts",
    "push_to_hub",
    "validate_for_push",
]
