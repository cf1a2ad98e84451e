"""The package's layers, read from its imports (every ``import``, lazy and ``TYPE_CHECKING`` ones included):
no module reaches itself again, conversion imports neither the verifier nor the card writer, and each concept of
docs/architecture.md ("Layers and owners") is defined in its one owner."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "qkmap_hf"


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


MODULES = _module_files()


def _parents(name: str) -> list[str]:
    """The packages Python initialises before ``name`` (``qkmap_hf.a.b`` -> ``qkmap_hf.a``), the root left out: it
    only registers the model classes and hands names on lazily, and every module would otherwise reach it."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(encoding="utf-8"))


def _import_targets(name: str) -> list[tuple[int, list[str]]]:
    """``(line, modules)`` of each import in ``name`` that names this package (relative ones resolved)."""
    package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[: len(package) - node.level + 1]
                base = ".".join([*prefix, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        targets = [t for t in targets if t == "qkmap_hf" or t.startswith("qkmap_hf.")]
        if targets:
            found.append((node.lineno, targets))
    return found


@cache
def imports_of(name: str) -> frozenset[str]:
    """The package modules that importing ``name`` runs directly: what it imports, and their parent packages."""
    found: set[str] = set()
    for _, targets in _import_targets(name):
        for target in targets:
            if target in MODULES and target != name:
                found.add(target)  # and the packages above it, except those already initialising around ``name``
                found.update(p for p in _parents(target) if name != p and not name.startswith(p + "."))
    return frozenset(found)


def reach(name: str, *, packages: bool = True) -> set[str]:
    """Every package module that importing ``name`` may run (lazy imports included); with ``packages`` also what
    the packages around it run first."""
    seen: set[str] = set()
    todo = [name, *(_parents(name) if packages else [])]
    while todo:
        for target in imports_of(todo.pop()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _in(prefix: str, modules: set[str]) -> set[str]:
    return {m for m in modules if m == prefix or m.startswith(prefix + ".")}


def test_the_import_walk_sees_the_package():
    assert {"qkmap_hf.loading", "qkmap_hf.packaging", "qkmap_hf.surgery.input_norm"} <= set(MODULES)
    assert "qkmap_hf.loading" in reach("qkmap_hf.conversion.api")
    assert "qkmap_hf.surgery" in imports_of("qkmap_hf.training.schedules")  # a module runs its package first


def test_every_import_of_the_package_names_a_module_of_it():
    """A lazy import of a module that moved fails only when its branch runs; here it fails at once."""
    stale = [
        f"{MODULES[name].relative_to(PACKAGE.parent)}:{line}: {target}"
        for name in MODULES
        for line, targets in _import_targets(name)
        for target in targets
        if target not in MODULES
    ]
    assert not stale, "imports of modules that do not exist:\n" + "\n".join(stale)


def test_no_import_cycle():
    """No module reaches itself: each layer can be read, tested and changed without the ones above it."""
    cycles = sorted(name for name in MODULES if name != "qkmap_hf" and name in reach(name, packages=False))
    assert not cycles, f"modules that import themselves through others: {cycles}"


@pytest.mark.parametrize(
    ("layer", "never"),
    [
        ("qkmap_hf.conversion", ["qkmap_hf.verify", "qkmap_hf.cards", "qkmap_hf.packaging", "qkmap_hf.training"]),
        ("qkmap_hf.loading", ["qkmap_hf.conversion", "qkmap_hf.training", "qkmap_hf.verify", "qkmap_hf.hub"]),
        ("qkmap_hf.surgery", ["qkmap_hf.conversion", "qkmap_hf.training", "qkmap_hf.verify", "qkmap_hf.cards"]),
        ("qkmap_hf.assets", ["qkmap_hf.conversion", "qkmap_hf.training"]),
        ("qkmap_hf.verify", ["qkmap_hf.conversion", "qkmap_hf.packaging", "qkmap_hf.cards"]),
        (
            "qkmap_hf.diagnostics",
            ["qkmap_hf.analysis", "qkmap_hf.attention_probes", "qkmap_hf.tasks", "qkmap_hf.training", "qkmap_hf.cards"],
        ),
        ("qkmap_hf.monitoring", ["qkmap_hf.analysis", "qkmap_hf.training", "qkmap_hf.tasks"]),
    ],
)
def test_a_layer_does_not_reach_the_layers_above_it(layer, never):
    reached = set().union(*(reach(m) for m in _in(layer, set(MODULES))))
    found = sorted(set().union(*(_in(other, reached) for other in never)))
    assert not found, f"{layer} imports {found}"


def _definers(name: str) -> list[str]:
    return sorted(
        module
        for module in MODULES
        for node in tree(module).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
    )


@pytest.mark.parametrize(
    ("name", "owner"),
    [
        ("resolve_source", "qkmap_hf.loading"),
        ("load_gguf_causal_lm", "qkmap_hf.loading"),
        ("load_causal_lm", "qkmap_hf.loading"),
        ("refuse_pickle_only", "qkmap_hf.loading"),
        ("is_repo_id", "qkmap_hf.loading"),
        ("ConversionError", "qkmap_hf.errors"),
        ("convert_checkpoint", "qkmap_hf.packaging"),
        ("package_conversion", "qkmap_hf.packaging"),
        ("verify_conversion", "qkmap_hf.verify"),
        ("write_model_card", "qkmap_hf.cards"),
        ("fold_input_norm", "qkmap_hf.surgery.input_norm"),
        ("save_qk_norm_as_qwen3", "qkmap_hf.surgery.export_qwen3"),
        ("atomic_directory", "qkmap_hf.fileio"),
        ("check_destination", "qkmap_hf.safety"),
        ("find_pickles", "qkmap_hf.safety"),
        ("log2_lift", "qkmap_hf.attention_measures"),
        ("prompt_contrast", "qkmap_hf.diagnostics.contrast"),
        ("PhaseRecorder", "qkmap_hf.phases"),
        ("PhaseStatistics", "qkmap_hf.diagnostics.phases"),
        ("ModelDiagnostics", "qkmap_hf.diagnostics"),
        ("AttentionLayer", "qkmap_hf.diagnostics.hooks"),
        ("load_fused_kernel", "qkmap_hf.kernels"),
        ("FusedOps", "qkmap_hf.modeling.feature_map_qkmap"),
    ],
)
def test_each_concept_is_defined_once_in_its_owner(name, owner):
    assert _definers(name) == [owner]


def _calls(attribute: str) -> list[tuple[str, ast.Call]]:
    return [
        (module, node)
        for module in MODULES
        for node in ast.walk(tree(module))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == attribute or getattr(node.func, "id", None) == attribute)
    ]


def test_gguf_files_hub_snapshots_and_repo_ids_are_read_in_one_place():
    """GGUF checkpoints load, the local Hub cache is read and repo ids are validated in qkmap_hf.loading alone (the
    push target's check, ``hub.check_repo_id``, is the one other caller of huggingface_hub's validator)."""
    gguf = {m for m, call in _calls("from_pretrained") if any(k.arg == "gguf_file" for k in call.keywords)}
    assert gguf == {"qkmap_hf.loading"}
    assert {m for m, _ in _calls("snapshot_download")} == {"qkmap_hf.loading"}
    assert {m for m, _ in _calls("validate_repo_id")} == {"qkmap_hf.loading", "qkmap_hf.hub"}
