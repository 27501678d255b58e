"""WikiSeeker's two rerank stages: β1 weights the retrieval score over sections of different articles, β2 weights
the text reranker within the chosen article (the side the paper gives it)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gate.pipeline.rerank import combine, within_article

scores = st.lists(st.floats(0, 1), min_size=1, max_size=8)


@given(scores, st.data())
def test_beta_extremes_reproduce_one_stage_exactly(first, data):
    reranker = data.draw(st.lists(st.floats(0, 1), min_size=len(first), max_size=len(first)))
    assert combine(first, reranker, 1.0).tolist() == first  # β1 = 1: the retrieval scores alone
    assert within_article(first, reranker, 0.0).tolist() == first  # β2 = 0: the text similarity alone
    assert within_article(first, reranker, 1.0).tolist() == reranker  # β2 = 1: the text reranker alone


def test_beta2_weights_the_text_reranker_side():
    first, reranker = [1.0, 0.0], [0.0, 1.0]
    # the paper's β2 = 0.2: 0.8·text similarity + 0.2·reranker, so the similarity's pick wins
    assert within_article(first, reranker, 0.2).tolist() == pytest.approx([0.8, 0.2])
    assert int(np.argmax(within_article(first, reranker, 0.2))) == 0
    assert int(np.argmax(within_article(first, reranker, 0.8))) == 1
    # β1 = 0.6 (E-VQA): 0.6·retrieval + 0.4·reranker
    assert combine(first, reranker, 0.6).tolist() == pytest.approx([0.6, 0.4])
    with pytest.raises(ValueError, match="β"):
        within_article(first, reranker, -0.1)


def test_real_configs_carry_the_paper_betas():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1] / "configs" / "pipeline"
    evqa = yaml.safe_load((root / "evqa.yaml").read_text())
    infoseek = yaml.safe_load((root / "infoseek.yaml").read_text())
    assert (evqa["beta1"], evqa["beta2"], infoseek["beta1"], infoseek["beta2"]) == (0.6, 0.2, 0.8, 0.2)


def test_a_vlm_scores_relevance_zero_shot_by_its_first_token(tiny_gate_vlm, tiny_world):
    """vlm:NAME — any VLM, P(positive verbaliser) to a relevance question, the gates' scoring code; verbalisers that
    start with one token of the model (they cannot be told apart by it) are refused by name."""
    from PIL import Image

    from common.files import read_jsonl
    from gate.pipeline.rerank import FirstTokenReranker, load_reranker, load_text_reranker
    from gate.scoring import first_token_scores

    rr = load_reranker(f"vlm:{tiny_gate_vlm}", device="cpu", verbalisers=("Rel", "NoRel"))
    assert isinstance(rr, FirstTokenReranker) and "Reply Rel or NoRel" in rr.spec["system"]
    row = next(iter(read_jsonl(tiny_world / "test.jsonl")))
    image = Image.open(tiny_world / row["image"]).convert("RGB")
    scores = rr.score([image], [row["question"]], [["a section", "another section", "a third"]])
    direct = first_token_scores(
        rr.model, rr.processor, rr.spec, [image] * 3, [row["question"]] * 3, ["a section", "another section", "a third"]
    )
    assert len(scores) == 1 and np.allclose(scores[0], direct) and ((0 < scores[0]) & (scores[0] < 1)).all()
    with pytest.raises(ValueError, match=r"start with different tokens.*'Relevant'.*'Relevance'"):
        load_reranker(f"vlm:{tiny_gate_vlm}", device="cpu", verbalisers=("Relevant", "Relevance"))
    with pytest.raises(ValueError, match="text_reranker"):
        load_text_reranker(f"vlm:{tiny_gate_vlm}")


def test_a_cross_encoder_score_is_the_sigmoid_of_its_logit_once():
    """sentence-transformers' predict applies a one-label model's sigmoid itself: the reranker's score is
    sigmoid(logit), not sigmoid(sigmoid(logit)), which would keep every score within about (0.5, 0.73)."""
    import torch

    from gate.pipeline.rerank import CrossEncoderReranker

    reranker = CrossEncoderReranker("tiny")
    queries, sections = ["where does it live?", "what does it eat?"], [["red star", "a cave"], ["seaweed"]]
    model = reranker.model
    features = model.tokenizer(
        ["where does it live?", "where does it live?", "what does it eat?"],
        ["red star", "a cave", "seaweed"],
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model.model(**features).logits.float().squeeze(-1).numpy()
    scores = np.concatenate(reranker.score(None, queries, sections))
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), atol=1e-5)


def test_a_cross_encoder_with_two_labels_is_refused(tmp_path):
    """A classifier with two outputs gave (n, 2) scores, which the β-weighted sum broadcast and argmax indexed past
    the article's sections."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from gate.pipeline.rerank import CrossEncoderReranker
    from toy.models import tiny_cross_encoder

    config = AutoConfig.from_pretrained(tiny_cross_encoder(), num_labels=2)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "two")
    AutoTokenizer.from_pretrained(tiny_cross_encoder()).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="a cross-encoder with 2 output labels"):
        CrossEncoderReranker(str(tmp_path / "two"))
    assert CrossEncoderReranker("tiny").model.num_labels == 1
