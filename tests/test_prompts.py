"""Prompts replaced from files: the refiner's (training data, run record, so export and rl.refine use it too) and the
pipeline generator's; each file checked for the placeholders its stage fills."""

import json
import re

import pytest

from common.prompts import load_prompt
from rl.prompts import REFINER_PROMPTS, prompt_spec


@pytest.fixture()
def refiner_prompt(tmp_path):
    path = tmp_path / "refiner.yaml"
    path.write_text("system: The published refiner prompt.\nuser_template: 'Question: {question}'\n")
    return str(path)


def test_a_refiner_prompt_file_reaches_the_training_rows(tiny_world, refiner_prompt):
    from rl.data import question_dataset

    ds = question_dataset(tiny_world / "test.jsonl", prompt=refiner_prompt, limit=2)
    first = ds[0]["prompt"]
    assert first[0] == {"role": "system", "content": "The published refiner prompt."}
    assert first[1]["content"] == f"Question: {ds[0]['question']}"


def test_the_run_record_carries_the_files_wording_for_export_and_refine(refiner_prompt):
    """rl.run_record writes prompt_spec(args.prompt), which rl.export copies into refiner.json and rl.refine reads:
    the wording itself travels with the model, not the path of a file that may not exist elsewhere."""
    spec = prompt_spec(refiner_prompt)
    assert spec == {
        "name": refiner_prompt,
        "system": "The published refiner prompt.",
        "user_template": "Question: {question}",
    }
    assert prompt_spec("wikiseeker") == {"name": "wikiseeker", **REFINER_PROMPTS["wikiseeker"]}


def test_a_generator_prompt_file_needs_context_and_question(tmp_path):
    from gate.pipeline.stages import GENERATOR_PROMPTS, generator_prompt

    good = tmp_path / "gen.yaml"
    good.write_text("system: Published.\nuser_template: '{context} Q: {question} A:'\n")
    assert generator_prompt(str(good))["user_template"] == "{context} Q: {question} A:"
    assert generator_prompt("evqa")["system"] == GENERATOR_PROMPTS["evqa"]["system"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("system: s\nuser_template: 'Q: {question}'\n")
    with pytest.raises(ValueError, match=r"--generator_prompt .*bad.yaml: user_template lacks \{context\}"):
        generator_prompt(str(bad))


def test_a_prompt_name_that_is_neither_built_in_nor_a_file_is_named():
    with pytest.raises(ValueError, match=r"--prompt: unknown prompt 'poem': choose one of wikiseeker, toy, or give"):
        load_prompt("poem", REFINER_PROMPTS)


def test_a_gate_prompt_file_renders_the_rows_and_is_recorded_beside_them(tmp_path):
    from common.files import read_jsonl, write_jsonl_atomic
    from gate.train.build_data import BuildDataArgs
    from gate.train.labelling import stage_render

    write_jsonl_atomic(
        tmp_path / "labels-inspector.jsonl",
        [
            {
                "id": "q1",
                "question": "Where?",
                "context": "A section.",
                "image_path": "/i.png",
                "variant": "inspector",
                "pass": True,
                "inspector": {"pass": "true"},
            }
        ],
    )
    good, bad = tmp_path / "inspector.yaml", tmp_path / "no-context.yaml"
    good.write_text("system: The published Inspector prompt.\nuser_template: '{context} / {question}'\n")
    bad.write_text("system: s\nuser_template: '{question}'\n")
    stage_render(
        BuildDataArgs(stage="render", out=str(tmp_path), variant="inspector", gate_prompt=str(good)),
        tmp_path,
        log=lambda *a: None,
    )
    (row,) = read_jsonl(tmp_path / "inspector.train.jsonl")
    assert row["prompt"] == [
        {"role": "system", "content": "The published Inspector prompt."},
        {"role": "user", "content": "A section. / Where?"},
    ]
    recorded = json.loads((tmp_path / "inspector.prompt.json").read_text())
    assert recorded["source"] == str(good) and recorded["user_template"] == "{context} / {question}"
    with pytest.raises(ValueError, match=r"--gate_prompt .*no-context.yaml: user_template lacks \{context\}"):
        stage_render(
            BuildDataArgs(stage="render", out=str(tmp_path), variant="inspector", gate_prompt=str(bad)),
            tmp_path,
            log=lambda *a: None,
        )


@pytest.mark.parametrize(
    "template,placeholders,allowed,error",
    [
        (
            'Reply as {"expanded_answer": "..."}. {question} {answer}',
            ("{question}", "{answer}"),
            (),
            '{"expanded_answer"',
        ),
        ('Reply as {{"expanded_answer": "..."}}. {question} {answer}', ("{question}", "{answer}"), (), None),
        ("{Title}: {text}", ("{text}",), ("title", "section_title"), "{Title}, which nothing fills"),
        ("{title} / {section_title}: {text}", ("{text}",), ("title", "section_title"), None),
        ("{question} {}", ("{question}",), (), "{}, which nothing fills"),
        ("{question} {", ("{question}",), (), "not a format string"),
        ("Q: {{question}}", ("{question}",), (), "lacks {question}"),  # a literal: the question never reaches it
        ("Q: {question:>10}", ("{question}",), (), None),  # a placeholder with a format spec fills it
    ],
)
def test_a_prompt_file_may_only_use_the_fields_its_stage_fills(tmp_path, template, placeholders, allowed, error):
    """The template is filled with str.format at the first batch: a field nothing fills (a typo, a literal JSON
    object) is refused when the file is read, naming the file and the field."""
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"system": "s", "user_template": template}))  # JSON is YAML
    if error is None:
        assert load_prompt(str(path), {}, placeholders, "--x", allowed=allowed)["user_template"] == template
    else:
        with pytest.raises(ValueError, match=f"--x {re.escape(str(path))}: .*" + re.escape(error)):
            load_prompt(str(path), {}, placeholders, "--x", allowed=allowed)


@pytest.mark.parametrize(
    "text,error",
    [
        (None, "does not exist"),
        ("- system\n- user_template\n", "needs string fields 'system' and 'user_template'"),  # a list
        ('{"system": "s"}', "needs string fields 'system' and 'user_template'"),
        ('{"user_template": "{question}"}', "needs string fields 'system' and 'user_template'"),
        ('{"system": 3, "user_template": "{question}"}', "needs string fields 'system' and 'user_template'"),
        ("system: [x\n", "not a YAML file"),  # a ValueError (the CLI's one-line error), not yaml's ParserError
        (b"system: caf\xe9\n", "not a YAML file"),  # Latin-1, not UTF-8
    ],
)
def test_a_prompt_file_without_both_texts_is_refused(tmp_path, text, error):
    path = tmp_path / "p.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=f"--x.*{re.escape(str(path))}:? .*" + re.escape(error)):
        load_prompt(str(path), {}, ("{question}",), "--x")
