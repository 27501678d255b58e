"""gate.train.evaluation's pure parts, without a model: the truth read from rendered rows, the held-out metrics from
given scores or parsed outputs, and the threshold sweep (its ends included)."""

import numpy as np
import pytest

from gate.train import evaluation
from gate.train.evaluation import sweep, true_labels, write_sweep
from gate.train.render import render_rows
from gate.variants import spec


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
    assert len(rows) == 42 and rows[20]["threshold"] == pytest.approx(3.0 if name == "skb" else 0.5)  # its scale
    lines = (tmp_path / "sweep.csv").read_text().splitlines()
    assert lines[0] == "threshold,positive_ratio,accuracy" and len(lines) == len(rows) + 1
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "variant,labels,kw,truth,values",
    [
        ("hkb", [True, False], {}, [True, False], None),
        ("kbm-acc", [True, False], {}, [True, False], None),  # unknown (search) first
        ("hkb", [True, False], {"verbalisers": ["yes", "no"]}, [True, False], None),
        ("skb", [3.0, 3.5, 5.0, 1.0], {}, [False, True, True, False], [3.0, 3.5, 5.0, 1.0]),  # the score, > t
        ("skb", [2.6], {"skb_target": "round"}, [False], [2.6]),
    ],
)
def test_true_labels(variant, labels, kw, truth, values):
    s = spec(variant, kw.get("verbalisers"))
    got, scores = true_labels(s, rows_of(variant, labels, **kw), 3.0 if variant == "skb" else 0.5)
    assert got.tolist() == truth
    assert scores is None if values is None else scores.tolist() == pytest.approx(values)


def test_skb_rows_without_a_target_are_read_by_their_digit():
    rows = [{**r, "completion": [{"role": "assistant", "content": d}]} for r, d in zip(rows_of("skb", [1, 1]), "45")]
    rows = [{k: v for k, v in r.items() if k != "target"} for r in rows]
    truth, values = true_labels(spec("skb"), rows, 4.0)
    assert truth.tolist() == [False, True] and values.tolist() == [4.0, 5.0]


def test_the_inspectors_truth_is_pass():
    recs = [
        {"id": f"q{i}", "question": "Q?", "image_path": "/x.png", "context": "c", "inspector": label}
        for i, label in enumerate([{"pass": "true"}, {"pass": "false", "answer": "caves"}])
    ]
    truth, values = true_labels(spec("inspector"), render_rows("inspector", recs), 0.5)
    assert truth.tolist() == [True, False] and values is None


def images(tmp_path, rows):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "x.png")
    return [{**r, "image": str(tmp_path / "x.png")} for r in rows]


@pytest.mark.parametrize(
    "variant,labels,scores,threshold,expected",
    [
        # truth T T T F; decisions (≥ 0.5) T T F F: accuracy 3/4, recalls 2/3 and 1
        (
            "hkb",
            [True, True, True, False],
            [0.9, 0.5, 0.2, 0.1],
            None,
            {"accuracy": 0.75, "balanced_accuracy": 5 / 6, "majority_baseline": 0.75, "predicted_positive_ratio": 0.5},
        ),
        (
            "hkb",
            [False, False, True],
            [0.9, 0.5, 0.2],
            0.6,
            {
                "accuracy": 1 / 3,
                "balanced_accuracy": 0.25,
                "majority_baseline": 2 / 3,
                "predicted_positive_ratio": 1 / 3,
            },
        ),
        ("hkb", [True, True], [0.9, 0.1], None, {"accuracy": 0.5, "balanced_accuracy": 0.5, "majority_baseline": 1.0}),
        # skb: truth target > 3 (F T T), decisions expected digit ≥ 3 (T F F); MAE |3−3| |2.5−4| |2−5|
        ("skb", [3.0, 4.0, 5.0], [3.0, 2.5, 2.0], None, {"accuracy": 0.0, "mae": 1.5, "true_positive_ratio": 2 / 3}),
    ],
)
def test_held_out_metrics_from_the_gates_scores(variant, labels, scores, threshold, expected, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        evaluation, "first_token_scores", lambda m, p, s, imgs, *a: seen.append(len(imgs)) or np.asarray(scores)
    )
    rows = images(tmp_path, rows_of(variant, labels, skb_target="round"))
    out = evaluation.evaluate_gate(None, None, spec(variant), rows, threshold)
    assert seen == [len(rows)] and out["n"] == len(rows) and out["variant"] == variant
    assert out["threshold"] == (threshold if threshold is not None else 3.0 if variant == "skb" else 0.5)
    assert {k: out[k] for k in expected} == pytest.approx(expected)
    assert out["scores"] == pytest.approx(scores)
    assert ("mae" in out) == (variant == "skb")


@pytest.mark.parametrize(
    "variant,targets,got,expected,by_class",
    [
        ("answer", ["The Caves", "reef"], ["caves", "coral"], {"accuracy": 0.5, "parsed": 1.0}, {"t0": 1.0, "t1": 0.0}),
        (
            "mct",
            [{"consistent": [2, 1], "summary": "a"}, {"consistent": [1, 3]}, {"consistent": [1, 2]}],
            [{"consistent": [2, 1], "summary": "other words"}, {"consistent": [3, 1], "summary": None}, None],
            {"accuracy": 1 / 3, "parsed": 2 / 3},  # the documents in order; the summary is not compared
            {"2 consistent": 1 / 3},
        ),
    ],
)
def test_held_out_accuracy_of_generated_outputs(variant, targets, got, expected, by_class, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluation, "generate_parsed", lambda *a, **k: got)
    recs = [
        {
            "id": f"q{i}",
            "question": "Q?",
            "image_path": "/x.png",
            "context": "c",
            **({"answers": [t]} if variant == "answer" else t),
            "question_type": f"t{i % 2}",
        }
        for i, t in enumerate(targets)
    ]
    rows = images(tmp_path, render_rows(variant, recs))
    out = evaluation.evaluate_generated(None, None, spec(variant), rows)
    assert {k: out[k] for k in expected} == pytest.approx(expected) and out["n"] == len(recs)
    assert out["accuracy_by_class"] == pytest.approx(by_class)


def test_generated_outputs_are_scored_against_targets_the_gate_can_read(tmp_path, monkeypatch):
    """mct rows of another variant parsed to None and counted as misses: accuracy 0 with no word."""
    monkeypatch.setattr(evaluation, "generate_parsed", lambda *a, **k: pytest.fail("generated"))
    rows = images(tmp_path, rows_of("hkb", [True]))
    with pytest.raises(ValueError, match=r"1 of 1 rows have a completion the mct gate cannot read \(its JSON\)"):
        evaluation.evaluate_generated(None, None, spec("mct"), rows)


@pytest.mark.parametrize(
    "variant,threshold,said",
    [
        ("skb", 0.5, r"--threshold 0.5 is off the skb gate's scale \[1, 5\]"),  # γ's default: accuracy 1.0 before
        ("hkb", 3.0, r"--threshold 3 is off the hkb gate's scale \[0, 1\]"),  # skb's t: every example negative
        ("inspector", -0.1, r"--threshold -0.1 is off the inspector gate's scale \[0, 1\]"),
    ],
)
def test_a_threshold_off_the_gates_scale_is_refused_before_the_gate_loads(
    variant, threshold, said, tmp_path, monkeypatch
):
    """An skb gate scored with --threshold 0.5 (the binary gates' γ) called every example "search" against a truth
    of target > 0.5, every example too: accuracy, balanced accuracy and the majority baseline all 1.0."""
    import json

    from common.files import write_jsonl_atomic

    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "gate.json").write_text(json.dumps({"variant": variant}))
    write_jsonl_atomic(tmp_path / "rows.jsonl", images(tmp_path, rows_of("hkb", [True])))
    monkeypatch.setattr(evaluation, "load_gate", lambda *a, **k: pytest.fail("the gate was loaded"))
    args = evaluation.ScoringArgs(model=str(gate), data=str(tmp_path / "rows.jsonl"), out=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=said):
        evaluation.score_file(evaluation.ScoringArgs(**{**vars(args), "threshold": threshold}))
    with pytest.raises(ValueError, match=said):
        evaluation.evaluate_gate(None, None, spec(variant), [], threshold)
