"""Zero-shot query baselines (Table 8): the JSON answer parsed (table-driven and fuzzed), the fallback to the
question, prompts from a file, resume, and every method as a row of one retrieval table on the toy world."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.files import read_jsonl, weights_fingerprint, write_jsonl_atomic
from common.prompts import load_prompt
from rl.baselines import BASELINES, BaselineArgs, baseline_queries, parse_baseline, run_baselines

QUIET = dict(log=lambda *a: None)


@pytest.mark.parametrize(
    "text,parsed",
    [
        ('{"caption": "a red star", "query": "red star flag"}', {"caption": "a red star", "query": "red star flag"}),
        (
            'Sure! ```json\n{"caption": " a dog ", "query": "dog breed"}\n```',
            {"caption": "a dog", "query": "dog breed"},
        ),
        ('{"caption": "x"} and then {"query": "y"}', {"caption": "x"}),  # the first object that parses counts
        ('{broken {"query": "q"}', {"query": "q"}),
        ('{"caption": 3, "query": ""}', {}),
        ("no json here", {}),
        ("", {}),
        (None, {}),
        ('["caption", "query"]', {}),
    ],
)
def test_parse_baseline(text, parsed):
    assert parse_baseline(text) == parsed


@pytest.mark.parametrize(
    "parsed,queries,fallback",
    [
        ({"caption": "c", "query": "q"}, ("c", "q", "q c"), []),
        ({"caption": "c"}, ("c", "Q?", "Q?"), ["query_zs_expansion", "query_zs_expansion+caption"]),
        ({"query": "q"}, ("Q?", "q", "Q?"), ["query_caption", "query_zs_expansion+caption"]),
        ({}, ("Q?", "Q?", "Q?"), list(BASELINES)),
    ],
)
def test_a_missing_field_falls_back_to_the_question(parsed, queries, fallback):
    out, fell_back = baseline_queries(parsed, "Q?")
    assert tuple(out[b] for b in BASELINES) == queries and fell_back == fallback


@given(st.text(max_size=200))
def test_any_answer_gives_three_non_empty_queries(text):
    out, fell_back = baseline_queries(parse_baseline(text), "the question")
    assert set(out) == set(BASELINES) and all(out[b].strip() for b in BASELINES)
    assert all(out[b] == "the question" for b in fell_back)


def test_a_prompt_file_replaces_ours_and_is_checked(tmp_path):
    good = tmp_path / "p.yaml"
    good.write_text("system: Published wording.\nuser_template: 'Q: {question}'\n")
    assert load_prompt(str(good), {})["system"] == "Published wording."
    bad = tmp_path / "bad.yaml"
    bad.write_text("system: s\nuser_template: no placeholder\n")
    with pytest.raises(ValueError, match=r"bad.yaml: user_template lacks \{question\}"):
        load_prompt(str(bad), {})
    (tmp_path / "list.yaml").write_text("- system\n")
    with pytest.raises(ValueError, match="needs string fields 'system' and 'user_template'"):
        load_prompt(str(tmp_path / "list.yaml"), {})
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt(str(tmp_path / "none.yaml"), {})
    with pytest.raises(ValueError, match="unknown prompt 'poem': choose one of wikiseeker, toy"):
        from rl.prompts import REFINER_PROMPTS

        load_prompt("poem", REFINER_PROMPTS)


class Interrupted(Exception):
    pass


def refined_rows(tiny_world, tmp_path) -> list[dict]:
    """Six test questions with a refined query each, written to tmp_path / q.jsonl."""
    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:6]
    for r in rows:
        r["refined_query"] = r["question"] + " " + " ".join(r["attributes"].values())
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    return rows


def stand_in_vlm(calls: list, crash_at: int | None = None):
    """A VLM at the generation boundary: it sees the images and questions, answers JSON for every other question and
    junk for the rest; raises Interrupted at call ``crash_at``."""

    def vlm(images, questions):
        calls.append(questions)
        if len(calls) == crash_at:
            raise Interrupted
        assert all(im.mode == "RGB" for im in images) and len(images) == len(questions)
        return [
            json.dumps({"caption": "a creature", "query": q + " creature"}) if i % 2 else "I cannot tell."
            for i, q in enumerate(questions)
        ]

    return vlm


def test_baselines_resume_after_an_interruption_and_only_under_the_same_settings(tiny_world, tmp_path):
    """Interrupted after one batch and resumed; a resume under another prompt, backend or queries file refused."""
    rows, calls = refined_rows(tiny_world, tmp_path), []
    vlm = stand_in_vlm(calls, crash_at=2)  # the first run's second batch: a crash
    prompt = tmp_path / "p.yaml"
    prompt.write_text("system: Published wording.\nuser_template: '{question}'\n")
    args = BaselineArgs(
        model="unused",
        queries=str(tmp_path / "q.jsonl"),
        out=str(tmp_path / "b.jsonl"),
        images_root=str(tiny_world),
        batch_size=4,
        prompt_file=str(prompt),
    )
    with pytest.raises(Interrupted):
        run_baselines(args, generate=vlm, **QUIET)
    prompt.write_text("system: Edited wording.\nuser_template: '{question}'\n")  # the same file, other words
    with pytest.raises(ValueError, match="other settings .*Edited wording"):
        run_baselines(args, generate=vlm, **QUIET)
    prompt.write_text("system: Published wording.\nuser_template: '{question}'\n")
    with pytest.raises(ValueError, match=r"other settings \(backend: 'hf' then, 'vllm' now\)"):
        run_baselines(BaselineArgs(**{**vars(args), "backend": "vllm"}), generate=vlm, **QUIET)
    # the queries file made again (another refiner's refined_query): the rows written are another input's
    write_jsonl_atomic(tmp_path / "q.jsonl", [{**r, "refined_query": "another refiner"} for r in rows])
    with pytest.raises(ValueError, match=r"other settings \(queries: 'sha256:"):
        run_baselines(args, generate=vlm, **QUIET)
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    assert run_baselines(args, generate=vlm, **QUIET) == 2  # only the 2 questions the first run had not written
    assert calls[2] == [r["question"] for r in rows[4:]]
    out = list(read_jsonl(tmp_path / "b.jsonl"))
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert out[1]["query_zs_expansion+caption"] == rows[1]["question"] + " creature a creature"
    assert out[0]["baseline_fallback"] == list(BASELINES) and out[0]["query_caption"] == rows[0]["question"]


def test_every_baseline_is_a_row_of_one_table(tiny_world, tiny_index_dir, encoders, tmp_path, monkeypatch):
    """retrieval.evaluate puts the refined query and the three baselines in one table."""
    import retrieval.evaluate as ev
    from retrieval.evaluate import EvalArgs

    refined_rows(tiny_world, tmp_path)
    args = BaselineArgs(model="unused", queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "b.jsonl"))
    run_baselines(BaselineArgs(**{**vars(args), "images_root": str(tiny_world)}), generate=stand_in_vlm([]), **QUIET)
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    lines = []
    res = ev.run(
        EvalArgs(
            index=str(tiny_index_dir),
            queries=str(tmp_path / "b.jsonl"),
            alpha=0.5,
            text_field="question",
            compare="refined_query," + ",".join(BASELINES),
            images_root=str(tiny_world),
            out=str(tmp_path / "ev"),
        ),
        log=lines.append,
    )
    table = "\n".join(lines)
    for method in ("question", "refined_query", *BASELINES):
        assert f"| {method} |" in table
    assert set(res["rank_change"]) == {"refined_query", *BASELINES}
    assert (tmp_path / "ev" / "rank_change_query_zs_expansion+caption.png").exists()
    with pytest.raises(ValueError, match="given twice"):
        ev.compare_fields("a,question", "question")


def test_a_question_whose_image_cannot_be_used_falls_back_in_every_baseline(tiny_world, tmp_path):
    from tests.test_refine import unusable_images

    rows = unusable_images(tmp_path, tiny_world / next(read_jsonl(tiny_world / "test.jsonl"))["image"])
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    seen = []

    def vlm(images, questions):
        seen.extend(questions)
        return [json.dumps({"caption": "a creature", "query": q + " creature"}) for q in questions]

    args = BaselineArgs(model="unused", queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "b.jsonl"), batch_size=3)
    said = []
    assert run_baselines(args, generate=vlm, log=said.append) == 3
    assert said[1].startswith("2 question(s) fell back to their question in every baseline, their image not usable")
    assert "(cut: image unreadable" in said[1] and said[2].startswith("query baselines: 0 of 3 answer(s)")
    out = {r["id"]: r for r in read_jsonl(tmp_path / "b.jsonl")}
    assert seen == ["what is good?"] and out["good"]["query_caption"] == "a creature"
    assert "image unreadable" in out["cut"]["image_error"] and "200:1" in out["strip"]["image_error"]
    for name in ("cut", "strip"):
        assert all(out[name][b] == f"what is {name}?" for b in BASELINES)
        assert out[name]["baseline_fallback"] == list(BASELINES) and out[name]["baseline_raw"] is None
    (tmp_path / "cut.png").write_bytes((tmp_path / "good.png").read_bytes())  # mended: made again next run
    assert run_baselines(args, generate=vlm, **QUIET) == 2 and seen[1:] == ["what is cut?"]


def test_the_toy_configs_name_every_table8_row():
    from pathlib import Path

    from common.cli import parse
    from retrieval.evaluate import EvalArgs, compare_fields

    configs = Path(__file__).resolve().parent.parent / "configs"
    (args,) = parse((BaselineArgs,), ["--config", str(configs / "grpo" / "baselines_toy.yaml")])
    (table,) = parse((EvalArgs,), ["--config", str(configs / "retrieval" / "table8_toy.yaml")])
    assert table.queries == args.out and table.text_field == "question"
    assert compare_fields(table.compare, table.text_field) == ["refined_query", *BASELINES]


def test_what_baselines_refuse_record_and_say(tiny_world, tmp_path):
    """Refused before any model loads: another backend, no queries file, no --out, --out naming the queries, a row
    whose image is missing, an id given twice. Recorded beside the output: the model and its weights, the backend,
    the prompt's wording, the answer length and the input. Said: how many answers fell back for a missing field."""
    from rl.baselines import BASELINE_PROMPT

    rows = refined_rows(tiny_world, tmp_path)
    args = BaselineArgs(model=str(tmp_path / "vlm"), queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "b.jsonl"))
    never = stand_in_vlm([], crash_at=1)
    for change, message in [
        ({"backend": "tgi"}, "--backend must be one of hf, vllm, got 'tgi'"),
        ({"queries": str(tmp_path / "none.jsonl")}, "none.jsonl"),
        ({"out": None}, "--out is required"),
        ({"out": args.queries}, "--out"),
        ({"images_root": str(tmp_path)}, "image"),  # the images are under tiny_world
    ]:
        with pytest.raises(ValueError, match=message):
            run_baselines(BaselineArgs(**{**vars(args), **change}), generate=never, **QUIET)
    write_jsonl_atomic(tmp_path / "twice.jsonl", rows + rows[:1])
    with pytest.raises(ValueError, match="twice.jsonl"):
        run_baselines(
            BaselineArgs(**{**vars(args), "queries": str(tmp_path / "twice.jsonl"), "images_root": str(tiny_world)}),
            generate=never,
            **QUIET,
        )
    assert not (tmp_path / "b.jsonl").exists()

    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "model.safetensors").write_bytes(b"weights")
    said = []
    args = BaselineArgs(**{**vars(args), "images_root": str(tiny_world), "max_new_tokens": 99})
    assert run_baselines(args, generate=stand_in_vlm([]), log=said.append) == 6
    settings = json.loads((tmp_path / "b.settings.json").read_text())
    assert settings["model"] == str(tmp_path / "vlm") and settings["backend"] == "hf"
    assert settings["weights"] == weights_fingerprint(tmp_path / "vlm")
    assert settings["prompt"]["system"] == BASELINE_PROMPT["system"] and settings["max_new_tokens"] == 99
    assert settings["queries"].startswith("sha256:") and settings["images_root"] == str(tiny_world.resolve())
    assert said[0].startswith("query baselines (query_baselines), process 0/1: 0 of 6 done")
    assert said[-1].startswith("query baselines: 3 of 6 answer(s) here lacked a field and fell back to the question")
    assert run_baselines(args, log=said.append) == 0  # every question done: no model is loaded
    assert len(said) == 3 and "0 to go here" in said[-1]  # and no count of answers
