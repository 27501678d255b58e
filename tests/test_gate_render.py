"""Gate variants as data: completions and their parsing round-trip, rendering, class balance and caps, and the
labelled examples each variant draws from one question (pure functions)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gate.train.build_data import BuildDataArgs
from gate.train.labelling import label_records
from gate.train.render import cap_classes, class_balance, format_balance, hold_out, render_rows
from gate.variants import BINARY, VARIANTS, completion, messages, parse_completion, spec


@pytest.mark.parametrize(
    "variant,label,text",
    [
        ("hkb", True, "true"),
        ("hkb", False, "false"),
        ("kbm-acc", True, "unknown"),
        ("kbm-cert", False, "known"),
        ("ret", True, "Ret"),
        ("ret", False, "NoRet"),
        ("srt", True, "Rel"),
        ("srt", False, "NoRel"),
        ("skb", 4.6, "5"),
        ("skb", 1.0, "1"),
        ("skb", 2.4, "2"),
        ("skb", 2.5, "3"),  # halves up, whatever the digit (Python's round() takes 2.5 to 2 and 3.5 to 4)
        ("skb", 4.5, "5"),
        ("inspector", {"pass": "true"}, '{"pass": "true"}'),
        ("inspector", {"pass": "false", "answer": "salt marshes"}, '{"pass": "false", "answer": "salt marshes"}'),
        ("mct", [1, 3], '{"consistent": [1, 3]}'),
        ("answer", "mossy caves", "mossy caves"),
        ("mct", {"consistent": [2, 1], "summary": "Both: caves."}, '{"consistent": [2, 1], "summary": "Both: caves."}'),
        ("mct", {"consistent": [], "summary": None}, '{"consistent": []}'),
    ],
)
def test_completion(variant, label, text):
    assert completion(spec(variant), label) == text


@given(st.sampled_from(BINARY), st.booleans())
def test_binary_completion_parses_back(variant, label):
    s = spec(variant)
    parsed = parse_completion(
        s, completion(s, {"pass": "true" if label else "false", "answer": "x"} if variant == "inspector" else label)
    )
    assert (parsed["pass"] if variant == "inspector" else parsed) is label


@pytest.mark.parametrize(
    "variant,text,expected",
    [
        ("hkb", "  true ", True),
        ("hkb", "maybe", None),
        ("hkb", "", None),
        ("skb", "3.5 because", 3.5),
        ("skb", "seven", None),
        ("inspector", 'sure: {"pass": "false", "answer": 7}', {"pass": False, "answer": None}),
        ("inspector", '{"pass": "perhaps"}', None),
        ("inspector", "{broken", None),
        ("mct", '{"consistent": ["a"]}', None),
        ("mct", '{"consistent": [true]}', None),
        ("mct", '{"consistent": [2, 1], "summary": 3}', {"consistent": [2, 1], "summary": None}),
        ("mct", 'ok {"consistent": [3], "summary": "caves"}', {"consistent": [3], "summary": "caves"}),
        # a brace after the object (the greedy span from the first { to the last } was no JSON), a repeated reply
        ("inspector", '{"pass": "true"}\n}', {"pass": True, "answer": None}),
        (
            "inspector",
            '{"pass": "false", "answer": "Paris"}{"pass": "false", "answer": "Paris"}',
            {"pass": False, "answer": "Paris"},
        ),
        ("mct", '{"consistent": [2]} and {"consistent": [5]}', {"consistent": [2], "summary": None}),
        ("inspector", '{"pass": "false", "answer": ' + "[" * 5000 + "}", None),  # past the recursion limit: None
        ("mct", '{"consistent": ' + "[" * 5000, None),
    ],
)
def test_parse_completion_tables(variant, text, expected):
    assert parse_completion(spec(variant), text) == expected


@given(st.floats(1.0, 5.0))
def test_skb_with_its_own_verbalisers_parses_back(score):
    """skb's five verbalisers replaced (--verbalisers): a completion reads back as the word's place, 1–5, as the
    default digits read back as themselves; a word outside them is unreadable."""
    words = spec("skb", ["never", "rarely", "sometimes", "often", "always"])
    digit = float(completion(spec("skb"), score))
    assert parse_completion(words, completion(words, score)) == digit == parse_completion(spec("skb"), str(int(digit)))
    assert parse_completion(words, "3") is None and parse_completion(words, "often sure") == 4.0


@pytest.mark.parametrize(
    "variant,verbalisers",
    [
        ("hkb", ("search", "no search")),  # a multi-word verbaliser was read by its first word alone: None
        ("hkb", ("no search", "search")),
        ("kbm-acc", (" unknown", " known")),  # a tokenizer's word with its leading space
        ("srt", ("not relevant", "not relevant at all")),  # one a word-prefix of the other: the longest wins
        ("skb", ("very low", "low", "mid", "high", "very high")),
    ],
)
def test_verbalisers_of_several_words_or_with_spaces_parse_back(variant, verbalisers):
    s = spec(variant, verbalisers)
    labels = [1.0, 2.0, 3.0, 4.0, 5.0] if variant == "skb" else [True, False]
    for label in labels:
        assert parse_completion(s, completion(s, label)) == label
        assert parse_completion(s, completion(s, label) + " because the image shows it") == label
    assert parse_completion(s, "maybe") is None


def test_verbalisers_can_be_replaced_but_not_to_duplicates():
    assert completion(spec("hkb", ["Y", "N"]), True) == "Y"
    with pytest.raises(ValueError, match="distinct"):
        spec("hkb", ["Y", "Y"])
    with pytest.raises(ValueError, match="distinct once spaces are left aside"):
        spec("hkb", ["known", " known"])  # read back alike
    with pytest.raises(ValueError, match="non-space character"):
        spec("hkb", ["known", " "])
    with pytest.raises(ValueError, match="unknown gate variant"):
        spec("vibes")


def test_context_variants_need_a_context():
    with pytest.raises(ValueError, match="needs a context"):
        messages(spec("srt"), "Where?")
    user = messages(spec("inspector"), "Where?", "Holhol: lives in caves")[1]["content"]
    assert user == "Context: Holhol: lives in caves\nQuestion: Where?"
    block = messages(spec("hkb"), "Where?", with_image_block=True)[1]["content"]
    assert block[0] == {"type": "image"} and block[1]["text"] == "Where?"


def record(i, search, split="train"):
    return {"id": f"q{i}", "question": "Where?", "image_path": "/x.png", "search": search, "split": split}


def test_render_and_class_caps():
    recs = [record(i, i % 4 != 0) for i in range(20)]  # 15 search, 5 not
    rows = render_rows("hkb", recs)
    assert class_balance(rows) == {"false": 5, "true": 15}
    assert rows[0]["completion"] == [{"role": "assistant", "content": "false"}]
    assert rows[0]["prompt"][0]["content"] == VARIANTS["hkb"]["system"]
    balanced = render_rows("hkb", recs, balance=True, seed=1)
    assert class_balance(balanced) == {"false": 5, "true": 5}
    assert [r["id"] for r in balanced] == sorted((r["id"] for r in balanced), key=lambda x: int(x[1:]))  # order kept
    capped = cap_classes(rows, 3, False, seed=0)
    assert class_balance(capped) == {"false": 3, "true": 3}
    assert render_rows("hkb", recs, max_per_class=3, seed=0) != render_rows("hkb", recs, max_per_class=3, seed=5)


@pytest.mark.parametrize(
    "cap,balance,expected",
    [
        (None, False, {"false": 5, "true": 15}),
        (3, False, {"false": 3, "true": 3}),
        (10, True, {"false": 5, "true": 5}),
        (1, False, {"false": 1, "true": 1}),  # the smallest cap there is
        (0, False, "got 0"),  # emptied the data without a word
        (-2, False, "got -2"),  # took all but the last two of each class
        (True, False, "got True"),
        (2.5, False, "got 2.5"),  # a float cap was a TypeError from a slice
    ],
)
def test_max_per_class_caps_each_class_or_is_refused(cap, balance, expected):
    rows = render_rows("hkb", [record(i, i % 4 != 0) for i in range(20)])  # 15 search, 5 not
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=f"--max_per_class must be a positive integer .*{expected}"):
            cap_classes(rows, cap, balance, seed=0)
    else:
        assert class_balance(cap_classes(rows, cap, balance, seed=0)) == expected


def test_a_cap_below_one_is_refused_before_render_touches_the_folder(tmp_path):
    from common.files import write_jsonl_atomic
    from gate.train.build_data import build

    write_jsonl_atomic(tmp_path / "labels-hkb.jsonl", [record(i, i % 5 != 0, split="train") for i in range(10)])
    (tmp_path / "hkb.test.jsonl").write_text("an earlier render's held-out split\n")
    for cap in (0, -1):
        with pytest.raises(ValueError, match=f"--max_per_class must be a positive integer .*got {cap}"):
            build(BuildDataArgs(stage="render", out=str(tmp_path), variant="hkb", max_per_class=cap), log=print)
    assert (tmp_path / "hkb.test.jsonl").read_text() == "an earlier render's held-out split\n"
    assert not (tmp_path / "hkb.train.jsonl").exists()


ARGS = BuildDataArgs(epsilon=3.0, tau=0.9, correct_score=4.0, alone_rule="sampled-majority")  # rules from R samples
HITS = [
    {"entity_id": "E1", "title": "Holhol", "section_title": "Habitat", "text": "lives in caves"},
    {"entity_id": "E2", "title": "Kalo", "section_title": "Habitat", "text": "lives in reefs"},
]


def question(**kw):
    return {
        "id": "q",
        "question": "Where?",
        "answers": ["caves"],
        "entity_id": "E1",
        "samples": ["caves"] * 4,
        "scores": [5.0, 5.0, 5.0, 1.0],
        "hits": HITS,
        **kw,
    }


@pytest.mark.parametrize(
    "variant,rec,expected",
    [
        ("hkb", question(), {"search": False}),  # mean 4 ≥ ε: the model knows
        ("hkb", question(scores=[1.0, 1.0, 5.0, 1.0]), {"search": True}),
        ("skb", question(), {"search_score": 2.0}),
        ("kbm-acc", question(), {"search": True}),  # 3/4 correct < τ = 0.9
        ("kbm-acc", question(scores=[5.0] * 4), {"search": False}),
        ("ret", question(), {"search": False}),  # answered right alone: NoRet
        ("ret", question(scores=[1.0, 1.0, 5.0, 1.0]), {"search": True}),
        ("inspector", question(), {"pass": True}),
        ("inspector", question(entity_id="E2", answers=["reefs"]), {"pass": False}),
    ],
)
def test_label_records(variant, rec, expected):
    (got,) = label_records(variant, rec, ARGS)
    assert {k: got[k] for k in expected} == expected


def test_kbm_cert_needs_no_gold_answer_but_the_others_do():
    rec = question(answers=[], samples=["caves", "caves", "reef", "caves"])
    (got,) = label_records("kbm-cert", rec, ARGS)
    assert got["search"] is True and 0 < got["certainty"] < 1
    assert all(label_records(v, rec, ARGS) == [] for v in ("hkb", "skb", "kbm-acc", "ret", "inspector"))


def test_srt_keeps_only_documents_that_change_the_answer():
    contexts = {"q": {"doc_scores": [5.0, 1.0], "hits": HITS}}
    wrong_alone = question(scores=[1.0] * 4)
    assert [(r["id"], r["relevant"]) for r in label_records("srt", wrong_alone, ARGS, contexts)] == [("q#d1", True)]
    right_alone = question(scores=[5.0] * 4)
    assert [(r["id"], r["relevant"]) for r in label_records("srt", right_alone, ARGS, contexts)] == [("q#d2", False)]
    assert label_records("srt", right_alone, ARGS, {"q": {"doc_scores": [5.0, 5.0], "hits": HITS}}) == []


def test_inspector_answer_check():
    args = BuildDataArgs(inspector_check_answer=True, correct_score=4.0)
    ok, bad = {"q": {"doc_scores": [5.0, 1.0]}}, {"q": {"doc_scores": [2.0, 1.0]}}
    assert label_records("inspector", question(), args, ok)[0]["pass"] is True
    failed = label_records("inspector", question(), args, bad)[0]
    assert failed["pass"] is False and failed["inspector"] == {"pass": "false", "answer": "caves"}


def test_mct_gold_entity_rule_marks_the_gold_entitys_sections():
    args = BuildDataArgs(mct_rule="gold-entity")
    (got,) = label_records("mct", question(), args)
    assert (
        got["consistent"] == [1]
        and got["context"] == "[1] Holhol - Habitat: lives in caves\n[2] Kalo - Habitat: lives in reefs"
    )


HITS3 = HITS + [{"entity_id": "E3", "title": "Mirra", "section_title": "Habitat", "text": "lives in caves too"}]


def test_mct_srt_rule_follows_algorithm_3():
    args = BuildDataArgs(mct_negative_ratio=0.0)
    cons = {"q": {"rel_probs": [0.7, 0.2, 0.9], "summary": "Both say caves."}}
    (got,) = label_records("mct", question(hits=HITS3), args, cons)
    docs = [line.split("] ", 1)[1] for line in got["context"].split("\n")]
    assert sorted(docs) == [
        "Holhol - Habitat: lives in caves",
        "Mirra - Habitat: lives in caves too",
    ]  # no NoRel (τ = 0)
    # the most relevant first: Mirra (0.9), then Holhol (0.7), by their numbers in the order shown
    assert [docs[i - 1].split(" - ")[0] for i in got["consistent"]] == ["Mirra", "Holhol"]
    assert got["summary"] == "Both say caves."
    (all_in,) = label_records("mct", question(hits=HITS3), BuildDataArgs(mct_negative_ratio=1.0), cons)
    assert len(all_in["context"].split("\n")) == 3
    # one relevant document only, or no consistency record: not an MCT example
    assert label_records("mct", question(hits=HITS3), args, {"q": {"rel_probs": [0.7, 0.2, 0.1]}}) == []
    assert label_records("mct", question(hits=HITS3), args, {}) == []
    row = render_rows("mct", [{**got, "id": "q", "image_path": "/x.png", "question": "Where?"}])[0]
    assert row["class"] == "2 consistent"
    assert parse_completion(spec("mct"), row["completion"][0]["content"]) == {
        "consistent": got["consistent"],
        "summary": "Both say caves.",
    }


def test_skb_soft_targets_keep_the_score():
    recs = [
        {"id": f"q{i}", "question": "Where?", "image_path": "/x.png", "search_score": 2.3, "split": "train"}
        for i in range(400)
    ]
    rows = render_rows("skb", recs)
    digits = [int(r["completion"][0]["content"]) for r in rows]
    assert set(digits) == {2, 3} and all(r["target"] == 2.3 for r in rows)
    assert sum(digits) / len(digits) == pytest.approx(2.3, abs=0.08)  # the expected target is the score
    assert {r["completion"][0]["content"] for r in render_rows("skb", recs, skb_target="round")} == {"2"}
    assert render_rows("skb", recs) == rows  # seeded by the id


def test_caps_and_balance_shape_the_train_split_only(tmp_path):
    """--max_per_class and --balance shape what the gate learns from; the held-out split keeps every row and its true
    class mix (its accuracy, majority baseline and positive ratio are reported), the same file on every render."""
    from common.files import read_jsonl, write_jsonl_atomic
    from gate.train.labelling import stage_render

    recs = [record(i, i % 5 != 0, split="train") for i in range(20)] + [
        record(100 + i, i % 5 != 0, split="test") for i in range(20)
    ]  # 16 search, 4 not, in each split
    write_jsonl_atomic(tmp_path / "labels-hkb.jsonl", recs)
    args = BuildDataArgs(stage="render", out=str(tmp_path), variant="hkb", max_per_class=3, balance=True, seed=0)
    stage_render(args, tmp_path, log=lambda *a: None)
    assert class_balance(list(read_jsonl(tmp_path / "hkb.train.jsonl"))) == {"false": 3, "true": 3}
    first = (tmp_path / "hkb.test.jsonl").read_text()
    assert class_balance(list(read_jsonl(tmp_path / "hkb.test.jsonl"))) == {"false": 4, "true": 16}
    stage_render(args, tmp_path, log=lambda *a: None)
    assert (tmp_path / "hkb.test.jsonl").read_text() == first
    # one split of questions only (InfoSeek's train): --holdout makes the held-out file from whole train questions
    write_jsonl_atomic(tmp_path / "labels-hkb.jsonl", recs[:20])
    (tmp_path / "hkb.test.jsonl").unlink()
    stage_render(BuildDataArgs(stage="render", out=str(tmp_path), variant="hkb", holdout=0.3), tmp_path, log=print)
    train, test = (list(read_jsonl(tmp_path / f"hkb.{s}.jsonl")) for s in ("train", "test"))
    assert test and len(train) + len(test) == 20 and not {r["id"] for r in train} & {r["id"] for r in test}
    # rendered again without --holdout: every question is train, and the held-out file of before is gone (it would
    # hold train questions, and the SFT configs read it as eval_file)
    said = []
    stage_render(BuildDataArgs(stage="render", out=str(tmp_path), variant="hkb"), tmp_path, log=said.append)
    assert len(list(read_jsonl(tmp_path / "hkb.train.jsonl"))) == 20 and not (tmp_path / "hkb.test.jsonl").exists()
    assert not any("one class only" in line for line in said)
    # every question labelled alike: said at render, not first at SFT, which refuses it
    write_jsonl_atomic(tmp_path / "labels-hkb.jsonl", [record(i, True, split="train") for i in range(5)])
    stage_render(BuildDataArgs(stage="render", out=str(tmp_path), variant="hkb"), tmp_path, log=said.append)
    assert any("note: one class only" in line and "allow_single_class" in line for line in said)


def test_holdout_moves_whole_questions_the_same_in_every_variant():
    """srt has one example per document: a question's examples all land in one split, and a question held out for
    one variant is held out for every other (the same hash of its id and the seed)."""
    from gate.train.render import hold_out, question_of

    per_doc = [dict(record(i, True), id=f"q{i}#d{j}", question_id=f"q{i}") for i in range(60) for j in range(3)]
    one_each = [record(i, i % 2 == 0) for i in range(60)]
    split = hold_out({"train": per_doc}, 0.25, seed=0)
    held = {question_of(r) for r in split["test"]}
    assert held and not held & {question_of(r) for r in split["train"]}
    assert len(split["test"]) == 3 * len(held) and all(r["split"] == "test" for r in split["test"])
    assert {r["id"] for r in hold_out({"train": one_each}, 0.25, seed=0)["test"]} == held
    assert {r["id"] for r in hold_out({"train": one_each}, 0.25, seed=1)["test"]} != held
    assert 5 <= len(held) <= 25  # about a quarter of 60
    with pytest.raises(ValueError, match="already have a test split"):
        hold_out({"train": one_each, "test": one_each[:1]}, 0.25, seed=0)
    for bad in (0, 1, 1.5):
        with pytest.raises(ValueError, match="fraction in"):
            hold_out({"train": one_each}, bad, seed=0)


@pytest.mark.parametrize(
    "rec,target,cls",
    [
        ({"answers": ["mossy caves", "caves"], "question_type": "habitat"}, "mossy caves", "habitat"),
        ({"answers": ["reefs"], "question_type": None}, "reefs", "answer"),
        ({"answers": ["reefs"]}, "reefs", "answer"),
    ],
)
def test_the_answerers_rows_target_the_first_gold_answer_and_count_by_question_type(rec, target, cls):
    """toy.gates' answerer rows: the first of the gold answers is the target; the class is the question type."""
    (row,) = render_rows("answer", [{**record(0, None), **rec, "context": "Holhol lives in caves"}])
    assert row["completion"] == [{"role": "assistant", "content": target}] and row["class"] == cls
    assert row["prompt"][1]["content"] == "Context: Holhol lives in caves\nQuestion: Where?"


@pytest.mark.parametrize("fraction", [0.05, 0.25, 0.5])
def test_holdout_takes_its_share_of_the_questions(fraction):
    held = hold_out({"train": [record(i, True) for i in range(4000)]}, fraction, seed=3)["test"]
    assert len(held) / 4000 == pytest.approx(fraction, abs=0.03)  # binomial sd ≤ 0.008


@pytest.mark.parametrize("fraction,n", [(0.001, 5), (0.999, 5), (0.5, 1)])
def test_a_holdout_that_would_empty_a_split_is_refused(fraction, n):
    with pytest.raises(ValueError, match=f"--holdout {fraction}: the train split's {n} examples would leave a split"):
        hold_out({"train": [record(i, True) for i in range(n)]}, fraction, seed=0)


@pytest.mark.parametrize(
    "balance,shown",
    [
        ({"false": 1, "true": 3}, "false: 1 (25.0 %), true: 3 (75.0 %)"),
        ({"false": 0}, "false: 0 (0.0 %)"),
        ({}, "none"),
    ],
)
def test_format_balance(balance, shown):
    assert format_balance(balance) == shown


def test_caps_count_every_class_apart():
    """skb's five digits: each class capped by its own rows (a cap over two classes could swap them unseen)."""
    scores = [1.0] * 7 + [2.0] * 6 + [3.0] * 5
    rows = render_rows(
        "skb", [{**record(i, None), "search_score": x} for i, x in enumerate(scores)], skb_target="round"
    )
    assert class_balance(rows) == {"1": 7, "2": 6, "3": 5}
    assert class_balance(cap_classes(rows, 6, False, seed=0)) == {"1": 6, "2": 6, "3": 5}
    assert class_balance(cap_classes(rows, None, True, seed=0)) == {"1": 5, "2": 5, "3": 5}
    assert cap_classes([], None, True, seed=0) == []


@pytest.mark.parametrize("shaping", [{"max_per_class": 2}, {"balance": True}])
def test_class_targets_beside_a_cap_or_balance_are_refused(shaping, tmp_path):
    """--class_targets sets every class's count itself: a --max_per_class or --balance given with it was dropped
    without a word (3 of each class taken under a cap of 2)."""
    from common.files import write_jsonl_atomic
    from gate.train.build_data import build

    recs = [record(i, i % 2 == 0) for i in range(6)]
    with pytest.raises(ValueError, match="--class_targets sets each class's count: leave out --max_per_class and"):
        render_rows("hkb", recs, targets={"true": 3, "false": 3}, seed=0, **shaping)
    write_jsonl_atomic(tmp_path / "labels-hkb.jsonl", recs)
    (tmp_path / "hkb.test.jsonl").write_text("an earlier render's held-out split\n")
    args = BuildDataArgs(stage="render", out=str(tmp_path), variant="hkb", class_targets="true:3,false:3", **shaping)
    with pytest.raises(ValueError, match="--class_targets sets each class's count: leave out --max_per_class and"):
        build(args, log=print)
    assert (tmp_path / "hkb.test.jsonl").read_text() == "an earlier render's held-out split\n"
