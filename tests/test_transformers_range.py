"""The declared transformers range: the oldest supported 5.x runs the core checks too.

The newest release is what the rest of the suite runs on. The oldest is installed once per machine
into the qkmap_hf cache (from PyPI, the only registry these machines reach) and put first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from qkmap_hf.assets import cache_dir

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
OLDEST = "5.5.0"


def test_declared_range_matches_what_is_tested():
    text = PYPROJECT.read_text()
    assert f'"transformers>={OLDEST[:-2]},<6"' in text
    assert Version(transformers.__version__) >= Version(OLDEST)


def oldest_transformers_site() -> Path:
    target = cache_dir() / f"transformers-{OLDEST}-site"
    if not (target / "transformers" / "__init__.py").exists():
        staging = target.with_name(target.name + ".partial")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--target",
                str(staging),
                "--upgrade",
                f"transformers=={OLDEST}",
                "huggingface-hub>=1.5,<2",
            ],
            check=True,
        )
        staging.rename(target)
    return target


@pytest.mark.slow
def test_oldest_supported_transformers_passes_the_core_checks(tmp_path):
    site = oldest_transformers_site()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compat_check.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["transformers"] == OLDEST
    assert report["standard_vs_llama"] <= 1e-5
    for mode in ("standard", "qk_norm", "qk_map"):
        assert report[f"{mode}_cache_equal"], mode
        assert report[f"{mode}_reload_diff"] <= 1e-5, mode
        assert report[f"{mode}_attentions"] == 2, mode
