"""Run Python in a fresh interpreter where ``qkmap_hf`` cannot be imported: what a downloader without it sees.

Used wherever the product promises that a checkpoint works without the package: the push validation, the
demo's last step and the tests. The interpreter runs offline, in a scratch folder, with its own modules
cache, so it executes the modeling files copied into the checkpoint and nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

BLOCK_QKMAP_HF = textwrap.dedent(
    """
    import sys as _sys
    class _BlockQKMapHF:
        def find_spec(self, name, path=None, target=None):
            if name == "qkmap_hf" or name.startswith("qkmap_hf."):
                raise ImportError("qkmap_hf is not installed for whoever downloads this model")
            return None
    _sys.meta_path.insert(0, _BlockQKMapHF())
    try:
        import qkmap_hf  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("qkmap_hf was importable in the clean interpreter")
    """
)


def run_without_qkmap_hf(
    code: str,
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``args`` in ``sys.argv[1:]``); return the finished process with its captured output."""
    with tempfile.TemporaryDirectory(prefix="qkmap-cleanroom-") as scratch:
        full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        full_env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "HF_MODULES_CACHE": str(Path(scratch) / "modules"),
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-c", BLOCK_QKMAP_HF + textwrap.dedent(code), *map(str, args)],
            cwd=cwd or scratch,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,  # nobody answers a prompt (transformers' remote-code question) here
        )
