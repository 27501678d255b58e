"""The Inspector's label (WikiSeeker): PASS when the context is the gold section — by evidence section when the data
names one (E-VQA's evidence_section_id), else by gold entity — and the optional text-only-answer proxy holds."""

import pytest

from gate.pipeline.end_to_end import is_gold_section
from gate.train.labels import inspector_label

URL = "https://en.wikipedia.org/wiki/X"


@pytest.mark.parametrize(
    "entity,section,gold_entity,gold_section,expected",
    [
        (URL, 3, URL, 3, True),  # the evidence section itself
        (URL, 2, URL, 3, False),  # the right article, another section
        (URL, 3, "Q1", 3, False),  # another entity
        (URL, 2, URL, None, True),  # no evidence section in the data (InfoSeek): the gold entity suffices
        (URL, None, URL, 3, True),  # the section's index is unknown: fall back to the entity
        (URL, 2, URL, [3, 5], True),  # a 2-hop gold (list): entity level only
        ("Q5", "3", "Q5", 3, True),  # indices compared as integers
    ],
)
def test_is_gold_section(entity, section, gold_entity, gold_section, expected):
    assert is_gold_section(entity, section, gold_entity, gold_section) is expected


@pytest.mark.parametrize(
    "top_section,text_ok,expected",
    [(3, None, "true"), (3, True, "true"), (3, False, "false"), (1, None, "false"), (1, True, "false")],
)
def test_inspector_label_by_evidence_section(top_section, text_ok, expected):
    label = inspector_label(URL, URL, "Europe", text_ok, top_section=top_section, gold_section=3)
    assert label["pass"] == expected
    assert ("answer" in label) == (expected == "false") and label.get("answer", "Europe") == "Europe"


@pytest.mark.parametrize(
    "gold,written", [("Ottawa && Toronto", "Ottawa, Toronto"), ("Rhine", "Rhine"), ("a &&  b && ", "a, b")]
)
def test_the_inspectors_fail_answer_is_a_multi_answer_as_evqas_scorer_reads_one(gold, written):
    """The literal "Ottawa && Toronto" became the pipeline's answer on a FAIL, which E-VQA's scorer does not accept."""
    from gate.pipeline.metrics_evqa import evqa_exact_match
    from gate.train.labelling import answer_as_written

    assert answer_as_written(gold) == written
    if "&&" in gold and gold.strip(" &"):
        assert evqa_exact_match(written, [gold], "multi_answer")


# ---------------------------------------------------------------- one question's Inspector example (label_records)
HITS = [
    {"entity_id": URL, "section": 3, "title": "X", "section_title": "History", "text": "founded in 1901"},
    {"entity_id": URL, "section": 5, "title": "X", "section_title": "Geography", "text": "lies in Europe"},
]


def inspector_example(rec=None, contexts=None, check_answer=False, **kw):
    from gate.train.build_data import BuildDataArgs
    from gate.train.labelling import label_records

    args = BuildDataArgs(inspector_check_answer=check_answer, correct_score=4.0)
    rec = {"id": "q", "entity_id": URL, "answers": ["Europe", "the EU"], "hits": HITS, **(rec or {}), **kw}
    return label_records("inspector", rec, args, contexts)


@pytest.mark.parametrize("evidence,passed", [(3, True), (5, False), (None, True)])
def test_an_inspector_example_shows_the_top_section_and_judges_it(evidence, passed):
    (got,) = inspector_example(evidence_section_id=evidence)
    assert got["pass"] is passed
    assert got["context"] == "X - History: founded in 1901"  # the top hit, as the Inspector sees it
    assert got["inspector"] == ({"pass": "true"} if passed else {"pass": "false", "answer": "Europe"})  # first gold


@pytest.mark.parametrize(
    "contexts,expected",
    [
        ({"q": {"doc_scores": [4.0, 1.0]}}, [True]),  # the text-only answer scores the correct score: right
        ({"q": {"doc_scores": [3.0, 5.0]}}, [False]),  # only the top section's answer counts
        ({"q": {"doc_scores": [None, 5.0]}}, []),  # its judgement failed: no example
        ({"other": {"doc_scores": [5.0, 5.0]}}, []),  # no context record for this question
        (None, []),
    ],
)
def test_the_answer_check_reads_the_top_sections_judged_answer(contexts, expected):
    assert [r["pass"] for r in inspector_example(contexts=contexts, check_answer=True)] == expected
