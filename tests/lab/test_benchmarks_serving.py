"""benchmarks/serving.py's profile table (issue 20): where a model's extra serving time goes, op by op."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serving import profile_table  # noqa: E402


def test_profile_table_ranks_ops_by_their_largest_time_and_differences_them_against_llama():
    self_ms = {
        "llama": {"onednn_mm": 906.0, "attention": 414.0, "graph": 140.0, "view": 4.0},
        "qkmap-wide": {"onednn_mm": 976.0, "attention": 790.0, "graph": 291.0, "view": 5.0},
        "qkmap-compact": {"onednn_mm": 893.0, "attention": 437.0, "graph": 189.0},
    }
    lines = profile_table(self_ms, top=3).splitlines()
    assert lines[0] == "| op | llama ms | qkmap-wide ms | qkmap-compact ms |"
    assert [line.split("|")[1].strip() for line in lines[2:5]] == ["`onednn_mm`", "`attention`", "`graph`"]
    assert lines[3] == "| `attention` | 414.0 | 790.0 (+376.0) | 437.0 (+23.0) |"
    # the total counts every op, also those below the top rows and those a model lacks (compact has no view)
    assert lines[5] == "| all ops | 1464.0 | 2062.0 (+598.0) | 1519.0 (+55.0) |"


def test_pyspy_share_counts_each_stack_once_per_name_at_the_sampling_rate():
    from pyspy_share import seconds_under

    lines = [
        "main (a.py:1);forward (m.py:2);repeat_kv (m.py:9);repeat_kv (m.py:9) 100",  # recursion counts once
        "main (a.py:1);Linear.forward (l.py:3) 50",
        "main (a.py:1);thread (t.py:1) 25",
    ]
    seconds = seconds_under(lines, ["repeat_kv", "Linear.forward", "absent"], rate=50.0)
    assert seconds == {"all samples": 3.5, "repeat_kv": 2.0, "Linear.forward": 1.0, "absent": 0.0}
