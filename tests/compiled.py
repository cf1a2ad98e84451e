"""The compiled feature map's shared test fixture (a pytest plugin: tests/conftest.py loads it): fresh compiled
expressions per test, and a record of which expressions the compiled version answered."""

from __future__ import annotations

import pytest
import torch

from qkmap_hf.modeling import feature_map_qkmap
from qkmap_hf.modeling.feature_map_qkmap import CompiledExpression

COMPILED = (
    "COMPILED_FEATURES",
    "COMPILED_GRADIENTS",
    "COMPILED_QUERY_KEY_FEATURES",
    "COMPILED_QUERY_KEY_GRADIENTS",
)


@pytest.fixture
def compiled_calls(monkeypatch):
    """Fresh compiled expressions (no compile or failure left by another test), each call's expression name recorded
    when the compiled version answered (not None: no eager fall-back)."""
    torch._dynamo.reset()
    calls: list[str] = []
    for name in COMPILED:
        fresh = CompiledExpression(getattr(feature_map_qkmap, name).expression)
        monkeypatch.setattr(feature_map_qkmap, name, fresh)
    answer = CompiledExpression.__call__

    def recording(self, *args):
        result = answer(self, *args)
        if result is not None:
            calls.append(self.expression.__name__)
        return result

    monkeypatch.setattr(CompiledExpression, "__call__", recording)
    yield calls
    torch._dynamo.reset()
