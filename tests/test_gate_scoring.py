"""First-token scoring against a model whose next-token logits the test sets, the verbaliser check, the threshold
sweep, and evaluation of a real tiny gate."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gate.scoring import (
    DEFAULT_THRESHOLDS,
    GATE_FILE,
    decisions,
    first_token_scores,
    gate_of,
    generate_parsed,
    load_gate,
    verbaliser_ids,
)
from gate.train.evaluation import sweep
from gate.variants import spec


@pytest.fixture(scope="module")
def processor(tiny_gate_vlm):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_gate_vlm))


class SetLogits(torch.nn.Module):
    """Returns the given logits at every position; records each batch's input ids."""

    def __init__(self, vocab: int, values: dict[int, float], background: float = 5.0):
        super().__init__()
        self.row = torch.full((vocab,), background)
        for i, v in values.items():
            self.row[i] = v
        self.seen = []

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, input_ids, **kwargs):
        self.seen.append(input_ids)
        return SimpleNamespace(logits=self.row.expand(input_ids.shape[0], input_ids.shape[1], -1).clone())


@pytest.fixture()
def images(tiny_world):
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in sorted((tiny_world / "images").glob("*.png"))[:3]]


def gate_folder(tiny_gate_vlm, folder, info: dict | None):
    """The toy gate VLM copied to ``folder`` with ``info`` as its gate.json (none when None)."""
    import shutil

    from common.files import write_json_atomic

    shutil.copytree(tiny_gate_vlm, folder)
    if info is not None:
        write_json_atomic(folder / GATE_FILE, info)
    return folder


def test_binary_score_is_the_positive_share_of_the_two_verbalisers(processor, images):
    s = spec("hkb")
    yes, no = verbaliser_ids(processor.tokenizer, s)
    # other tokens are far more likely; only the two verbalisers count: P = e^log3 / (e^log3 + e^0) = 0.75
    model = SetLogits(len(processor.tokenizer), {yes: math.log(3.0), no: 0.0}, background=8.0)
    questions = ["Where does this creature live?", "What?", "What colour is this creature, exactly, please?"]
    processor.tokenizer.padding_side = "right"  # a gate folder saved padding on the right (the toy's pads left)
    scores = first_token_scores(model, processor, s, images, questions, batch_size=3)
    assert scores == pytest.approx([0.75] * 3, abs=1e-6)
    ids = model.seen[0]
    assert (ids[:, -1] != processor.tokenizer.pad_token_id).all()  # left padding: the last position is real
    assert decisions(scores, 0.5).all() and not decisions(scores, 0.8).any()
    assert first_token_scores(model, processor, s, [], []).shape == (0,)  # no question, no score


def test_skb_score_is_the_expected_digit(processor, images):
    s = spec("skb")
    digits = verbaliser_ids(processor.tokenizer, s)
    model = SetLogits(len(processor.tokenizer), dict(zip(digits, np.log([1, 1, 1, 1, 4]))))
    scores = first_token_scores(model, processor, s, images[:2], ["Where?", "What?"])
    assert scores == pytest.approx([(1 + 2 + 3 + 4 + 5 * 4) / 8] * 2, abs=1e-5)


def test_inspector_is_scored_after_its_json_prefix(processor, images):
    s = spec("inspector")
    yes, no = verbaliser_ids(processor.tokenizer, s)
    model = SetLogits(len(processor.tokenizer), {yes: 0.0, no: math.log(4.0)})
    scores = first_token_scores(model, processor, s, images[:1], ["Where?"], contexts=["Holhol: lives in caves"])
    assert scores == pytest.approx([0.2], abs=1e-6)
    text = processor.tokenizer.decode(model.seen[0][0])
    assert text.endswith('<|im_start|>assistant\n{"pass": "') and "Context: Holhol: lives in caves" in text


@pytest.mark.parametrize(
    "variant,verbalisers,first",
    [
        ("hkb", None, ["t", "f"]),  # true → t r u e, false → f al s e: told apart by their first tokens
        ("hkb", ["1", "0"], ["1", "0"]),
        ("ret", ["Ret", "NoRet"], ["R", "N"]),  # MMKB-RAG's words, as Qwen2.5's tokenizer splits NoRet: No + Ret
        ("inspector", None, ["t", "f"]),  # after the JSON prefix {"pass": "
    ],
)
def test_a_verbaliser_is_scored_by_its_first_token(tiny_refiner, variant, verbalisers, first):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_refiner))  # the toy world's byte-level BPE: splits most words
    assert tok.convert_ids_to_tokens(verbaliser_ids(tok, spec(variant, verbalisers))) == first


def test_verbalisers_that_start_with_one_token_are_named(tiny_refiner):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_refiner))
    with pytest.raises(ValueError, match=r"start with different tokens.*'Ret' → 'R'; 'Rel' → 'R'"):
        verbaliser_ids(tok, spec("ret", ["Ret", "Rel"]))


def test_a_verbaliser_the_tokenizer_merges_with_the_prefix_is_named(tiny_refiner):
    """The Inspector's prefix ends in ``Ġ"``; after it ``}`` is tokenized ``Ġ`` + ``"}``: its first token is not the
    verbaliser's, so its score would be read from the wrong token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_refiner))
    with pytest.raises(ValueError, match=r"merges verbaliser\(s\) '}' with the completion prefix '\{\"pass\": \"'"):
        verbaliser_ids(tok, spec("inspector", ["}", "false"]))


@pytest.mark.parametrize(
    "info,error",
    [
        (None, "no gate.json"),
        ({"variant": "hkb", "verbalisers": ["yes", "yet"]}, "start with different tokens"),  # y + es, y + et
        ({"variant": "skb", "verbalisers": ["yes", "yet", "3", "4", "5"]}, "start with different tokens"),
        ({"variant": "mct"}, None),  # generated and parsed: no verbalisers to check
    ],
)
def test_a_gate_folder_is_refused_when_loaded_not_when_first_scored(tiny_gate_vlm, tmp_path, info, error):
    folder = gate_folder(tiny_gate_vlm, tmp_path / "gate", info)
    if error is None:
        assert load_gate(folder, device="cpu")[2]["name"] == info["variant"]
    else:
        with pytest.raises(ValueError, match=error):
            load_gate(folder, device="cpu")


def test_a_pipeline_stage_refuses_a_gate_of_another_variant(tiny_gate_vlm, tmp_path):
    folder = gate_folder(tiny_gate_vlm, tmp_path / "gate", {"variant": "hkb"})
    with pytest.raises(ValueError, match=r"is a hkb gate; expected inspector or mct"):
        gate_of(str(folder), "cpu", None, "inspector", "mct")
    assert gate_of(str(folder), "cpu", None, "ret", "hkb")[2]["name"] == "hkb"


def test_a_score_that_reaches_the_threshold_is_positive():
    assert decisions([0.49, 0.5, 0.51], 0.5).tolist() == [False, True, True]
    assert decisions([2.99, 3.0], 3.0).tolist() == [False, True]  # skb: the expected digit against ε


def test_skb_is_scored_against_the_same_epsilon_its_training_labels_used():
    from gate.train.build_data import BuildDataArgs

    assert DEFAULT_THRESHOLDS["skb"] == BuildDataArgs().epsilon == 3.0


def test_sweep_from_one_set_of_scores():
    rows = sweep([0.1, 0.6, 0.9], [False, True, True], [0.0, 0.5, 1.0])
    assert [r["positive_ratio"] for r in rows] == pytest.approx([1.0, 2 / 3, 0.0])
    assert [r["accuracy"] for r in rows] == pytest.approx([2 / 3, 1.0, 1 / 3])


def test_a_failed_section_gets_the_inspectors_answer_after_a_written_fail(tiny_gate_vlm, images, tmp_path):
    """At a threshold above P(pass), the Inspector fails every section; its answer is generated after the FAIL verdict
    written for it (free generation at P(pass) > 0.5 would write PASS and no answer)."""
    from gate.pipeline.stages import Inspector

    folder = gate_folder(tiny_gate_vlm, tmp_path / "inspector", {"variant": "inspector"})
    inspector = Inspector(str(folder), threshold=1.01, device="cpu", dtype=None)
    seen, generate = [], inspector.model.generate

    def recording(**kw):
        seen.append(kw["input_ids"])
        return generate(**kw)

    inspector.model.generate = recording
    out = inspector(images[:2], ["Where?", "What?"], ["Holhol: lives in caves", "Ka: eats snails"])
    assert [r["pass"] for r in out] == [False, False] and all(r["p_pass"] < 1.01 for r in out)
    prompts = [inspector.processor.tokenizer.decode(ids, skip_special_tokens=False) for ids in seen[0]]
    assert all(p.endswith('<|im_start|>assistant\n{"pass": "false", "answer": "') for p in prompts)


@pytest.mark.parametrize("recorded,expected", [(None, 160), (0, 160), (100, 116), (7, 23)])
def test_the_inspector_generates_as_long_a_reply_as_it_was_trained_on(
    tiny_gate_vlm, images, tmp_path, recorded, expected
):
    """Its answer sentences (expand writes up to 128 tokens) ran past a fixed 48 tokens: no closing brace, no JSON, and
    the answer was lost. A gate folder records its longest SFT target; one that does not gets the default."""
    from gate.pipeline.stages import Inspector

    info = {"variant": "inspector"} | ({"longest_completion_tokens": recorded} if recorded is not None else {})
    folder = gate_folder(tiny_gate_vlm, tmp_path / "inspector", info)
    inspector = Inspector(str(folder), threshold=1.01, device="cpu", dtype=None)
    asked, generate = [], inspector.model.generate

    def recording(**kw):
        asked.append(kw["max_new_tokens"])
        return generate(**{**kw, "max_new_tokens": 2})

    inspector.model.generate = recording
    inspector(images[:1], ["Where?"], ["Holhol: lives in caves"])
    assert asked == [expected]


def test_generate_and_parse_asks_the_question_with_its_context_and_the_length_given(tiny_gate_vlm, images, tmp_path):
    """The user turn is the question with its context; the consistency stage passes its --consistency_max_new_tokens
    (the recorded longest target and its margin are the default); an Inspector without a context is named."""
    info = {"variant": "inspector", "longest_completion_tokens": 7}
    model, processor, s = load_gate(gate_folder(tiny_gate_vlm, tmp_path / "gate", info), device="cpu")
    asked, prompts, generate = [], [], model.generate

    def recording(**kw):
        asked.append(kw["max_new_tokens"])
        prompts.extend(processor.tokenizer.batch_decode(kw["input_ids"]))
        return generate(**{**kw, "max_new_tokens": 2})

    model.generate = recording
    generate_parsed(model, processor, s, images[:1], ["Where?"], ["Holhol: lives in caves"], max_new_tokens=5)
    generate_parsed(model, processor, s, images[:1], ["Where?"], ["Holhol: lives in caves"])
    assert asked == [5, 7 + 16]
    user_turn = prompts[0].split("<|im_start|>user")[1]
    assert "Where?" in user_turn and "Holhol: lives in caves" in user_turn
    with pytest.raises(ValueError, match="variant inspector needs a context"):
        generate_parsed(model, processor, s, images[:1], ["Where?"])


def test_held_out_truth_is_read_from_the_gates_own_verbalisers():
    """A completion none of the gate's verbalisers (rows rendered for another variant, or with other --verbalisers)
    is an error naming the row, not a negative that inflates accuracy; skb's truth at ε = 3 calls the same questions
    "search" as hkb's label at ε = 3 (mean < 3: a mean of exactly 3 is "no search" in both)."""
    from gate.train.evaluation import true_labels
    from gate.train.labels import hkb_label, skb_label

    def row(i, text, **extra):
        return {"id": f"q{i}", "completion": [{"role": "assistant", "content": text}], **extra}

    truth, _ = true_labels(spec("hkb"), [row(0, "true"), row(1, "false")], 0.5)
    assert truth.tolist() == [True, False]
    with pytest.raises(ValueError, match=r"2 of 3 rows .* hkb gate cannot read .* first: row q0, 'Ret'"):
        true_labels(spec("hkb"), [row(0, "Ret"), row(1, "true"), row(2, "NoRet")], 0.5)
    for scores in ([1.0, 5.0], [1.0, 3.0], [3.0, 5.0], [2.0, 4.0, 3.0]):  # means 3, 2, 4, 3
        target = skb_label(scores)
        skb, _ = true_labels(spec("skb"), [row(0, str(round(target)), target=target)], 3.0)
        assert bool(skb[0]) == (hkb_label(scores, 3.0) == "true"), scores
