"""Shared test helpers: tiny configs and a clean interpreter in which qkmap_hf cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# Prepended to code run by `run_clean_python`: any import of qkmap_hf fails, as on a machine without it.
_BLOCK_QKMAP_HF = textwrap.dedent(
    """
    import sys
    class _BlockQKMapHF:
        def find_spec(self, name, path=None, target=None):
            if name == "qkmap_hf" or name.startswith("qkmap_hf."):
                raise ImportError("qkmap_hf is blocked in this interpreter")
            return None
    sys.meta_path.insert(0, _BlockQKMapHF())
    try:
        import qkmap_hf  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("qkmap_hf was importable")
    """
)


def tiny_config_kwargs(**overrides) -> dict:
    return {**TINY, **overrides}


def run_clean_python(code: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter where ``import qkmap_hf`` fails; return the JSON it prints last.

    The code must print one JSON object as its last stdout line.
    """
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_QKMAP_HF + textwrap.dedent(code)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(f"clean interpreter failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
