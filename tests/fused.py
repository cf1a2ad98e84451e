"""The fused CPU feature map's shared test fixtures (a pytest plugin: tests/conftest.py loads it): the kernel built
and loaded once per session, and a record of which of its ops a test's model called."""

from __future__ import annotations

import pytest

from qkmap_hf.kernels import load_fused_kernel
from qkmap_hf.modeling import feature_map_qkmap


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


@pytest.fixture
def fused_calls(fused_kernel, monkeypatch):
    """The names of the fused ops the test's feature maps call, in order."""
    calls: list[str] = []
    ops = feature_map_qkmap.FUSED_OPS()
    monkeypatch.setattr(feature_map_qkmap, "FUSED_OPS", lambda: RecordingOps(ops, calls))
    return calls
