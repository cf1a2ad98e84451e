"""The cache root is never the working folder: an empty or relative ``QKMAP_HF_CACHE`` is refused in one line, and
``import qkmap_hf`` then loads no kernel library (from the working folder or anywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qkmap_hf.assets import CACHE_ENV, cache_root


@pytest.mark.parametrize("value", ["", "  ", "cache", "./kernels-here"])
def test_an_empty_or_relative_cache_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv(CACHE_ENV, value)
    with pytest.raises(ValueError, match="must be an absolute path") as refused:
        cache_root()
    assert "\n" not in str(refused.value) and CACHE_ENV in str(refused.value)


def test_an_absolute_cache_and_the_default_are_taken(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root().is_absolute()


@pytest.mark.slow
def test_import_with_an_empty_cache_loads_nothing_and_says_why(tmp_path):
    """A library planted where an empty cache would point (the working folder) is never loaded."""
    from qkmap_hf.kernels import kernel_path

    planted = tmp_path / "kernels" / kernel_path().name
    planted.parent.mkdir()
    planted.write_bytes(b"not a library: loading it would fail loudly")
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import qkmap_hf\n"
        "    from qkmap_hf.kernels import fused_kernel_loaded, load_fused_kernel\n"
        "    status = load_fused_kernel()\n"
        "print(json.dumps([fused_kernel_loaded(), status.reason, [str(w.message) for w in caught]]))\n"
    )
    env = {**os.environ, CACHE_ENV: ""}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded, reason, warned = json.loads(done.stdout.strip().splitlines()[-1])
    assert not loaded and "must be an absolute path" in reason
    assert any(CACHE_ENV in message for message in warned)
