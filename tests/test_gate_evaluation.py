"""gate.train.evaluation's pure parts, without a model: the truth read from rendered rows, the held-out metrics from
given scores or parsed outputs, and the threshold sweep (its ends included)."""

import numpy as np
import pytest

from gate.train.evaluation import sweep, write_sweep
from gate.train.render import render_rows


def rows_of(variant, labels, **kw):
    key = {"skb": "search_score", "srt": "relevant"}.get(variant, "search")
    recs = [
        {"id": f"q{i}", "question": "Where?", "image_path": "/x.png", key: v, "context": "a section"}
        for i, v in enumerate(labels)
    ]
    return render_rows(variant, recs, **kw)


@pytest.mark.parametrize(
    "scores,labels,thresholds,expected",
    [
        # (threshold, positive ratio, accuracy): positive when the score reaches the threshold
        (
            [0.2, 0.5, 0.9],
            [False, True, True],
            [0.0, 0.5, 0.6, 1.0],
            [(0, 1, 2 / 3), (0.5, 2 / 3, 1), (0.6, 1 / 3, 2 / 3), (1, 0, 1 / 3)],
        ),
        ([1.0, 1.0], [True, False], [1.0], [(1.0, 1.0, 0.5)]),
        ([], [], [0.5], [(0.5, 0.0, 0.0)]),
    ],
)
def test_sweep(scores, labels, thresholds, expected):
    got = [(r["threshold"], r["positive_ratio"], r["accuracy"]) for r in sweep(scores, labels, thresholds)]
    assert np.asarray(got) == pytest.approx(np.asarray(expected, dtype=float))


@pytest.mark.parametrize(
    "name,scores",
    [
        ("hkb", [1.0, 1.0, 0.0, 0.3]),  # a float32 softmax gives 1.0 (and 0.0) exactly
        ("skb", [np.float32(0.99999994), 5.0, 3.2]),  # skb's digit probabilities summing to just under 1
        ("skb", [1.0, 1.0]),
    ],
)
def test_the_sweep_runs_from_every_example_positive_to_none(name, scores, tmp_path):
    """The grid was 0–1 (skb's 1–5) fixed: a gate scoring 1.0 exactly was positive at every threshold, and an skb
    expected digit just under 1 negative at every one, so sweep.csv and its plot missed one end of the curve."""
    rows = write_sweep(tmp_path, scores, [True] * len(scores), name)
    assert rows[0]["positive_ratio"] == 1.0 and rows[-1]["positive_ratio"] == 0.0
    lines = (tmp_path / "sweep.csv").read_text().splitlines()
    assert lines[0] == "threshold,positive_ratio,accuracy" and len(lines) == len(rows) + 1
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
