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
