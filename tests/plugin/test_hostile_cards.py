"""Hostile card inputs: names, descriptions and records (from flags, folder names and files) are escaped for
Markdown and HTML, the code snippets quote safely, and only README.md changes."""

from __future__ import annotations

import ast
import json
import re

import pytest
from huggingface_hub import ModelCard

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.cards import code_text, fenced_json, markdown_text, repo_id_for_code
from tests.hostile import run_cli, tree_digest
from tests.utils import tiny_config_kwargs

SCRIPT = "<script>alert(1)</script>"
BREAKOUT = 'x"; import os; os.system("rm -rf ~") #`'


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-cards") / "tiny"
    QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs())).save_pretrained(folder)
    return folder


def _card(capsys, tmp_path, pristine, folder_name: str, *extra: str) -> tuple[str, dict, dict]:
    import shutil

    folder = shutil.copytree(pristine, tmp_path / folder_name)
    record = {
        "kind": "notes",
        "source": f"{SCRIPT} | not a cell",
        "description": "```\n# Injected heading\n[click](javascript:alert(1)) **bold** ~~gone~~",
    }
    (tmp_path / "record.json").write_text(json.dumps(record))
    results = {
        "results": {"evil": {"alias": f"<b>evil</b>|{SCRIPT}", "acc,none": 0.5, "acc_stderr,none": 0.01}},
        "lm_eval_version": "0.4.13 <i>x</i>",
    }
    (tmp_path / "results_evil.json").write_text(json.dumps(results))
    (tmp_path / "secret.txt").write_text("outside every folder")
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "card", folder, "--provenance", tmp_path / "record.json", "--eval-results",
                           tmp_path / "results_evil.json", *extra)  # fmt: skip
    assert code == 0, err
    after = tree_digest(tmp_path)
    changed = {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}
    assert changed == {str(folder / "README.md")}
    return (folder / "README.md").read_text(), record, results


def test_names_descriptions_and_records_are_escaped(pristine, tmp_path, capsys):
    text, record, _ = _card(capsys, tmp_path, pristine, "tiny", "--name", f"{SCRIPT} **name**")
    body = text.split("\n---\n", 1)[1]
    fence = re.search(r"```json\n(.*?)\n```", body, re.S)
    assert json.loads(fence.group(1)) == record  # the record block still holds the record, and only it
    outside_fence = body.replace(fence.group(0), "")
    assert "<script>" not in outside_fence and "<b>" not in outside_fence and "<i>" not in outside_fence
    assert "# &lt;script&gt;alert(1)&lt;/script&gt; \\*\\*name\\*\\*" in body
    assert not any(line.startswith(("# Injected", "```# ")) for line in body.splitlines())
    assert "\\`\\`\\` # Injected heading" in outside_fence  # one line of text: no fence, no heading
    assert "\\[click\\](javascript:alert(1))" in body
    row = next(line for line in body.splitlines() if "&lt;b&gt;evil" in line)
    assert row.count("|") - row.count("\\|") == 6  # five cells: the alias's "|" stays inside its cell
    ModelCard(text, ignore_metadata_errors=False)


def test_code_snippets_quote_safely(pristine, tmp_path, capsys):
    text, _, _ = _card(capsys, tmp_path, pristine, BREAKOUT.replace("/", "_").replace("~", "home"))
    code = re.search(r"```python\n(.*?)\n```", text, re.S).group(1)
    tree = ast.parse(code)
    repo = next(node.value.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "repo")
    assert re.fullmatch(r"your-org/[A-Za-z0-9._-]+", repo)
    assert f"`qkmap eval {repo} --tasks" in text
    assert "os.system" not in code.replace(repo, "")


def test_escaping_helpers():
    assert markdown_text("a\n# b | c") == "a # b \\| c"
    assert markdown_text("R&D <x>") == "R&amp;D &lt;x&gt;"
    assert code_text("a`b\nc") == "a'b c"
    assert "`" not in fenced_json({"x": "```"}) and json.loads(fenced_json({"x": "```"})) == {"x": "```"}
    assert repo_id_for_code("my model (v2)") == "my-model-v2" and repo_id_for_code("SmolLM2-135M") == "SmolLM2-135M"
