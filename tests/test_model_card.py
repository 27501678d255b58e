"""Model cards: the pure renderers (front matter, sections, figures, missing figures said plainly, never TRL's
"[None]"), table-driven, and the writers over a placeholder card. The cards written by the real training and export
runs are checked in test_train_grpo.py, test_export.py and test_gate_sft.py."""

import json
import shlex

import pytest
import yaml

from common.model_card import figures_table, format_value, front_matter, render_card, write_card
from gate.train.model_card import VARIANTS, gate_card, write_gate_cards
from gate.variants import spec
from rl.model_card import held_out, ordered_figures, refiner_card, vllm_serve_command, write_run_cards
from rl.run_record import RUN_RECORD

TRL_PLACEHOLDER = "# Model Card for run\n\nThis model is a fine-tuned version of [None](https://huggingface.co/None).\n"


def meta_of(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def assert_no_placeholder(card: str):
    assert "[None]" not in card and "None" not in card and "fine-tuned version of" not in card


@pytest.mark.parametrize(
    "value,shown",
    [
        (0.5, "0.5"),
        (1.0, "1"),
        (1 / 3, "0.3333"),
        (-2.5, "-2.5"),
        (1e-7, "0"),
        (-1e-7, "0"),
        (3, "3"),
        (None, "—"),
        (True, "yes"),
        (False, "no"),
        (float("nan"), "nan"),
        ("a|b\nc", "a\\|b c"),
        (12345.678, "12345.678"),
    ],
)
def test_format_value(value, shown):
    assert format_value(value) == shown


@pytest.mark.parametrize(
    "base,has_base", [("Qwen/Qwen2.5-VL-3B-Instruct", True), ("/runs/warm", True), (None, False), ("", False)]
)
def test_front_matter(base, has_base):
    meta = meta_of(front_matter(base, ["a", "b"]))
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "image-text-to-text"
    assert meta["tags"] == ["a", "b"]
    assert ("base_model" in meta) == has_base and (not has_base or meta["base_model"] == base)


def test_render_card_leaves_out_empty_sections():
    card = render_card("m", ["t"], "Title", [("One", "body"), ("Empty", "  "), ("Two", "more\n")])
    assert "# Title\n" in card and "## One\n\nbody\n" in card and "## Two\n\nmore\n" in card
    assert "Empty" not in card


@pytest.mark.parametrize(
    "metrics,rows",
    [
        ({"accuracy": 0.625, "n": 8}, ["| accuracy | 0.625 |", "| n | 8 |"]),
        (
            {"accuracy_by_class": {"pass": 1.0, "fail": 0.0}},
            ["| accuracy_by_class/pass | 1 |", "| accuracy_by_class/fail | 0 |"],
        ),
        ({}, ["nothing here"]),
        (None, ["nothing here"]),
    ],
)
def test_figures_table(metrics, rows):
    table = figures_table(metrics, "nothing here")
    assert all(r in table for r in rows)
    assert ("| figure | value |" in table) == bool(metrics)


def test_held_out_is_the_latest_evaluation_at_or_before_the_step():
    history = [
        {"step": 1, "loss": 0.1},
        {"step": 2, "eval_reward": 1.0, "eval_runtime": 3.0},
        {"step": 3, "reward": 2.0},
        {"step": 4, "eval_reward": 2.0},
    ]
    assert held_out(history) == {"step": 4, "eval_reward": 2.0}
    assert held_out(history, step=3) == {"step": 2, "eval_reward": 1.0, "eval_runtime": 3.0}
    assert held_out(history, step=1) == {} and held_out([]) == {}


def test_ordered_figures_reward_then_retrieval_then_terms_without_the_bookkeeping():
    figures = ordered_figures(
        {
            "step": 3,
            "eval_loss": 0.0,
            "eval_runtime": 2.4,
            "eval_clip_ratio/low_min": 0.0,
            "eval_completions/mean_length": 22.0,
            "eval_rewards/format_reward/mean": 1.0,
            "eval_retrieval/hit@10": 0.6,
            "eval_retrieval/hit@5": 0.5,
            "eval_reward_std": 1.8,
            "eval_reward": 2.0,
            "eval_retrieval/hit@1": 0.25,
        }
    )
    assert list(figures) == [
        "reward",
        "reward_std",
        "retrieval/hit@1",
        "retrieval/hit@5",
        "retrieval/hit@10",
        "rewards/format_reward/mean",
        "completions/mean_length",
    ]


def run_record(**args) -> dict:
    return {
        "base_model": "/runs/warm_start",
        "refiner_args": {
            "index": "idx",
            "alpha": 0.5,
            "eval_file": "/data/val.jsonl",
            "eval_limit": 5,
            "prompt": "toy",
            "depth": 200,
            "reward_tiers": "1-5:4,6-10:3.5,11-20:3,21-50:1,51-100:0.5,101-200:0.1",
            "miss_reward": -2.5,
            "unparseable_retrieval_reward": -3.0,
            "format_valid_reward": 1.0,
            "format_invalid_reward": -4.0,
            "max_query_tokens": 128,
        }
        | args,
        "prompt": {"name": "toy", "system": "Refine the question.", "user_template": "{question}"},
        "index": {"path": "/idx", "alpha": 0.5, "image_encoder": "tiny", "text_encoder": "minilm"},
        "generation": {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 40},
        "image_budget": {"min_pixels": 12544, "max_pixels": 12544},
        "precision": "weights in float32",
    }


EVAL = {"step": 2, "eval_reward": 2.3456789, "eval_retrieval/hit@1": 1 / 3, "eval_retrieval/miss_rate": 0.25}


@pytest.mark.parametrize(
    "record,metrics,export,present,absent",
    [
        (
            run_record(),
            EVAL,
            None,
            [
                "| 1–5 | 4 |",
                "| 101–200 | 0.1 |",
                "not found within depth 200 is a miss: -2.5",
                "parsed gets -3",
                "**Format**: 1 when",
                "at most 128 tokens, -4 otherwise",
                "| reward | 2.3457 |",
                "| retrieval/hit@1 | 0.3333 |",
                "| retrieval/miss_rate | 0.25 |",
                "evaluation at step 2",
                "`/data/val.jsonl` (the first 5)",
                "python -m rl.export --checkpoint /runs/r/final --out $SERVE_DIR",
            ],
            ["No held-out figures", "Exported from"],
        ),
        (run_record(eval_file=None, eval_limit=None), {}, None, ["No held-out figures"], ["| figure | value |"]),
        (
            run_record(reward_tiers="1-10:2,11-50:1", depth=100, miss_reward=-1.0),
            None,
            {"dtype": "float32", "source": "/runs/r/checkpoint-2"},
            [
                "| 1–10 | 2 |",
                "| 11–50 | 1 |",
                "deeper than 50, or not found within depth 100, is a miss: -1",
                "Exported from `/runs/r/checkpoint-2` in float32",
                "No held-out figures",
                "python -m rl.refine --model /runs/r/final --queries",
                "send `temperature: 0` for the greedy queries `rl.refine` writes",  # vLLM serves the run's sampling
            ],
            ["| 51–100", "python -m rl.export"],
        ),
    ],
)
def test_refiner_card(record, metrics, export, present, absent):
    card = refiner_card(record, metrics, name="r", step=2, folder="/runs/r/final", export=export)
    meta = meta_of(card)
    assert meta["base_model"] == "/runs/warm_start" and "grpo" in meta["tags"]
    for needed in [
        "`/runs/warm_start`",
        "- α (image weight of a query): 0.5",
        "- Image encoder: `tiny`",
        "- Text encoder: `minilm`",
        "- Path: `/idx`",
        '<answer>{"query": "…"}</answer>',
        "Refine the question.",
        "Training step: 2",
        "12544–12544 pixels",
        "Sampling in training: temperature 1, top-p 0.9, at most 40 new tokens.",
        "User turn (`{question}` filled in):\n\n```\n{question}\n```",
        f"# r: {'exported query refiner' if export else 'query refiner'} trained with GRPO",
        vllm_serve_command(
            "/runs/r/final" if export else "$SERVE_DIR",
            export["dtype"] if export else "bfloat16",
            record["image_budget"],
        ),
        *present,
    ]:
        assert needed in card, needed
    assert not any(a in card for a in absent), [a for a in absent if a in card]
    assert_no_placeholder(card)


OPTIMISATION = {
    "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize",
    "scale_rewards": "group",
    "num_generations": 8,
    "learning_rate": 1e-6,
    "beta": 0.0,
    "loss_type": "dapo",
    "max_steps": 300,
}


@pytest.mark.parametrize(
    "optimisation,says",
    [
        ({}, "earns the sum of two rewards (GRPO"),
        (OPTIMISATION, "earns the sum of two rewards (GRPO"),
        ({**OPTIMISATION, "reward_weights": [1.0, 1.0]}, "earns the sum of two rewards (GRPO"),
        ({**OPTIMISATION, "reward_weights": [0.5, 2.0]}, "earns a weighted sum of two rewards: 0.5 × format + 2 × "),
        (
            {**OPTIMISATION, "multi_objective_aggregation": "normalize_then_sum"},
            "each first normalised within the question's group of completions, weighted 1 (format) and 1 (retrieval)",
        ),
    ],
)
def test_the_card_says_how_trl_combined_the_rewards_and_the_updates_settings(optimisation, says):
    """TRL trains on reward_weights · rewards (or on each reward normalised per group first); the card said "the sum
    of two rewards" whatever the run's weights, and nothing of its learning rate or group size."""
    card = refiner_card(run_record() | {"optimisation": optimisation}, EVAL, name="r", step=2, folder="/f")
    assert says in card
    if optimisation:
        assert "- GRPO: 8 completions per question, learning rate 1e-06, β (KL) 0, loss `dapo`" in card
        assert "rewards scaled by `group`, max steps 300" in card
    else:
        assert "- GRPO:" not in card


def test_refiner_card_says_what_the_record_lacks():
    card = refiner_card({}, None, name="r", step=None, folder="/f")
    assert "base_model" not in meta_of(card) and "Base model: `—`" in card and "No held-out figures" in card
    assert "| 1–5 | 4 |" in card  # the default tiers
    assert_no_placeholder(card)


def gate_info(variant: str) -> dict:
    s = spec(variant)
    return {
        "variant": variant,
        "verbalisers": list(s["verbalisers"]),
        "base_model": "/models/toy-vlm",
        "prompt": {"system": s["system"], "user_template": s["user"]},
    }


BINARY_EVAL = {
    "variant": "hkb",
    "n": 8,
    "threshold": 0.5,
    "accuracy": 0.625,
    "balanced_accuracy": 0.6,
    "majority_baseline": 0.5,
    "predicted_positive_ratio": 0.375,
    "true_positive_ratio": 0.5,
}
GENERATED_EVAL = {"variant": "mct", "n": 4, "accuracy": 0.5, "parsed": 0.75, "accuracy_by_class": {"a": 1.0}}


@pytest.mark.parametrize(
    "variant,metrics,present",
    [
        (
            "hkb",
            BINARY_EVAL,
            [
                "`true` (positive: search needed) or `false` (negative)",
                "| accuracy | 0.625 |",
                "| majority_baseline | 0.5 |",
                "first_token_scores(model, processor, spec, images, questions)",
                "decisions(scores, 0.5)",
                "python -m gate.train.evaluation --model /o/hkb/final",
                "positive when it reaches the threshold γ (default 0.5).",
                "accuracy at the default threshold, next to the majority-class baseline to beat",
                "User turn (`{question}` filled in)",
            ],
        ),
        ("skb", None, ["`1`, `2`, `3`, `4`, `5`", "decisions(scores, 3)", "No held-out figures"]),
        ("kbm-cert", None, ["`unknown` (positive: search needed) or `known`", "certainty C = 1 − H/Hmax"]),
        ("ret", None, ["`Ret` (positive: retrieval needed) or `NoRet`"]),
        (
            "srt",
            None,
            [
                "`Rel` (positive: relevant) or `NoRel`",
                "questions, contexts)",
                "Context: {context}",
                "`{context}` filled",
            ],
        ),
        (
            "inspector",
            None,
            [
                '`{"pass": "true"}` (positive: pass)',
                '`{"pass": "false", "answer": "…"}`',
                'read from the first answer token after the JSON opening `{"pass": "`',
                "A failing section's own answer comes from generating and parsing the JSON.",
            ],
        ),
        (
            "mct",
            GENERATED_EVAL,
            [
                "generate_parsed(model, processor, spec",
                "| accuracy_by_class/a | 1 |",
                "| parsed | 0.75 |",
                'JSON `{"consistent": [document numbers], "summary": "…"}`, generated and parsed.',
                "accuracy of the parsed output",
            ],
        ),
        ("answer", None, ["A short answer phrase", "generate_parsed("]),
    ],
)
def test_gate_card(variant, metrics, present):
    card = gate_card(gate_info(variant), metrics, name=variant, folder=f"/o/{variant}/final")
    meta = meta_of(card)
    assert meta["base_model"] == "/models/toy-vlm" and variant in meta["tags"]
    label = VARIANTS[variant][0]
    for needed in [
        f"# {variant}: {label} gate",
        f"- Variant: `{variant}`",
        "`/models/toy-vlm`",
        f'load_gate("/o/{variant}/final"',
        spec(variant)["system"],
        *present,
    ]:
        assert needed in card, needed
    assert ("No held-out figures" in card) == (metrics is None)
    reads_a_section = variant in ("srt", "mct", "inspector", "answer")
    assert ("the question with a retrieved text as context" in card) == reads_a_section
    assert ("after the JSON opening" in card) == (variant == "inspector")
    assert "| variant |" not in card
    assert_no_placeholder(card)


@pytest.mark.parametrize(
    "training,says",
    [
        (None, "merged into the weights (settings not recorded)"),
        (
            {"freeze_vision_tower": False, "lora_r": None, "learning_rate": 1e-5, "global_step": 300},
            "vision tower trained too; every weight trained (full fine-tune); learning rate 1e-05, 300 steps",
        ),
        (
            {"freeze_vision_tower": True, "lora_r": 16, "learning_rate": 2e-4, "global_step": 12},
            "vision tower frozen; a LoRA adapter (r = 16) merged into the weights; learning rate 0.0002, 12 steps",
        ),
    ],
)
def test_the_gate_card_says_how_the_weights_were_trained(training, says):
    """The card said "vision tower frozen" also of a gate trained with freeze_vision_tower false."""
    card = gate_card(gate_info("hkb") | {"training": training}, None, name="hkb", folder="/o/hkb/final")
    assert says in card and ("vision tower frozen" in card) == (training is not None and training["lora_r"] == 16)


def test_every_variant_has_a_description():
    from gate.variants import VARIANTS as ALL

    assert set(VARIANTS) == set(ALL)


def test_write_card_replaces_a_placeholder_atomically(tmp_path):
    (tmp_path / "README.md").write_text(TRL_PLACEHOLDER)
    write_card(tmp_path, "ours\n")
    assert (tmp_path / "README.md").read_text() == "ours\n"
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]


def test_write_run_cards_over_trl_and_peft_cards(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / RUN_RECORD).write_text(json.dumps(run_record()))
    for folder in (run, run / "final"):
        (folder / "README.md").write_text(TRL_PLACEHOLDER)
    text = write_run_cards(
        run, [{"step": 1, "reward": 1.0}, {"step": 2, **{k: v for k, v in EVAL.items() if k != "step"}}]
    )
    for folder in (run, run / "final"):
        assert (folder / "README.md").read_text() == text
    assert "Training step: 2" in text and "| retrieval/hit@1 | 0.3333 |" in text
    assert f"--checkpoint {(run / 'final').resolve()}" in text


def test_a_run_that_loaded_its_best_checkpoint_names_that_step_and_its_evaluation(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / RUN_RECORD).write_text(json.dumps(run_record()))
    best = {"step": 1, "eval_retrieval/hit@1": 0.5}
    last = {"step": 3, "eval_retrieval/hit@1": 0.125}
    history = [{"step": 1, "reward": 1.0}, best, {"step": 2, "reward": 0.5}, {"step": 3, "reward": 0.2}, last]
    assert "Training step: 3" in write_run_cards(run, history) and "| retrieval/hit@1 | 0.125 |" in write_run_cards(
        run, history
    )
    text = write_run_cards(run, history, best_step=1)
    assert "Training step: 1" in text and "| retrieval/hit@1 | 0.5 |" in text


def test_write_gate_cards(tmp_path):
    (tmp_path / "hkb" / "final").mkdir(parents=True)
    (tmp_path / "hkb" / "final" / "gate.json").write_text(json.dumps(gate_info("hkb")))
    text = write_gate_cards(tmp_path / "hkb", None)
    assert (
        (tmp_path / "hkb" / "README.md").read_text() == (tmp_path / "hkb" / "final" / "README.md").read_text() == text
    )
    assert "No held-out figures" in text


def test_card_commands_keep_a_folder_with_a_space_as_one_argument():
    import shlex

    from rl.model_card import refine_command

    folder = "/tmp/my exports/refiner"
    assert shlex.split(vllm_serve_command(folder, "bfloat16", None))[2] == folder
    assert shlex.split(refine_command(folder))[4] == folder
    assert vllm_serve_command("$SERVE_DIR", "bfloat16", None).startswith("vllm serve $SERVE_DIR ")  # expands in a shell


def test_held_out_figures_of_a_record_without_its_eval_file_say_so():
    """A record without refiner_args.eval_file (an older or another tool's) put "`None`" in the card."""
    from rl.model_card import refiner_card

    card = refiner_card({}, {"step": 3, "eval_reward": 0.0}, name="r", step=3, folder="/x")
    assert "Held-out questions: (file not recorded)" in card
    assert_no_placeholder(card)


@pytest.mark.parametrize("budget", [None, {"min_pixels": 3136, "max_pixels": 12544}])
def test_the_serve_command_limits_one_image_and_carries_the_budget(budget):
    """vLLM's flags as a shell splits them: one image a prompt, and the training image budget only when there is one."""
    argv = shlex.split(vllm_serve_command("/x/serve", "bfloat16", budget))
    assert argv[:7] == ["vllm", "serve", "/x/serve", "--served-model-name", "refiner", "--dtype", "bfloat16"]
    flags = dict(zip(argv[7::2], argv[8::2]))
    assert json.loads(flags.pop("--limit-mm-per-prompt")) == {"image": 1}
    assert (json.loads(flags.pop("--mm-processor-kwargs")) if budget else None) == budget
    assert flags == {} and len(argv) % 2 == 1


def test_a_card_without_an_image_budget_names_none():
    """A run recorded without a budget (an older record) printed "Image budget: None–None pixels"."""
    record = run_record()
    del record["image_budget"]
    card = refiner_card(record, {}, name="r", step=2, folder="/runs/r/final")
    assert "Image budget" not in card and "--mm-processor-kwargs" not in card
