"""The declared transformers range: the oldest supported 5.x runs the core checks too.

The newest release is what the rest of the suite runs on. The oldest is installed once per machine
into the qkmap_hf cache (from PyPI, the only registry these machines reach) and put first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from qkmap_hf.assets import cache_dir

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
OLDEST = "5.5.0"


def test_declared_range_matches_what_is_tested():
    text = PYPROJECT.read_text()
    assert f'"transformers>={OLDEST[:-2]},<6"' in text
    assert Version(transformers.__version__) >= Version(OLDEST)


def pinned_requirement(site: Path, package: str) -> str:
    """The requirement for ``package`` that the transformers installed in ``site`` declares for itself."""
    table = (site / "transformers" / "dependency_versions_table.py").read_text()
    match = re.search(rf'"{re.escape(package)}": "([^"]+)"', table)
    assert match, f"{site}/transformers/dependency_versions_table.py names no {package} requirement"
    return match.group(1)


def pip_install_into(target: Path, *requirements: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "--upgrade"]
    subprocess.run([*command, *requirements], check=True)


def oldest_transformers_site() -> Path:
    """transformers OLDEST with the kernels release it pins: the newest kernels (which the main site holds for the
    newest transformers) refuses the Hub kernel table of older releases at import."""
    target = cache_dir() / f"transformers-{OLDEST}-site"
    if not all((target / package / "__init__.py").exists() for package in ("transformers", "kernels")):
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        pip_install_into(staging, f"transformers=={OLDEST}", "huggingface-hub>=1.5,<2")
        pip_install_into(staging, "--no-deps", pinned_requirement(staging, "kernels"))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


@pytest.mark.slow
def test_oldest_supported_transformers_passes_the_core_checks(tmp_path):
    site = oldest_transformers_site()
    repository = Path(__file__).resolve().parents[2]
    # The checkout itself goes on the path too: the check needs this qkmap_hf whether or not it is installed.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(repository)]),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compat_check.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=repository,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["transformers"] == OLDEST
    assert report["standard_vs_llama"] <= 1e-5
    for mode in ("standard", "qk_norm", "qk_map"):
        assert report[f"{mode}_cache_equal"], mode
        assert report[f"{mode}_reload_diff"] <= 1e-5, mode
        assert report[f"{mode}_attentions"] == 2, mode
