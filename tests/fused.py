"""The fused CPU kernels' shared test fixtures (a pytest plugin: tests/conftest.py loads it): the kernels built
and loaded once per session, and a record of which of their ops a test's model called."""

from __future__ import annotations

import pytest

from qkmap_hf.kernels import load_fused_kernel
from qkmap_hf.modeling import attention_qkmap, feature_map_qkmap


@pytest.fixture(scope="session")
def fused_kernel():
    """The fused kernel registered in this process: built once per machine (seconds), then loaded from the cache. A
    machine that cannot build it fails here, naming why: the product's default path is not skipped."""
    status = load_fused_kernel(build=True)
    assert status.loaded, status.reason
    return status


class RecordingOps:
    """``torch.ops.qkmap_v1`` that records the name of each op called, then runs it."""

    def __init__(self, ops, calls: list[str]):
        self.ops, self.calls = ops, calls

    def __getattr__(self, name: str):
        op = getattr(self.ops, name)

        def call(*args):
            self.calls.append(name)
            return op(*args)

        return call


def record_calls(monkeypatch, module, lookup: str) -> list[str]:
    """Replace ``module.<lookup>`` (a ``FusedOps``, which the model files call at every use) by one returning
    ``RecordingOps``; returns the list it records into."""
    calls: list[str] = []
    ops = getattr(module, lookup)()
    monkeypatch.setattr(module, lookup, lambda: RecordingOps(ops, calls))
    return calls


@pytest.fixture
def fused_calls(fused_kernel, monkeypatch):
    """The names of the fused ops the test's feature maps call, in order."""
    return record_calls(monkeypatch, feature_map_qkmap, "FUSED_OPS")


@pytest.fixture
def fused_attention_calls(fused_kernel, monkeypatch):
    """The names of the fused attention ops the test's models call, in order."""
    return record_calls(monkeypatch, attention_qkmap, "FUSED_ATTENTION_OPS")
