"""gate/train/sft.py: two SFT steps per variant family on a tiny VLM (LoRA weights change, the vision tower does
not), the saved gate loads for scoring, and bad configs fail before any model loads."""

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from common.files import write_jsonl_atomic
from common.model_card import format_value
from gate.train.render import render_rows


def gate_records(world, n=8):
    images = sorted((world / "images").glob("*_test*.png"))[:n]
    return [
        {
            "id": f"q{i}",
            "question": "Where does this creature live?",
            "image_path": str(p),
            "search": i % 2 == 0,
            "relevant": i % 2 == 0,
            "inspector": {"pass": "true"} if i % 2 else {"pass": "false", "answer": "caves"},
            "context": "Holhol - Habitat: The Holhol lives in the mossy caves.",
            "split": "train",
        }
        for i, p in enumerate(images)
    ]


def sft_config(tmp_path, model, variant, rows, **overrides):
    data = tmp_path / f"{variant}.jsonl"
    write_jsonl_atomic(data, rows)
    cfg = dict(
        variant=variant,
        train_file=str(data),
        eval_file=str(data),
        model_name_or_path=str(model),
        use_peft=True,
        lora_r=4,
        lora_alpha=16,
        lora_target_modules=["q_proj", "k_proj", "v_proj"],
        output_dir=str(tmp_path / f"{variant}"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=5e-2,
        max_length=None,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    cfg.update(overrides)
    path = tmp_path / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# boundary, token system, Inspector; the vision tower's MLPs share names with the language model's (gate/up/down)
@pytest.mark.parametrize(
    "variant,targets",
    [("hkb", ["q_proj", "k_proj", "v_proj"]), ("srt", ALL_LINEAR), ("inspector", ["q_proj", "k_proj", "v_proj"])],
)
def test_two_sft_steps_change_lora_weights_not_the_vision_tower(
    variant, targets, tiny_world, tiny_gate_vlm, tmp_path, monkeypatch
):
    from gate.scoring import load_gate
    from gate.train.sft import main

    rows = render_rows(variant, gate_records(tiny_world))
    wandb = {"report_to": ["wandb"]} if variant == "srt" else {}  # as configs/sft/paper.yaml: its run in output_dir
    if wandb:
        monkeypatch.delenv("WANDB_DIR", raising=False)
        (tmp_path / "cwd").mkdir()
        monkeypatch.chdir(tmp_path / "cwd")
    result = main(sft_config(tmp_path, tiny_gate_vlm, variant, rows, lora_target_modules=targets, **wandb))
    if wandb:
        import wandb as wandb_lib

        wandb_lib.finish()  # transformers leaves its run open for the process's exit
        wandb_lib.teardown()  # its service process gone: every file it writes is complete
        assert len(list((tmp_path / variant / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
        assert not list((tmp_path / "cwd").iterdir())  # not ./wandb where the job was started
    base = load_file(str(tiny_gate_vlm / "model.safetensors"))
    tuned = load_file(str(tmp_path / variant / "final" / "model.safetensors"))
    assert base.keys() == tuned.keys()
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed and all(any(p in k for p in targets) for k in changed)
    assert {p for p in targets if any(p in k for k in changed)} == set(targets)
    assert not any("visual" in k for k in changed)
    info = json.loads((tmp_path / variant / "final" / "gate.json").read_text())
    assert info["variant"] == variant
    tokenizer = AutoTokenizer.from_pretrained(tiny_gate_vlm)
    lengths = [len(tokenizer(r["completion"][-1]["content"], add_special_tokens=False)["input_ids"]) for r in rows]
    assert info["longest_completion_tokens"] == max(lengths)  # how long a reply the gate generates (gate.scoring)
    metrics = result["eval"]
    assert metrics["n"] == len(rows) and 0.0 <= metrics["accuracy"] <= 1.0
    model, processor, s = load_gate(tmp_path / variant / "final")
    assert s["name"] == variant and not model.training
    if variant == "hkb":  # held-out scoring (python -m gate.train.evaluation) on the device and dtype it is given
        import gate.scoring
        from gate.train.evaluation import ScoringArgs, score_file

        loads = []
        real = gate.scoring.load_model
        monkeypatch.setattr(gate.scoring, "load_model", lambda *a, **k: loads.append(k) or real(*a, **k))
        scored = score_file(
            ScoringArgs(
                model=str(tmp_path / variant / "final"),
                data=str(tmp_path / f"{variant}.jsonl"),
                out=str(tmp_path / "scored"),
                device="cpu",
                dtype="bfloat16",
            ),
            log=lambda *a: None,
        )
        assert loads == [{"dtype": "bfloat16", "device": "cpu"}] and scored["n"] == len(rows)
    # the gate's model card (gate.train.model_card) in final/ and the output dir, with the held-out figures
    card = (tmp_path / variant / "final" / "README.md").read_text()
    assert card == (tmp_path / variant / "README.md").read_text() and "[None]" not in card
    assert yaml.safe_load(card.split("---\n")[1])["base_model"] == str(tiny_gate_vlm)
    assert f"- Variant: `{variant}`" in card and all(f"`{v}`" in card or f'"{v}"' in card for v in s["verbalisers"])
    assert f"| accuracy | {format_value(metrics['accuracy'])} |" in card and "load_gate(" in card
    assert "vision tower frozen; a LoRA adapter (r = 4) merged into the weights; learning rate 0.05, 2 steps" in card


@pytest.mark.parametrize(
    "variant,overrides,rows_of,match",
    [
        ("nope", {}, "hkb", "--variant: 'nope' is not one of hkb, skb"),
        (None, {}, "hkb", "--variant is required"),
        ("hkb", {"train_file": "/none.jsonl"}, "hkb", "--train_file"),
        ("hkb", {}, "one-class", "has no example"),
        ("hkb", {"verbalisers": ["Y", "N"]}, "hkb", "not verbalisers of hkb"),
        ("hkb", {"max_length": 1024}, "hkb", "max_length 1024: TRL cuts each example's end"),  # TRL's default
        ("hkb", {"completion_only_loss": False}, "hkb", "loss on the prompt and its image tokens too"),
        ("hkb", {"load_in_4bit": True}, "hkb", "quantised loading .* is not supported"),  # was parsed, then ignored
        ("hkb", {"model_revision": "abc123"}, "hkb", "model_revision 'abc123' is not applied here"),
        ("hkb", {}, "labels", ':1 lacks "prompt": not a rendered file'),  # was "no image file", naming a row
    ],
)
def test_bad_configs_fail_before_a_model_loads(variant, overrides, rows_of, match, tiny_world, tmp_path):
    from gate.train.sft import main

    recs = gate_records(tiny_world)
    if rows_of == "one-class":
        recs = [{**r, "search": True} for r in recs]
    rows = recs if rows_of == "labels" else render_rows("hkb", recs)
    argv = sft_config(tmp_path, "/no/such/model", variant, rows, **overrides)
    with pytest.raises(ValueError, match=match):
        main(argv)


@pytest.mark.parametrize(
    "rows_of,said",
    [
        ("empty", "{data} has no rows"),  # its metrics were NaN, written over an earlier run's
        ("labels", '{data}:1 lacks "prompt": not a rendered file (python -m gate.train.build_data --stage render'),
        ("rendered, an image gone", "{data}: 1 row(s) have no image file (first: ['q0'])"),
    ],
)
def test_held_out_scoring_refuses_rows_it_cannot_score_before_the_gate_loads(
    rows_of, said, tiny_world, tmp_path, monkeypatch
):
    import gate.train.evaluation as evaluation

    monkeypatch.setattr(evaluation, "load_gate", lambda *a, **k: pytest.fail("the gate was loaded"))
    recs = gate_records(tiny_world)
    rows = {"empty": [], "labels": recs, "rendered, an image gone": render_rows("hkb", recs)}[rows_of]
    if rows_of.endswith("gone"):
        rows[0]["image"] = str(tmp_path / "gone.png")
    data = tmp_path / "hkb.test.jsonl"
    write_jsonl_atomic(data, rows)
    earlier = tmp_path / "scored" / "metrics.json"
    earlier.parent.mkdir()
    earlier.write_text('{"accuracy": 0.8}')
    with pytest.raises(ValueError, match=re.escape(said.format(data=data))):
        evaluation.score_file(evaluation.ScoringArgs(model="gate", data=str(data), out=str(earlier.parent)))
    assert earlier.read_text() == '{"accuracy": 0.8}'


def test_verbalisers_that_start_with_one_token_are_refused(tiny_world, tiny_refiner, tmp_path):
    from gate.train.sft import main

    rows = render_rows("hkb", gate_records(tiny_world), verbalisers=["true", "trust"])  # t r u e, t r u st
    argv = sft_config(tmp_path, tiny_refiner, "hkb", rows, verbalisers=["true", "trust"])
    with pytest.raises(ValueError, match="start with different tokens"):
        main(argv)


def test_a_full_fine_tune_asked_in_bf16_keeps_fp32_master_weights(tiny_world, tiny_gate_vlm, tmp_path, capsys):
    """As for GRPO (rl.model.master_dtype): full fine-tuning with dtype bfloat16 and no DeepSpeed loads fp32 weights,
    so one step at lr 1e-6 moves most of them (bf16 weights would round such updates away)."""
    from safetensors.torch import load_file

    from gate.train.sft import main

    argv = sft_config(
        tmp_path,
        tiny_gate_vlm,
        "hkb",
        render_rows("hkb", gate_records(tiny_world)),
        use_peft=False,
        dtype="bfloat16",
        learning_rate=1e-6,
        max_steps=1,
        lr_scheduler_type="constant",
    )
    main(argv)
    load = lambda folder: {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}  # noqa: E731
    before, after = load(tiny_gate_vlm), load(tmp_path / "hkb" / "final")
    assert all(v.dtype == torch.float32 for v in after.values())
    text = [k for k in before if "visual" not in k and k in after]
    moved = sum(int((before[k].float() != after[k].float()).sum()) for k in text) / sum(before[k].numel() for k in text)
    assert moved > 0.5, moved
    assert "fp32 master weights" in capsys.readouterr().out


def test_the_rendered_verbalisers_are_trained_in_their_order(tiny_world, tmp_path):
    """The rows hold the classes as a set: ``--verbalisers false true`` on rows rendered with ``true false`` trained
    a gate whose first verbaliser (the positive score) meant "no search", and its held-out check, parsed with the same
    reversed words, hid it. The render's record (``<variant>.prompt.json``) decides; other ones are refused."""
    from common.files import write_json_atomic
    from gate.train.sft import main, parse_args, validate
    from gate.variants import prompt_file_for, spec

    recs = gate_records(tiny_world)
    rendered = {"system": spec("hkb")["system"], "user_template": spec("hkb")["user"], "source": "built-in"}
    write_json_atomic(prompt_file_for(tmp_path, "hkb"), {**rendered, "verbalisers": ["true", "false"]})
    argv = sft_config(tmp_path, "/no/such/model", "hkb", render_rows("hkb", recs), verbalisers=["false", "true"])
    with pytest.raises(ValueError, match=r"--verbalisers \['false', 'true'\]: .* rendered with \['true', 'false'\]"):
        main(argv)
    # rows rendered with other words: taken from the record when none are given
    write_json_atomic(prompt_file_for(tmp_path, "hkb"), {**rendered, "verbalisers": ["yes", "no"]})
    argv = sft_config(tmp_path, "/no/such/model", "hkb", render_rows("hkb", recs, verbalisers=["yes", "no"]))
    args, training_args, model_args = parse_args(argv)
    validate(args, training_args, model_args)
    assert args.verbalisers == ["yes", "no"]


def test_render_records_the_verbalisers_in_order(tmp_path):
    from common.files import write_jsonl_atomic as write
    from gate.train.build_data import BuildDataArgs
    from gate.train.labelling import stage_render
    from gate.variants import prompt_file_for

    write(tmp_path / "labels-hkb.jsonl", [{"id": "q0", "question": "Q?", "image_path": "x.png", "search": True}])
    args = BuildDataArgs(stage="render", variant="hkb", verbalisers=["no", "yes"])
    stage_render(args, tmp_path, log=lambda *a: None)
    assert json.loads(prompt_file_for(tmp_path, "hkb").read_text())["verbalisers"] == ["no", "yes"]


def test_held_out_rows_the_gate_cannot_read_are_refused_before_a_model_loads(tiny_world, tmp_path):
    """An eval_file rendered for another variant or with other verbalisers was read only after training, when the
    held-out check raised: the run's evaluation and its card were lost after the whole training."""
    from gate.train.sft import main

    recs = gate_records(tiny_world)
    other = tmp_path / "kbm-acc.test.jsonl"
    write_jsonl_atomic(other, render_rows("kbm-acc", recs))  # unknown / known
    argv = sft_config(tmp_path, "/no/such/model", "hkb", render_rows("hkb", recs), eval_file=str(other))
    with pytest.raises(
        ValueError, match=r"8 of 8 rows have a completion the hkb gate cannot read .* row q0, 'unknown'"
    ):
        main(argv)


def rendered(variant, labels, **kw):
    key = {"srt": "relevant", "skb": "search_score"}.get(variant, "search")
    recs = [
        {
            "id": f"q{i}",
            "question": "Q?",
            "image_path": "/x.png",
            "context": "c",
            key: v,
            "inspector": {"pass": "true"} if v else {"pass": "false", "answer": "a"},
        }
        for i, v in enumerate(labels)
    ]
    return render_rows(variant, recs, **kw)


@pytest.mark.parametrize(
    "variant,labels,kw,said",
    [
        ("hkb", [True, False, True], {}, {"false": 1, "true": 2}),
        ("inspector", [True, False], {}, {"fail": 1, "pass": 1}),
        ("srt", [True, False], {"verbalisers": ["yes", "no"]}, {"no": 1, "yes": 1}),
        ("hkb", [True, True], {}, "class \\['false'\\] has no example"),
        ("inspector", [False], {}, "class \\['pass'\\] has no example"),
        ("hkb", [True, True], {"allow_single_class": True}, {"true": 2}),
        ("skb", [1.0, 5.0, 5.0], {}, {"1": 1, "5": 2}),  # digits: no two classes to check
        ("hkb", [True, False], {"rows_with": ["yes", "no"]}, "classes \\['no', 'yes'\\] are not verbalisers of hkb"),
    ],
)
def test_the_class_balance_is_checked_before_a_model_loads(variant, labels, kw, said):
    from gate.train.sft import GateArguments, check_balance

    rows = rendered(variant, labels, verbalisers=kw.get("rows_with", kw.get("verbalisers")))
    args = GateArguments(
        variant=variant,
        train_file="t.jsonl",
        verbalisers=kw.get("verbalisers"),
        allow_single_class=bool(kw.get("allow_single_class")),
    )
    lines = []
    if isinstance(said, str):
        with pytest.raises(ValueError, match=said):
            check_balance(args, rows, log=lines.append)
    else:
        assert check_balance(args, rows, log=lines.append) == said
        assert lines[0].startswith(f"{variant} training data: {len(rows)} rows; classes ")


@pytest.mark.parametrize(
    "recorded,given,taken",
    [
        (None, None, None),  # rows rendered before the record existed
        (["true", "false"], None, ["true", "false"]),
        (["yes", "no"], ["yes", "no"], ["yes", "no"]),
        (["true", "false"], ["false", "true"], "--verbalisers \\['false', 'true'\\]: .* rendered with"),
        (["true", "false"], ["yes", "no"], "in that order; give those or none"),
    ],
)
def test_the_verbalisers_come_from_the_renders_record(recorded, given, taken, tmp_path):
    from common.files import write_json_atomic
    from gate.train.sft import GateArguments, rendered_verbalisers
    from gate.variants import prompt_file_for

    if recorded is not None:
        write_json_atomic(
            prompt_file_for(tmp_path, "hkb"), {"system": "s", "user_template": "{question}", "verbalisers": recorded}
        )
    args = GateArguments(variant="hkb", train_file=str(tmp_path / "hkb.train.jsonl"), verbalisers=given)
    if isinstance(taken, str):
        with pytest.raises(ValueError, match=taken):
            rendered_verbalisers(args)
    else:
        rendered_verbalisers(args)
        assert args.verbalisers == taken


@pytest.mark.parametrize(
    "given,filled",
    [
        (
            {"variant": "srt", "dataset": "evqa", "train_file": "d/{dataset}/{variant}.train.jsonl"},
            {"train_file": "d/evqa/srt.train.jsonl", "eval_file": None, "output_dir": "o/{x}", "run_name": None},
        ),
        (
            {
                "variant": "hkb",
                "eval_file": "{variant}.test.jsonl",
                "output_dir": "o/{variant}",
                "run_name": "r-{variant}",
            },
            {"train_file": None, "eval_file": "hkb.test.jsonl", "output_dir": "o/hkb", "run_name": "r-hkb"},
        ),
        ({"variant": "hkb", "train_file": "d/{dataset}/t.jsonl"}, "--train_file 'd/{dataset}/t.jsonl' holds {dataset}"),
        ({"output_dir": "o/{variant}"}, "--output_dir 'o/{variant}' holds {variant}: give --variant"),
        ({"variant": "hkb", "dataset": "../x"}, "--dataset must be a plain name"),
    ],
)
def test_fill_placeholders(given, filled):
    from types import SimpleNamespace

    from gate.train.sft import GateArguments, fill_placeholders

    args = GateArguments(**{k: v for k, v in given.items() if k not in ("output_dir", "run_name")})
    training = SimpleNamespace(output_dir=given.get("output_dir", "o/{x}"), run_name=given.get("run_name"))
    if isinstance(filled, str):
        with pytest.raises(ValueError, match=re.escape(filled)):
            fill_placeholders(args, training)
        return
    fill_placeholders(args, training)
    got = {"train_file": args.train_file, "eval_file": args.eval_file, **vars(training)}
    assert got == filled
