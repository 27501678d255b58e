"""The context-noise study: contexts with a controlled share of relevant sections (table-driven and with
hypothesis), resume after an interruption, and the toy world end to end with a VLM with and without the image and a
text LLM."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.files import read_jsonl
from gate.pipeline.noise_study import (
    NoiseArgs,
    accuracy_table,
    noisy_context,
    parse_generators,
    parse_levels,
    relevant_sections,
    run_study,
)

QUIET = dict(log=lambda *a: None)


def test_levels_and_generators_parse_and_bad_ones_are_named():
    assert parse_levels("0, 0.5 ,oracle") == ["0", "0.5", "oracle"]
    for bad, match in [("1.5", "neither a share"), ("half", "neither a share"), ("0,0", "twice")]:
        with pytest.raises(ValueError, match=match):
            parse_levels(bad)
    assert parse_generators("VLM=vlm:/m,LLM text=llm:/l,API=endpoint:gpt@http://x") == {
        "VLM": ("vlm", "/m"),
        "LLM text": ("llm", "/l"),
        "API": ("endpoint", "gpt@http://x"),
    }
    for bad in ["VLM", "VLM=clip:/m", "=vlm:/m", ""]:
        with pytest.raises(ValueError, match="--generators"):
            parse_generators(bad)
    with pytest.raises(ValueError, match="the name 'VLM' is given twice"):
        parse_generators("VLM=vlm:/a, VLM =llm:/b")


@given(
    st.integers(1, 5),
    st.integers(1, 12),
    st.sampled_from([0, 0.1, 0.25, 0.5, 0.9, 1, "oracle"]),
    st.integers(0, 99),
    st.integers(0, 8),
)
def test_a_context_holds_the_share_of_relevant_sections_asked_for(n_relevant, n, level, seed, own_in_pool):
    relevant = [f"R{i}" for i in range(n_relevant)]
    pool = [("other", f"D{i}") for i in range(20)] + [("gold", f"G{i}") for i in range(own_in_pool)]
    sections = noisy_context(relevant, pool, "gold", str(level), n, seed)
    if level == "oracle":
        assert sections == ["R0"]
        return
    k = round(level * n)
    assert len(sections) == n and sum(s.startswith("R") for s in sections) == k
    assert not any(s.startswith("G") for s in sections)  # never a section of the question's own entity
    assert len({s for s in sections if s.startswith("D")}) == n - k  # distractors drawn without replacement
    assert noisy_context(relevant, pool, "gold", str(level), n, seed, own_in_pool) == sections  # seeded; count given


def test_a_pool_too_small_for_the_context_is_named():
    with pytest.raises(ValueError, match="5 distractor sections wanted, 3 available"):
        noisy_context(["R"], [("o", "D1"), ("o", "D2"), ("o", "D3"), ("g", "G")], "g", "0", 5, 0)


def test_relevant_sections_hold_an_answer_with_the_evidence_section_first():
    sections = [
        {"section": 0, "title": "T", "text": "It eats seeds."},
        {"section": 1, "text": "Nothing here."},
        {"section": 2, "title": "T", "text": "Seeds, mostly."},
    ]
    q = {"answers": ["seeds"], "evidence_section_id": 2}
    assert relevant_sections(q, sections) == ["T: Seeds, mostly.", "T: It eats seeds."]
    assert relevant_sections({"answers": ["fish"]}, sections) == []
    # the KB's row per ⟨image, section⟩: a section with three images is still one relevant section
    assert relevant_sections(q, sections * 3) == ["T: Seeds, mostly.", "T: It eats seeds."]


def test_the_table_has_a_row_per_generator_and_a_column_per_level():
    table = accuracy_table({"VLM": {"0": 0.25, "oracle": 1.0}, "LLM": {"0": 0.0}}, ["0", "oracle"])
    assert table.splitlines() == [
        "| generator | 0 | oracle |",
        "|---|---|---|",
        "| VLM | 25.0 | 100.0 |",
        "| LLM | 0.0 | — |",
    ]


class Interrupted(Exception):
    pass


def test_an_interrupted_study_resumes_and_scores_by_the_official_rule(tiny_world, tmp_path):
    """A stand-in reader that answers right exactly when a gold answer is in its context: 0 % with no relevant
    section, 100 % with half of them relevant and with the oracle section."""
    import json

    golds: dict[str, set] = {}  # question text → the gold answers of the questions asking it
    for r in read_jsonl(tiny_world / "test.jsonl"):
        golds.setdefault(r["question"], set()).update(r["answers"])
    calls = []

    def reader(images, questions, contexts):
        calls.append(len(questions))
        if len(calls) == 2:
            raise Interrupted
        return [
            (next((g for g in sorted(golds[q]) if g.lower() in c.lower()), "no idea"), None)
            for q, c in zip(questions, contexts)
        ]

    args = NoiseArgs(
        queries=str(tiny_world / "test.jsonl"),
        kb=str(tiny_world / "kb.jsonl"),
        out=str(tmp_path),
        levels="0,0.5,oracle",
        n_sections=4,
        limit=6,
        batch_size=4,
        generator_prompt="toy",
    )
    with pytest.raises(Interrupted):
        run_study(args, generators={"reader": reader}, **QUIET)
    assert len(list(read_jsonl(tmp_path / "answers.jsonl"))) == 4
    result = run_study(args, generators={"reader": reader}, **QUIET)
    assert calls[2:] == [4, 4, 4, 2]  # the 14 (level, question) pairs the first run had not answered
    assert result["questions"] == 6 and len(list(read_jsonl(tmp_path / "answers.jsonl"))) == 18
    # level 0 holds only other entities' sections, which may still name a shared answer (a colour): rarely right
    assert result["accuracy"]["reader"]["oracle"] == 1.0 and result["accuracy"]["reader"]["0"] <= 0.25
    assert json.loads((tmp_path / "noise.json").read_text())["accuracy"] == result["accuracy"]
    assert (tmp_path / "noise_table.md").read_text().startswith("| generator | 0 | 0.5 | oracle |")
    # an endpoint down for some requests: they are not written as answers (scored wrong), the run says so, and
    # the next run asks for exactly those
    (tmp_path / "answers.jsonl").unlink()

    def flaky(images, questions, contexts):
        return [
            (None, "generator failed after 3 attempts: URLError") if i == 0 else ("x", None)
            for i in range(len(questions))
        ]

    with pytest.raises(RuntimeError, match="5 generator requests failed after their retries and were not written"):
        run_study(args, generators={"reader": flaky}, **QUIET)  # the first of each of the 5 batches
    assert len(list(read_jsonl(tmp_path / "answers.jsonl"))) == 18 - 5
    before = len(calls)
    run_study(args, generators={"reader": reader}, **QUIET)
    assert sum(calls[before:]) == 5 and len(list(read_jsonl(tmp_path / "answers.jsonl"))) == 18
    # a model that answers nothing gave an answer (scored wrong), not a failed request: the study finishes
    (tmp_path / "answers.jsonl").unlink()
    silent = lambda images, questions, contexts: [(None, "empty answer")] * len(questions)  # noqa: E731
    result = run_study(args, generators={"reader": silent}, **QUIET)
    assert [r["answer"] for r in read_jsonl(tmp_path / "answers.jsonl")] == [None] * 18
    assert result["accuracy"]["reader"]["oracle"] == 0.0
    # answers to 4-section contexts are not resumed as if they were 10-section ones
    with pytest.raises(ValueError, match=r"other settings \(n_sections: 4 then, 10 now"):
        run_study(NoiseArgs(**{**args.__dict__, "n_sections": 10}), generators={"reader": reader}, **QUIET)


def test_a_generator_name_resumes_only_its_own_model(tiny_world, tmp_path, monkeypatch):
    """The answers of a generator are resumed by its name: under that name, another model folder, the same folder
    with its weights exported again, or another endpoint model answered nothing, and the earlier model's answers
    made its table row. The endpoint's URL may change."""
    import gate.pipeline.noise_study as noise_study

    models = {}
    for name in ("a", "b"):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "model.safetensors").write_bytes(b"weights")
    asked = []

    def fake_load(kind, target, *rest):
        def generate(images, questions, contexts):
            asked.append((kind, target, len(questions)))
            return [("x", None)] * len(questions)

        return generate

    monkeypatch.setattr(noise_study, "load_generator", fake_load)
    base = dict(
        queries=str(tiny_world / "test.jsonl"),
        kb=str(tiny_world / "kb.jsonl"),
        levels="oracle",
        limit=2,
        generator_prompt="toy",
    )

    def study(out, generators):
        return run_study(NoiseArgs(**base, out=str(tmp_path / out), generators=generators), **QUIET)

    study("local", f"R=llm:{models['a']}")
    assert {r["source"] for r in read_jsonl(tmp_path / "local" / "answers.jsonl")} == {
        noise_study.generator_source("llm", str(models["a"]))
    }
    study("local", f"R=llm:{models['a']},S=llm:{models['b']}")  # a generator added: asked, the other resumed
    assert [a[1] for a in asked] == [str(models["a"]), str(models["b"])]
    with pytest.raises(ValueError, match=rf"answers of other generators under the same names \('R': llm:{models['a']}"):
        study("local", f"R=llm:{models['b']}")
    (models["a"] / "model.safetensors").write_bytes(b"weights, exported again")
    with pytest.raises(ValueError, match="'R': llm:.* then, llm:.* now"):
        study("local", f"R=llm:{models['a']}")
    study("api", "R=endpoint:gpt@http://one")
    study("api", "R=endpoint:gpt@http://two")  # the same model behind another URL: resumed, not asked
    assert len(asked) == 3
    with pytest.raises(ValueError, match="'R': endpoint:gpt then, endpoint:other now"):
        study("api", "R=endpoint:other@http://one")


def test_a_questions_file_made_again_at_the_same_path_is_not_resumed(tiny_world, tmp_path):
    """Answers to the questions a file held are not resumed for what it holds now: the study records the file's
    content and the folder its images resolve against, as the pipeline and the gate-data stages do."""
    import shutil

    queries = tmp_path / "q.jsonl"
    rows = list(read_jsonl(tiny_world / "test.jsonl"))
    write = lambda rs: queries.write_text("".join(json.dumps(r) + "\n" for r in rs))  # noqa: E731
    write(rows)
    shutil.copytree(tiny_world / "images", tmp_path / "images")
    args = NoiseArgs(
        queries=str(queries), kb=str(tiny_world / "kb.jsonl"), out=str(tmp_path / "out"), levels="oracle", limit=2
    )
    reader = {"reader": lambda images, questions, contexts: [("x", None)] * len(questions)}
    run_study(args, generators=reader, **QUIET)
    write([{**r, "answers": ["corrected"]} if i == 0 else r for i, r in enumerate(rows)])
    with pytest.raises(ValueError, match=r"other settings \(queries: 'sha256:"):
        run_study(args, generators=reader, **QUIET)
    write(rows)
    run_study(args, generators=reader, **QUIET)  # the same content again: resumed
    with pytest.raises(ValueError, match=r"other settings \(images_root: "):
        run_study(NoiseArgs(**{**args.__dict__, "images_root": str(tiny_world)}), generators=reader, **QUIET)


def test_the_toy_world_study_with_a_vlm_with_and_without_the_image_and_a_text_llm(
    tiny_world, tiny_gate_vlm, tiny_text_llm, tmp_path, monkeypatch
):
    from PIL import Image

    import gate.pipeline.noise_study as noise_study

    # the real VLM answerers, each recording the images it is given, by the kind of generator it was made for
    real_load, real_answerer, sent, making = noise_study.load_generator, noise_study.vlm_answerer, {}, []

    def load_generator(kind, *a, **kw):
        making.append(kind)
        return real_load(kind, *a, **kw)

    def vlm_answerer(*a, **kw):
        vlm, calls = real_answerer(*a, **kw), sent.setdefault(making[-1], [])

        def answer(images, texts, sample):
            calls.append((images, len(texts)))
            return vlm(images, texts, sample)

        return answer

    monkeypatch.setattr(noise_study, "load_generator", load_generator)
    monkeypatch.setattr(noise_study, "vlm_answerer", vlm_answerer)
    lines = []
    args = NoiseArgs(
        queries=str(tiny_world / "test.jsonl"),
        kb=str(tiny_world / "kb.jsonl"),
        out=str(tmp_path),
        generators=f"VLM=vlm:{tiny_gate_vlm},VLM text-only=vlm-text:{tiny_gate_vlm},LLM=llm:{tiny_text_llm}",
        levels="0,0.5,oracle",
        n_sections=3,
        limit=4,
        batch_size=6,
        max_new_tokens=4,
        generator_prompt="toy",
        device="cpu",
    )
    result = run_study(args, log=lines.append)
    assert set(result["accuracy"]) == {"VLM", "VLM text-only", "LLM"}
    assert all(0 <= v <= 1 for acc in result["accuracy"].values() for v in acc.values())
    assert "| VLM text-only |" in lines[-1] and "3-section context, 4 questions" in lines[-1]
    answers = list(read_jsonl(tmp_path / "answers.jsonl"))
    assert len(answers) == 3 * 3 * 4 and {a["generator"] for a in answers} == set(result["accuracy"])
    assert making == ["vlm", "vlm-text", "llm"] and set(sent) == {"vlm", "vlm-text"}  # the LLM is no VLM
    for calls in sent.values():  # every (level, question) of each VLM generator asked once
        assert sum(n for _, n in calls) == 3 * 4
    # with the image: one PIL image per question; text-only: no image at all
    assert all(
        images is not None and len(images) == n and all(isinstance(i, Image.Image) for i in images)
        for images, n in sent["vlm"]
    )
    assert all(images is None for images, _ in sent["vlm-text"])


def test_the_toy_config_parses_and_names_its_generators():
    from pathlib import Path

    from common.cli import parse

    path = Path(__file__).resolve().parent.parent / "configs" / "gate" / "noise_toy.yaml"
    (args,) = parse((NoiseArgs,), ["--config", str(path)])
    assert [k for k, _ in parse_generators(args.generators).values()] == ["vlm", "vlm-text"]
    assert parse_levels(args.levels)[-1] == "oracle" and len(parse_levels(args.levels)) == 11


@pytest.mark.parametrize("device,expected", [(None, "cuda:1"), ("cpu", "cpu"), ("cuda:0", "cuda:0")])
def test_bem_loads_on_this_processs_device_unless_told(monkeypatch, tmp_path, device, expected):
    """E-VQA's BEM scorer goes where every other model of the study goes: this process's own device (a GPU's on a GPU
    machine), or --device; it loaded on the CPU whenever --device was left out."""
    import common.placement
    import gate.pipeline.noise_study as ns

    monkeypatch.setattr(common.placement, "process_device", lambda: "cuda:1")
    made = []

    class Loaded(Exception):
        pass

    def bem_scorer(model, device, batch_size):
        made.append((model, device))
        raise Loaded

    monkeypatch.setattr(ns, "BEMScorer", bem_scorer)
    args = NoiseArgs(metric="evqa", bem="my-bem", device=device, out=str(tmp_path))
    with pytest.raises(Loaded):
        ns.score(args, [], ["0.5"], ["reader"], tmp_path / "answers.jsonl", 0, lambda *a: None)
    assert made == [("my-bem", expected)]
