"""The GRPO entry point on tiny models: it trains (weights move, the vision tower does not), logs the reward
metrics, resumes from a checkpoint, and refuses bad settings before loading any model."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import rl.train_grpo as tg
from common.files import read_jsonl, write_jsonl_atomic
from common.model_card import format_value


def weights(folder):
    files = sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def our_card(folder, base_model) -> str:
    """folder/README.md is our refiner card (rl.model_card), not TRL's or PEFT's placeholder."""
    card = (folder / "README.md").read_text()
    assert "[None]" not in card and "fine-tuned version of" not in card
    assert yaml.safe_load(card.split("---\n")[1])["base_model"] == str(base_model.resolve())
    assert f"Base model: `{base_model.resolve()}`" in card and "- α (image weight of a query): 0.5" in card
    return card


def test_two_steps_train_the_text_model_not_the_vision_tower(config, tiny_refiner, tmp_path):
    result = tg.main(config())
    before, after = weights(tiny_refiner), weights(tmp_path / "run" / "final")
    vision = [k for k in before if k.startswith("visual.") or ".visual." in k]
    text = [k for k in before if k not in vision]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.allclose(before[k], after[k]) for k in text)
    logs = [h for h in result["log_history"] if "reward" in h]
    assert len(logs) == 2
    for key in [
        "rewards/format_reward/mean",
        "rewards/retrieval_reward/mean",
        "retrieval/hit@1",
        "retrieval/hit@200",
        "retrieval/miss_rate",
        "retrieval/parse_rate",
        "retrieval/same_as_question",
    ]:
        assert all(key in h for h in logs), key
    assert all(-6.5 <= h["reward"] <= 5.0 for h in logs)
    # our completions table rows and the end-of-run files
    samples = [json.loads(x) for x in open(tmp_path / "run" / "samples.jsonl", encoding="utf-8")]
    assert samples and {"query", "rank", "top3", "format_reward", "retrieval_reward", "gold_title"} <= set(samples[0])
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 < metrics["reward_time_share"] < 1


def test_lora_trains_adapters_only(config, tiny_refiner, tmp_path):
    tg.main(config(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], learning_rate=1e-2))
    adapter = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter) and not any("visual." in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it moved
    assert "No held-out figures" in our_card(tmp_path / "run" / "final", tiny_refiner)  # over PEFT's adapter card


def test_resume_continues_from_the_saved_step(config, tiny_world, tiny_refiner, tmp_path):
    """Six questions, two a step: epoch 0 is steps 1–3, epoch 1 steps 4–6. Resuming from checkpoint-4 runs only
    step 5, on the same prompts as the uninterrupted run's step 5 (TRL's sampler drew epoch 0's order again in a
    resumed epoch 1: rl.checkpoints.seed_each_epoch), from checkpoint-4's weights (transformers 5.24's own load matched
    no key of a Qwen2.5-VL checkpoint: rl/checkpoints.py), and ends on the uninterrupted run's weights."""
    six = tmp_path / "six.jsonl"
    six.write_text("".join(open(tiny_world / "train.jsonl", encoding="utf-8").readlines()[:6]))
    run = dict(train_file=str(six), images_root=str(tiny_world), max_steps=5, save_strategy="steps", save_steps=4)
    full = tg.main(config(**run, output_dir=str(tmp_path / "a")))
    resumed = tg.main(
        config(**run, output_dir=str(tmp_path / "b"), resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    )
    assert [h["step"] for h in full["log_history"] if "reward" in h] == [1, 2, 3, 4, 5]
    assert [h["step"] for h in resumed["log_history"] if "reward" in h][-1] == 5

    def prompts_at(folder):
        by_step = {}
        for rec in map(json.loads, open(folder / "samples.jsonl", encoding="utf-8")):
            by_step.setdefault(rec["step"], []).append(rec["id"])
        return by_step

    a, b = prompts_at(tmp_path / "a"), prompts_at(tmp_path / "b")
    assert set(b) == {5} and b[5] == a[5]  # only step 5 ran again, with the same data order
    assert {json.loads(x)["id"] for x in open(six, encoding="utf-8")} == set(
        a[1] + a[2] + a[3]
    )  # epoch 0: each question once
    assert a[2] != a[5]  # epoch 1's second step is not epoch 0's (what the resumed run trained on)
    base, checkpoint = weights(tiny_refiner), weights(tmp_path / "a" / "checkpoint-4")
    uninterrupted, resumed_final = weights(tmp_path / "a" / "final"), weights(tmp_path / "b" / "final")
    moved = [k for k in checkpoint if not torch.equal(checkpoint[k], base[k])]
    assert moved and all(torch.allclose(resumed_final[k], uninterrupted[k], atol=1e-6) for k in uninterrupted)
    # under another α and other reward tiers: refused, naming them (it went on, and the record told only the new ones)
    with pytest.raises(ValueError, match=r"other settings \(--alpha: 0.5 → 0.1; --reward_tiers: .*→ '1-5:1,6-200:0.5'"):
        tg.main(
            config(
                **run,
                alpha=0.1,
                reward_tiers="1-5:1,6-200:0.5",
                output_dir=str(tmp_path / "c"),
                resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"),
            )
        )


def test_a_run_resumed_in_place_logs_each_step_once_and_another_run_there_is_refused(config, tmp_path):
    """Resumed from its own checkpoint-1, a run redoes step 2: its completions were appended beside the interrupted
    run's (16 records for step 2 in the completions log and samples.jsonl). A new run into a folder holding another
    run's checkpoints replaced them, final/ and its metrics without a word."""
    out = tmp_path / "a"
    run = dict(output_dir=str(out), max_steps=2, save_strategy="steps", save_steps=1, completions_log=True)

    def steps(name):
        return Counter(json.loads(x)["step"] for x in open(out / name, encoding="utf-8"))

    tg.main(config(**run))
    first = steps("completions.rank0.jsonl"), steps("samples.jsonl")
    assert first[0] == {1: 8, 2: 8} and set(first[1]) == {1, 2}
    tg.main(config(**run, resume_from_checkpoint=str(out / "checkpoint-1")))
    assert (steps("completions.rank0.jsonl"), steps("samples.jsonl")) == first
    for other, named in ((dict(alpha=0.1), "--alpha: 0.5 → 0.1"), (dict(seed=1), "--seed: 0 → 1")):
        said = f"--output_dir {out} holds another run ({named}): a new run would replace its checkpoint-2, final, "
        with pytest.raises(ValueError, match=re.escape(said) + f".*resume it .*{out / 'checkpoint-2'}"):
            tg.main(config(**run, **other))
    assert (out / "checkpoint-2").is_dir() and (steps("completions.rank0.jsonl"), steps("samples.jsonl")) == first


def test_what_a_new_run_may_replace_and_what_a_resume_keeps_of_the_logs(tmp_path):
    """A run that stopped before its first checkpoint (out of memory in step 1) left only its record: trying again
    under other settings was refused. A resume reads past a line a killed run cut short."""
    from rl.run_record import RUN_RECORD, check_output_dir, trim_run_logs

    record = {
        "refiner_args": {"alpha": 0.5},
        "index": {},
        "optimisation": {"max_steps": 2},
        "seed": 0,
        "base_model": "/m/3B",
    }
    (tmp_path / RUN_RECORD).write_text(json.dumps(record))
    check_output_dir(tmp_path, {**record, "refiner_args": {"alpha": 0.1}})  # nothing trained there yet
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
    check_output_dir(tmp_path, record)  # the same run again
    with pytest.raises(ValueError, match=r"another run \(base model: '/m/3B' → '/m/7B'\)"):
        check_output_dir(tmp_path, {**record, "base_model": "/m/7B"})
    (tmp_path / "checkpoint-notes.txt").write_text("not a checkpoint")
    (tmp_path / "checkpoint-9").write_text("a file, not a checkpoint")
    (tmp_path / "checkpoint-old").mkdir()  # nor a folder without a step in its name
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"glo')  # a save a kill cut short
    with pytest.raises(ValueError, match=r"checkpoint-1, checkpoint-2\. .*resume it .*checkpoint-1\)$"):
        check_output_dir(tmp_path, {**record, "seed": 1})
    log = tmp_path / "completions.rank0.jsonl"
    log.write_text(
        '{"step": 1, "q": "a"}\n{"step": 2, "q": "b"\n{"step": 1, "q": "c"}\n{"step": 2, "q": "d"}\n'
        '{"step": null, "q": "e"}\n{"q": "f"}\n'
    )
    kept = log.read_text()
    (tmp_path / "checkpoint-3").mkdir()  # no trainer_state.json: its step is unknown, the logs stay as they are
    trim_run_logs(tmp_path, tmp_path / "checkpoint-3")
    assert log.read_text() == kept
    trim_run_logs(tmp_path, tmp_path / "checkpoint-1")
    assert [r["q"] for r in read_jsonl(log)] == ["a", "c", "f"]
    trim_run_logs(tmp_path)  # a new run: its logs start afresh
    assert not log.exists()


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(per_device_train_batch_size=6), "num_generations"),
        (dict(alpha=1.5), "alpha"),
        (dict(prompt="nope"), "unknown prompt"),
        (dict(reward_tiers="1-5:4,7-10:3"), "contiguous"),
        (dict(reward_tiers="1-5:1,6-10:3"), "must not increase"),
        (dict(reward_tiers="1-100:1,101-500:0.1"), "reaches rank 500, deeper than --depth 200"),  # ranks > 200: misses
        (dict(index="/does/not/exist"), "--index"),
        (dict(train_file="/does/not/exist.jsonl"), "--train_file"),
        (dict(generation_kwargs={"top_k": 5}), "generation_kwargs .* the export"),  # not carried to the export
        (dict(format_invalid_reward=float("nan")), "--format_invalid_reward must be a finite number"),
        (dict(max_query_tokens=0), "--max_query_tokens must be positive"),  # every completion would be invalid
        (dict(eval_limit=0), "--eval_limit must be positive"),  # 0 kept every question, -5 kept one
        (dict(load_in_8bit=True), "quantised loading .* is not supported"),  # parsed, then ignored
        (dict(model_revision="v2"), "model_revision 'v2' is not applied here"),
        (dict(chat_template_kwargs={"add_vision_id": True}), "chat_template_kwargs .* do not carry it"),  # a prompt
        (dict(vllm_structured_outputs_regex="<answer>.*"), "vllm_structured_outputs_regex .* do not carry it"),
        # the best checkpoint by GRPO's eval loss, or by a miss rate in the direction transformers guesses
        (dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"), "lowest GRPO eval loss"),
        (
            dict(metric_for_best_model="retrieval/miss_rate"),
            "retrieval/miss_rate with greater_is_better True: .* the most of it; set greater_is_better false",
        ),
        (dict(metric_for_best_model="retrieval/hit@1", greater_is_better=False), "the least of it"),
        # a checkpoint inside one of TRL's generations: a resume from it would generate that batch again
        (
            dict(steps_per_generation=2, save_strategy="steps", save_steps=3),
            r"save_steps: step 3 \(3 micro-batches .*one every 2 micro-batches.* every multiple of 2 steps",
        ),
        (
            dict(
                num_iterations=2,
                gradient_accumulation_steps=2,
                per_device_train_batch_size=4,
                save_strategy="steps",
                save_steps=3,
            ),
            r"save_steps: step 3 \(6 micro-batches.*one every 4 micro-batches.* every multiple of 2 steps",
        ),
    ],
)
def test_bad_settings_fail_before_any_model_loads(config, monkeypatch, overrides, match):

    monkeypatch.setattr("rl.trainer_parts.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=match):
        tg.main(config(**overrides))


def test_held_out_eval_selects_the_best_checkpoint(config, tiny_world, tiny_refiner, tmp_path):
    """The eval split is scored with the same reward, its metrics are exact means over every eval completion (not
    means of batch means: 5 questions × 4 generations in batches of 8, 8 and 4), and metric_for_best_model can
    pick by held-out hit@1."""
    result = tg.main(
        config(
            eval_file=str(tiny_world / "val.jsonl"),
            eval_limit=5,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            per_device_eval_batch_size=8,
            metric_for_best_model="retrieval/hit@1",
            load_best_model_at_end=True,
            completions_log=True,
        )
    )
    evals = [h for h in result["log_history"] if "eval_retrieval/hit@1" in h]
    assert len(evals) == 2 and all(0 <= h["eval_retrieval/hit@1"] <= 1 for h in evals)
    scored = [
        r
        for r in map(json.loads, open(tmp_path / "run" / "completions.rank0.jsonl", encoding="utf-8"))
        if r["mode"] == "eval"
    ]
    assert [h["step"] for h in evals] == [1, 2]  # evaluations after steps 1 and 2
    for logged in evals:  # the completions log numbers an evaluation's completions as log_history does
        ranks = [r["rank"] for r in scored if r["step"] == logged["step"]]
        hits = [r for r in ranks if r is not None]
        assert len(ranks) == 20
        assert logged["eval_retrieval/hit@1"] == pytest.approx(sum(r == 1 for r in hits) / 20)
        assert logged["eval_retrieval/miss_rate"] == pytest.approx(1 - len(hits) / 20)
        if hits:
            assert logged["eval_retrieval/mean_hit_rank"] == pytest.approx(sum(hits) / len(hits))
        # TRL's own reward figures too (each was a mean of the three batches' means): a parsed query paid the
        # format reward's +1, an unparsed one -4 (the completions log's query is None where the cap refused it)
        retrieval = [r["reward"] for r in scored if r["step"] == logged["step"]]
        fmt = [1.0 if r["query"] is not None else -4.0 for r in scored if r["step"] == logged["step"]]
        assert logged["eval_rewards/retrieval_reward/mean"] == pytest.approx(sum(retrieval) / 20)
        assert logged["eval_rewards/format_reward/mean"] == pytest.approx(sum(fmt) / 20)
        assert logged["eval_reward"] == pytest.approx((sum(retrieval) + sum(fmt)) / 20)
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["best_metric"] == pytest.approx(max(h["eval_retrieval/hit@1"] for h in evals))
    assert state["best_model_checkpoint"].endswith(("checkpoint-1", "checkpoint-2"))
    # final/ holds the best checkpoint's weights (loaded through rl/checkpoints.py), and its card says so
    best = tmp_path / "run" / Path(state["best_model_checkpoint"]).name
    final = weights(tmp_path / "run" / "final")
    assert all(torch.equal(final[k], v) for k, v in weights(best).items())
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    step = int(best.name.rsplit("-", 1)[1])
    assert f"Training step: {step}" in card
    assert json.loads((tmp_path / "run" / "final" / "trainer_state.json").read_text())["global_step"] == step
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["eval_reward_seconds"] > 0 and 0 < metrics["reward_time_share"] < 1  # evaluation counted apart
    # our card, over the one TRL wrote into the output dir at each checkpoint, with the last held-out figures
    card = our_card(tmp_path / "run", tiny_refiner)
    assert card == our_card(tmp_path / "run" / "final", tiny_refiner)
    assert f"| retrieval/hit@1 | {format_value(evals[-1]['eval_retrieval/hit@1'])} |" in card


@pytest.mark.parametrize(
    "hits,expected",
    [
        ({50: 0.9, 100: 0.5, 150: 0.6, 200: 0.4}, None),  # best at 50, never saved: the last step's weights
        ({50: 0.1, 100: 0.5, 150: 0.6, 200: 0.4}, 100),  # best at 150, never saved: checkpoint-100 is loaded
        ({50: 0.1, 100: 0.5, 150: 0.2, 200: 0.7}, 200),
    ],
)
def test_the_step_of_finals_weights_is_the_checkpoint_the_trainer_loads(hits, expected, tmp_path):
    """transformers' own best-model bookkeeping, evaluating every 50 steps and saving every 100 (allowed with
    load_best_model_at_end): ``best_global_step`` follows the best evaluation, saved or not; the weights come from
    ``best_model_checkpoint``, and the step train_grpo records for final/ is that checkpoint's."""
    from transformers import Trainer, TrainingArguments

    from rl.checkpoints import best_weights_step

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    args = TrainingArguments(
        output_dir=str(tmp_path),
        eval_strategy="steps",
        eval_steps=50,
        save_strategy="steps",
        save_steps=100,
        load_best_model_at_end=True,
        metric_for_best_model="retrieval/hit@1",
        use_cpu=True,
        report_to=[],
        max_steps=200,
    )
    trainer = Trainer(model=Tiny(), args=args, eval_dataset=[{}])
    trainer.create_optimizer_and_scheduler(num_training_steps=200)
    for step, hit in hits.items():
        trainer.state.global_step = step
        trainer._determine_best_metric({"eval_retrieval/hit@1": hit}, None)
        if step % 100 == 0:
            trainer._save_checkpoint(trainer.model, None)
    assert best_weights_step(trainer.state, True) == expected and best_weights_step(trainer.state, False) is None
    loaded = trainer.state.best_model_checkpoint  # what Trainer._load_best_model reads, when set
    assert (Path(loaded).name if loaded else None) == (f"checkpoint-{expected}" if expected else None)


@pytest.mark.parametrize(
    "requested,peft,stage,mixed,loaded,said",
    [
        ("bfloat16", False, None, "bf16", "float32", "full fine-tuning outside DeepSpeed: fp32 master weights"),
        ("float16", False, None, "fp16", "float32", "autocast"),
        (
            "bfloat16",
            True,
            None,
            "bf16",
            "bfloat16",
            "frozen; LoRA adapters in float32 (PEFT's autocast_adapter_dtype)",
        ),
        (
            "bfloat16",
            True,
            3,
            "bf16",
            "bfloat16",
            "LoRA adapters in bfloat16 (TRL: autocast_adapter_dtype=False under "
            "ZeRO-3); DeepSpeed keeps fp32 master copies (mixed precision)",
        ),
        # no mixed precision: zero.Init makes every parameter fp32 whatever was asked (the CPU configs; tested for real
        # in test_deepspeed.py)
        (
            "bfloat16",
            True,
            3,
            None,
            "float32",
            "weights in float32, frozen (ZeRO-3's partitioned init casts every "
            "parameter to float32, not the bfloat16 asked for); LoRA adapters in "
            "float32 (TRL",
        ),
        (
            "bfloat16",
            True,
            2,
            "bf16",
            "bfloat16",
            "LoRA adapters cast to bf16 by DeepSpeed; DeepSpeed ZeRO-2 keeps fp32 master copies",
        ),
        (
            "bfloat16",
            False,
            3,
            "bf16",
            "bfloat16",
            "weights in bfloat16 (ZeRO-3's partitioned init casts every parameter "
            "to bfloat16); DeepSpeed keeps fp32 master copies",
        ),
        ("bfloat16", False, 2, None, "float32", "under DeepSpeed ZeRO-2 without mixed precision: fp32 master weights"),
        ("float32", False, 2, None, "float32", "weights in float32; DeepSpeed ZeRO-2"),
        ("float32", False, None, None, "float32", "as configured"),
        (None, False, None, None, None, "weights in auto"),
        ("auto", False, None, None, "auto", "weights in auto"),
    ],
)
def test_master_weights_dtype(requested, peft, stage, mixed, loaded, said):
    from rl.model import master_dtype

    dtype, why = master_dtype(requested, peft, stage, mixed)
    assert dtype == loaded and said in why, why


@pytest.mark.parametrize(
    "requested,peft,stage,mixed,loaded,said",
    [  # on a GPU, auto is bf16 (common.placement.resolve_dtype): the same rules as bfloat16 asked for
        ("auto", False, None, "bf16", "float32", "fp32 master weights (dtype auto (bfloat16 on a GPU) asked for"),
        (None, False, 2, None, "float32", "under DeepSpeed ZeRO-2 without mixed precision: fp32 master weights"),
        ("auto", False, 2, "bf16", "auto", "DeepSpeed ZeRO-2 keeps fp32 master copies"),
        ("auto", True, None, "bf16", "auto", "LoRA adapters in float32"),
        ("float32", False, None, "bf16", "float32", "as configured"),
    ],
)
def test_master_weights_dtype_on_a_gpu(requested, peft, stage, mixed, loaded, said):
    from rl.model import master_dtype

    dtype, why = master_dtype(requested, peft, stage, mixed, device="cuda:0")
    assert dtype == loaded and said in why, why


@pytest.mark.parametrize(
    "requested,peft,stage,mixed,device,loaded,said",
    [  # with vLLM, LoRA's frozen weights must survive TRL's merge / unmerge at every weight sync
        (
            "bfloat16",
            True,
            None,
            "bf16",
            "cpu",
            "float32",
            "weights in float32, frozen (dtype bfloat16 asked for: LoRA",
        ),
        ("auto", True, None, "bf16", "cuda:0", "float32", "dtype auto (bfloat16 on a GPU) asked for: LoRA with vLLM"),
        ("auto", True, None, None, "cpu", "auto", "LoRA adapters in float32"),  # fp32 on the CPU already
        ("bfloat16", True, 3, "bf16", "cuda:0", "bfloat16", "TRL: autocast_adapter_dtype=False under ZeRO-3"),
        ("bfloat16", False, None, "bf16", "cuda:0", "float32", "full fine-tuning outside DeepSpeed"),
        ("bfloat16", True, 2, None, "cpu", "float32", "weights in float32, frozen (dtype bfloat16 asked for: LoRA"),
        ("bfloat16", True, 2, "bf16", "cuda:0", None, "with vLLM under DeepSpeed ZeRO-2 with bf16 mixed precision"),
        ("auto", True, 1, "fp16", "cuda:0", None, "with vLLM under DeepSpeed ZeRO-1 with fp16 mixed precision"),
    ],
)
def test_lora_with_vllm_keeps_its_frozen_weights_in_fp32_or_is_refused(
    requested, peft, stage, mixed, device, loaded, said
):
    from rl.model import master_dtype

    if loaded is None:
        with pytest.raises(ValueError, match=rf"LoRA \(--use_peft\) {said}: .* Use ZeRO-3"):
            master_dtype(requested, peft, stage, mixed, device=device, use_vllm=True)
        return
    dtype, why = master_dtype(requested, peft, stage, mixed, device=device, use_vllm=True)
    assert dtype == loaded and said in why, why


def changed_share(before, after):
    """Share of text-model weight elements that changed."""
    keys = [k for k in before if "visual" not in k]
    changed = sum(int((before[k].float() != after[k].float()).sum()) for k in keys)
    return changed / sum(before[k].numel() for k in keys)


def test_one_step_at_lr_1e6_moves_full_finetuned_weights_in_the_real_precision(
    config, tiny_refiner, tmp_path, monkeypatch
):
    """The real configs' precision (dtype bfloat16, bf16 autocast) without DeepSpeed or LoRA: fp32 master weights, so
    one step at the paper's lr 1e-6 changes them; loaded in bf16 as asked (the old behaviour) almost nothing moves."""

    run = dict(dtype="bfloat16", bf16=True, learning_rate=1e-6, max_steps=1, lr_scheduler_type="constant")
    tg.main(config(**run, output_dir=str(tmp_path / "fp32")))
    before = weights(tiny_refiner)
    after = weights(tmp_path / "fp32" / "final")
    assert all(v.dtype == torch.float32 for v in after.values())
    moved = changed_share(before, after)
    monkeypatch.setattr("rl.trainer_parts.master_dtype", lambda requested, *a, **k: (requested, "as asked"))
    tg.main(config(**run, output_dir=str(tmp_path / "bf16")))
    after_bf16 = weights(tmp_path / "bf16" / "final")
    stuck = changed_share({k: v.to(torch.bfloat16) for k, v in before.items()}, after_bf16)
    assert moved > 0.5 and stuck < 0.1, (moved, stuck)


def test_vllm_loads_the_policy_with_the_training_image_budget(config, tiny_refiner, tmp_path, monkeypatch):
    """With use_vllm, TRL builds LLM(model=model.name_or_path) and lets vLLM process the raw images itself: the
    entry point points name_or_path at a folder whose processor has the training budget (vLLM cannot run here, so
    the trainer is stopped at construction and the folder checked on the HF side)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rl.image_budget import image_token_count, probe_image

    seen = {}

    class Stop(Exception):
        pass

    def fake_trainer(model, processing_class, args, **kw):
        seen.update(path=model.name_or_path, use_vllm=args.use_vllm, processor=processing_class)
        raise Stop

    monkeypatch.setattr("rl.train_grpo.GRPOTrainer", fake_trainer)
    budget = dict(min_pixels=112 * 112, max_pixels=32 * 28 * 28)
    with pytest.raises(Stop):
        tg.main(config(use_vllm=True, vllm_mode="colocate", **budget))
    folder = tmp_path / "run" / "vllm-model"
    assert seen["path"] == str(folder) and seen["use_vllm"]
    assert (folder / "model.safetensors").is_symlink()  # weights linked, not copied
    vllm_side = AutoProcessor.from_pretrained(str(folder))
    assert dict(vllm_side.image_processor.size) == {"shortest_edge": 112 * 112, "longest_edge": 32 * 28 * 28}
    big = probe_image(budget)
    assert image_token_count(vllm_side, big)[0] == image_token_count(seen["processor"], big)[0] <= 32
    assert (
        image_token_count(AutoProcessor.from_pretrained(str(tiny_refiner)), probe_image(None))[0]
        != image_token_count(vllm_side, probe_image(None))[0]
    )  # the base folder's processor would have disagreed
    AutoModelForImageTextToText.from_pretrained(str(folder))  # the linked folder loads as a model


@pytest.mark.parametrize(
    "index,processes,local,folder",
    [
        (0, 1, 1, "vllm-model"),
        (3, 8, 8, "vllm-model"),  # one node
        (0, 16, 8, "vllm-model-node0"),
        (8, 16, 8, "vllm-model-node1"),
        (15, 16, 8, "vllm-model-node1"),
        (1, 2, 1, "vllm-model-node1"),  # two nodes of one process each
    ],
)
def test_each_node_has_its_own_vllm_folder(index, processes, local, folder, tmp_path):
    from rl.image_budget import vllm_model_dir

    assert vllm_model_dir(tmp_path, index, processes, local) == tmp_path / folder


@pytest.mark.parametrize(
    "min_pixels,max_pixels,expected",
    [
        (None, None, None),  # no budget: the processor's own
        (3136, 802816, {"min_pixels": 3136, "max_pixels": 802816}),
        (12544, 12544, {"min_pixels": 12544, "max_pixels": 12544}),  # one size
        (1, 802816, {"min_pixels": 1, "max_pixels": 802816}),  # as few as the processor allows
        (None, 802816, "--min_pixels must be a positive integer .* got None"),
        (3136, None, "--max_pixels must be a positive integer .* got None"),
        (0, 802816, "--min_pixels must be a positive integer"),
        (3136, -1, "--max_pixels must be a positive integer"),
        (True, 802816, "--min_pixels must be a positive integer .* got True"),
        (3136.0, 802816, "--min_pixels must be a positive integer .* got 3136.0"),
        (802817, 802816, r"--min_pixels \(802817\) is larger than --max_pixels \(802816\)"),
    ],
)
def test_image_budget_values_are_checked_naming_the_setting(min_pixels, max_pixels, expected):
    from rl.image_budget import check_budget

    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            check_budget(min_pixels, max_pixels)
    else:
        assert check_budget(min_pixels, max_pixels) == expected


@pytest.mark.parametrize(
    "size,refused",
    [((2000, 10), False), ((2001, 10), True), ((10, 2000), False), ((10, 2001), True), ((1, 1), False)],
)
def test_image_budget_values_an_aspect_ratio_past_200_to_1_is_refused(size, refused):
    from rl.image_budget import aspect_problem

    assert (aspect_problem(size) is not None) == refused


@pytest.mark.parametrize(
    "max_pixels,grid,tokens",
    [
        (802816, dict(patch_size=14, merge_size=2), 1024),  # the paper's budget
        (12544, dict(patch_size=14, merge_size=2), 16),
        (12543, dict(patch_size=14, merge_size=2), 15),  # whole merged patches only
        (100, dict(patch_size=14, merge_size=2), 1),  # never below one
        (802816, dict(patch_size=16, merge_size=2), 784),
        (12544, {}, 16),  # a processor that does not say: Qwen2-VL's 14 and 2
    ],
)
def test_image_budget_values_cap_the_image_tokens(max_pixels, grid, tokens):
    from types import SimpleNamespace

    from rl.image_budget import max_image_tokens

    assert max_image_tokens({"min_pixels": 1, "max_pixels": max_pixels}, SimpleNamespace(**grid)) == tokens


@pytest.mark.parametrize("budget,size", [(None, (1061, 1024)), ({"min_pixels": 1, "max_pixels": 12544}, (261, 224))])
def test_image_budget_values_the_probe_image_is_larger_than_the_budget(budget, size):
    from rl.image_budget import probe_image

    assert probe_image(budget).size == size


@pytest.mark.parametrize(
    "name,linked",
    [
        ("config.json", True),
        ("generation_config.json", True),
        ("model.safetensors", True),
        ("model-00001-of-00002.safetensors", True),
        ("model.safetensors.index.json", True),
        ("pytorch_model.bin", True),
        ("pytorch_model-00001-of-00002.bin", True),
        ("pytorch_model.bin.index.json", True),
        ("preprocessor_config.json", False),  # the hub's budget: written by our processor instead
        ("chat_template.json", False),
        ("tokenizer.json", False),
        ("training_args.bin", False),
        ("pytorch_model.pt", False),
    ],
)
def test_model_file_names_vllm_links_are_config_and_weights(name, linked):
    from rl.image_budget import is_model_file

    assert is_model_file(name) == linked


def test_each_nodes_local_main_process_writes_its_vllm_folder(tiny_vlm, tmp_path, monkeypatch):
    """Process 8 of 16 (8 per node) is node 1's local main process: it writes node 1's folder, not process 0."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from transformers import AutoProcessor

    from rl.image_budget import write_vllm_model

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    processor = AutoProcessor.from_pretrained(str(tiny_vlm))
    for index in (8, 9):
        state = SimpleNamespace(
            process_index=index,
            num_processes=16,
            is_local_main_process=index % 8 == 0,
            local_main_process_first=nullcontext,
        )
        folder = write_vllm_model(state, str(tiny_vlm), processor, tmp_path / f"p{index}")
        assert folder.name == "vllm-model-node1" and folder.exists() == (index == 8)
    assert (tmp_path / "p8" / "vllm-model-node1" / "config.json").is_symlink()


def test_vllm_serve_folder_cli(tiny_vlm, tmp_path, capsys):
    from transformers import AutoProcessor

    from rl.image_budget import main as folder_main

    folder_main(
        ["--model", str(tiny_vlm), "--out", str(tmp_path / "v"), "--min_pixels", "3136", "--max_pixels", "50176"]
    )
    assert dict(AutoProcessor.from_pretrained(str(tmp_path / "v")).image_processor.size) == {
        "shortest_edge": 3136,
        "longest_edge": 50176,
    }
    assert "trl vllm-serve --model" in capsys.readouterr().out
    with pytest.raises(ValueError, match="max_pixels"):
        folder_main(["--model", str(tiny_vlm), "--out", str(tmp_path / "w"), "--max_pixels", "0"])
    for half in (["--model", str(tiny_vlm)], ["--out", str(tmp_path / "w")]):
        with pytest.raises(ValueError, match="--model and --out are required"):
            folder_main(half)


def test_vllm_model_folder_links_only_config_and_weights(tiny_vlm, tmp_path):
    """A hub folder also holds preprocessor_config.json (the 12.8 MP default budget) and chat_template.json: linked
    beside the processor saved with our budget, which one a loader reads would decide the image tokens. Only config and
    weights are linked; every processor, tokenizer and template file is written by save_pretrained."""
    import shutil

    from transformers import AutoProcessor

    from rl.image_budget import apply_image_budget, vllm_model_folder

    hub = tmp_path / "hub"
    shutil.copytree(tiny_vlm, hub)
    (hub / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": "{{ 'hub template' }}"}))
    budget = {"min_pixels": 112 * 112, "max_pixels": 112 * 112}
    folder = vllm_model_folder(
        str(hub), apply_image_budget(AutoProcessor.from_pretrained(str(hub)), budget), tmp_path / "vllm-model"
    )
    links = {f.name for f in folder.iterdir() if f.is_symlink()}
    assert links == {"config.json", "generation_config.json", "model.safetensors"}
    assert not (folder / "preprocessor_config.json").exists() and not (folder / "chat_template.json").exists()
    written = {f.name for f in folder.iterdir() if not f.is_symlink()}
    assert {"tokenizer_config.json", "tokenizer.json"} <= written
    assert dict(AutoProcessor.from_pretrained(str(folder)).image_processor.size) == {
        "shortest_edge": 112 * 112,
        "longest_edge": 112 * 112,
    }


def test_full_fine_tuning_of_3b_without_deepspeed_is_refused_on_an_80_gb_gpu():
    """The arithmetic (docs/scaling.md) for configs/accelerate/ddp.yaml at Qwen2.5-VL-3B (3.75 B parameters, 3.09 B
    trained), colocated vLLM at 0.25 of a nominal 80 GB, a 2 M × 2,304 fp16 index replica and the text encoder:
    94.9 GB before activations (96.1 GB at an H100's 85.0 GB), refused; LoRA-sized training (a few million trained)
    fits."""
    from rl.model import check_fits, ddp_full_finetune_bytes

    gpu = 80e9
    parts = ddp_full_finetune_bytes(3.75e9, 3.09e9, 0.25 * gpu, 2e6 * 2304 * 2, 0.6e9 * 2)
    assert sum(parts.values()) / 1e9 == pytest.approx(15.0 + 12.36 + 12.36 + 24.72 + 20 + 9.216 + 1.2)
    with pytest.raises(
        ValueError,
        match=r"cannot fit on this GPU: at least 94\.9 GB before activations .* against "
        r"80\.0 GB\. Use DeepSpeed",
    ):
        check_fits(parts, gpu, "full fine-tuning without DeepSpeed")
    small = ddp_full_finetune_bytes(3.75e9, 20e6, 0.25 * gpu, 2e6 * 2304 * 2, 0.6e9 * 2)
    assert check_fits(small, gpu, "x") == pytest.approx(sum(small.values())) and sum(small.values()) < 60e9
    # vLLM asleep while the gradients exist (sleep mode, as the configs set it): the larger of the two, still too much
    asleep = ddp_full_finetune_bytes(3.75e9, 3.09e9, 0.25 * gpu, 2e6 * 2304 * 2, 0.6e9 * 2, vllm_sleeps=True)
    assert sum(asleep.values()) / 1e9 == pytest.approx(15.0 + 12.36 + 12.36 + 24.72 + 20 + 9.216 + 1.2 - 12.36)
    with pytest.raises(ValueError, match=r"at least 82\.5 GB .*colocated vLLM, beyond the gradients .* 7\.6;"):
        check_fits(asleep, gpu, "full fine-tuning without DeepSpeed")
    # one process: no DDP wrapper, no buckets
    alone = ddp_full_finetune_bytes(3.75e9, 3.09e9, 0.25 * gpu, 2e6 * 2304 * 2, 0.6e9 * 2, processes=1)
    assert sum(parts.values()) - sum(alone.values()) == pytest.approx(3.09e9 * 4)


def test_lora_without_target_modules_goes_on_the_language_models_linear_layers(tiny_refiner):
    """`--use_peft` alone: PEFT knows no default targets for Qwen2.5-VL and refuses such a config (inside the trainer,
    after every model has loaded); ``lora_config`` names every linear layer outside the vision tower instead."""
    from peft import get_peft_model
    from trl import ModelConfig, get_peft_config

    from rl.model import exclude_vision_tower, load_model, lora_config, quiet_checkpointing_deprecation

    quiet_checkpointing_deprecation()  # as the jobs do: PEFT reads the deprecated flag (pytest restores the filters)
    model, _ = load_model(str(tiny_refiner), "float32", device="cpu")
    model_args = ModelConfig(use_peft=True, lora_r=4)
    with pytest.raises(ValueError, match="target_modules"):  # TRL's config as it comes, vision tower excluded
        get_peft_model(model, exclude_vision_tower(model, get_peft_config(model_args)))
    said = []
    peft_model = get_peft_model(model, lora_config(model, model_args, say=said.append))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in peft_model.named_parameters() if ".lora_A" in n}
    assert said and "all-linear" in said[0]
    assert adapted and not any(".visual." in n for n in adapted)
    kinds = {n.rsplit(".", 1)[-1] for n in adapted}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= kinds
    assert not any("lm_head" in n for n in adapted)
    named = ModelConfig(use_peft=True, lora_r=4, lora_target_modules=["q_proj"])
    assert lora_config(model, named, say=said.append).target_modules in ("q_proj", {"q_proj"}) and len(said) == 1


def test_the_completions_table_totals_rewards_as_trl_weighs_them(config, tmp_path):
    """With reward_weights, TRL trains on w_format·format + w_retrieval·retrieval; the table's total is that sum."""
    tg.main(config(max_steps=1, reward_weights=[2.0, 0.5]))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl", encoding="utf-8")]
    assert rows and all(
        r["total_reward"] == pytest.approx(2.0 * r["format_reward"] + 0.5 * r["retrieval_reward"]) for r in rows
    )
    assert any(r["retrieval_reward"] != 0 for r in rows)


@pytest.mark.parametrize(
    "questions,per_device,processes,generations",
    [(6, 20, 2, 5), (7, 8, 2, 4), (12, 8, 2, 4), (5, 8, 1, 4), (9, 6, 3, 3), (3, 40, 2, 5)],
)
def test_kept_eval_questions_are_each_scored_exactly_once_per_generation(questions, per_device, processes, generations):
    """TRL 1.16's eval sampler and accelerate's sharding, as Trainer.get_eval_dataloader builds them, over the eval
    questions ``whole_round_eval`` keeps: every kept question's completions are scored exactly ``generations`` times
    over all processes (a short last round would score the first questions again)."""
    from collections import Counter

    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from trl.trainer.utils import RepeatSampler

    from rl.arguments import whole_eval_rounds

    def scored_once_per_generation(n: int) -> bool:
        """Whether n eval questions' completions are each scored exactly ``generations`` times over all processes."""
        data, scored = list(range(n)), Counter()
        for rank in range(processes):
            loader = DataLoader(
                data,
                batch_size=per_device,
                sampler=RepeatSampler(data, mini_repeat_count=generations, seed=0),
                collate_fn=lambda batch: batch,
            )
            for batch in prepare_data_loader(loader, num_processes=processes, process_index=rank, put_on_device=False):
                scored.update(batch)
        return scored == Counter({q: generations for q in data})

    kept = whole_eval_rounds(questions, per_device, processes, generations)
    if processes == 1:  # a short last batch is taken as it is: every question is kept
        assert kept == questions
    else:  # a round: the questions whose completions fill one eval batch on every process
        per_round = per_device * processes // generations
        assert kept % per_round == 0 and 0 <= questions - kept < per_round  # every whole round, and nothing more
    assert kept == 0 or scored_once_per_generation(kept)
    # and the most that are: any more questions (a short last round) score some of them again
    assert not any(scored_once_per_generation(n) for n in range(kept + 1, questions + 1))


def test_an_eval_batch_smaller_than_one_questions_generations_is_named():
    """Over 2 processes, 1 eval completion each holds less than one question's 4 generations: not one round is
    filled, which divided by zero."""
    from rl.arguments import whole_eval_rounds

    with pytest.raises(ValueError, match=r"per_device_eval_batch_size \(1\) × processes \(2\) .* raise .* to 2"):
        whole_eval_rounds(10, 1, 2, 4)
    with pytest.raises(ValueError, match=r"raise per_device_eval_batch_size to 5"):  # 5 × 2 = 10: whole groups of 5
        whole_eval_rounds(10, 1, 2, 5)


def test_an_eval_file_that_is_never_evaluated_is_left_as_it_is():
    """With eval_strategy no, TRL neither checks the eval batch nor evaluates: nothing is cut, nothing refused."""
    from types import SimpleNamespace

    from datasets import Dataset

    from rl.trainer_parts import whole_round_eval

    questions, said = Dataset.from_dict({"id": list(range(7))}), []
    off = SimpleNamespace(
        eval_strategy="no", num_generations=5, num_generations_eval=None, per_device_eval_batch_size=1
    )
    assert len(whole_round_eval(questions, off, 2, said.append)) == 7 and said == [
        "eval_file: 7 questions, never evaluated (eval_strategy no)"
    ]
    on = SimpleNamespace(**{**vars(off), "eval_strategy": "steps", "per_device_eval_batch_size": 5})
    assert len(whole_round_eval(questions, on, 2, said.append)) == 6  # rounds of 2 questions × 5 generations


@pytest.mark.parametrize(
    "questions,per_device,processes,generations,generations_eval,kept,said",
    [
        (7, 5, 2, 5, None, 6, ["eval: the first 6 of 7 questions, whole rounds of 5 × 2 completions"]),
        (6, 5, 2, 5, None, 6, []),  # whole rounds already: nothing said
        (7, 2, 2, 5, 2, 6, ["eval: the first 6 of 7 questions, whole rounds of 2 × 2 completions"]),  # eval's own
        (1, 3, 1, 3, None, 1, []),  # one process takes a short last batch as it is
        (1, 4, 2, 4, None, "fewer than one evaluation round", []),
    ],
)
def test_whole_round_eval_keeps_whole_rounds_and_says_so(
    questions, per_device, processes, generations, generations_eval, kept, said
):
    from types import SimpleNamespace

    from datasets import Dataset

    from rl.trainer_parts import whole_round_eval

    args = SimpleNamespace(
        eval_strategy="steps",
        num_generations=generations,
        num_generations_eval=generations_eval,
        per_device_eval_batch_size=per_device,
    )
    data, heard = Dataset.from_dict({"id": list(range(questions))}), []
    assert whole_round_eval(None, args, processes, heard.append) is None
    if isinstance(kept, str):
        with pytest.raises(ValueError, match=rf"eval_file: {questions} usable questions, {kept}"):
            whole_round_eval(data, args, processes, heard.append)
    else:
        assert whole_round_eval(data, args, processes, heard.append)["id"] == list(range(kept))
        assert [line.split(" (")[0] for line in heard] == said


@pytest.mark.parametrize("questions,refused", [(1, True), (2, False), (3, False)])
def test_a_train_file_is_refused_only_below_one_generation_batch_of_prompts(questions, refused):
    from types import SimpleNamespace

    from rl.trainer_parts import check_train_fills_a_generation

    args = SimpleNamespace(generation_batch_size=8, num_generations=4)  # 2 prompts a generation batch
    if refused:
        with pytest.raises(ValueError, match=rf"train_file: {questions} usable questions, fewer than the 2 prompts"):
            check_train_fills_a_generation(list(range(questions)), args)
    else:
        check_train_fills_a_generation(list(range(questions)), args)


def test_a_train_file_smaller_than_one_generation_batch_is_refused_before_any_model_loads(
    config, tiny_world, tmp_path, monkeypatch
):
    """TRL's sampler yields whole generation batches only: 1 question for batches of 2 prompts would train no step
    and save the untouched model as final/."""
    write_jsonl_atomic(tmp_path / "one.jsonl", list(read_jsonl(tiny_world / "train.jsonl"))[:1])
    monkeypatch.setattr("rl.trainer_parts.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=r"train_file: 1 usable questions, fewer than the 2 prompts of one generation"):
        tg.main(config(train_file=str(tmp_path / "one.jsonl"), images_root=str(tiny_world)))


SAVED = {
    "refiner_args": {"alpha": 0.5, "depth": 200, "eval_file": "/a/val.jsonl", "max_pixels": 12544},
    "index": {"path": "/a/index", "image_encoder": "clip", "text_encoder": "minilm", "alpha": 0.5},
    "prompt": {"name": "toy"},
    "generation": {"temperature": 1.0},
    "optimisation": {"learning_rate": 1e-6, "max_steps": 100},
    "train_content": "sha256:aa",
}


@pytest.mark.parametrize(
    "change,differences",
    [
        ({}, []),
        ({"optimisation": {"learning_rate": 1e-6, "max_steps": 300}}, []),  # a run may be extended
        ({"refiner_args": {**SAVED["refiner_args"], "eval_file": "/b/val.jsonl"}}, []),  # paths move
        ({"index": {**SAVED["index"], "path": "/b/index"}}, []),
        ({"refiner_args": {**SAVED["refiner_args"], "alpha": 0.3}}, ["--alpha: 0.5 → 0.3"]),
        ({"refiner_args": {**SAVED["refiner_args"], "max_pixels": 3136}}, ["--max_pixels: 12544 → 3136"]),
        ({"index": {**SAVED["index"], "text_encoder": "qwen3"}}, ["index text_encoder: 'minilm' → 'qwen3'"]),
        ({"prompt": {"name": "wikiseeker"}}, ["prompt: {'name': 'toy'} → {'name': 'wikiseeker'}"]),
        ({"train_content": "sha256:bb"}, ["train_content: 'sha256:aa' → 'sha256:bb'"]),
        (
            {"optimisation": {"learning_rate": 1e-5, "max_steps": 100}, "generation": {"temperature": 0.7}},
            [
                "generation: {'temperature': 1.0} → {'temperature': 0.7}",
                "optimisation: {'learning_rate': 1e-06} → {'learning_rate': 1e-05}",
            ],
        ),
    ],
)
def test_a_resume_differs_in_the_settings_that_trained_its_checkpoint(tmp_path, change, differences):
    from rl.run_record import RUN_RECORD, check_resume, resume_differences

    now = {**SAVED, **change}
    assert resume_differences(SAVED, now) == differences
    ckpt = tmp_path / "run" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    check_resume(ckpt, now)  # no run record beside it: nothing to compare
    (tmp_path / "run" / RUN_RECORD).write_text(json.dumps(SAVED))
    if differences:
        with pytest.raises(ValueError, match=f"resume_from_checkpoint {ckpt}: its run trained under other settings"):
            check_resume(ckpt, now)
    else:
        check_resume(ckpt, now)
    older = {k: v for k, v in SAVED.items() if k not in ("train_content", "optimisation")}  # an older record
    assert [d for d in resume_differences(older, now) if d.startswith(("train_content", "optimisation"))] == []


def test_the_vllm_folder_is_checked_to_expand_an_image_as_the_trainer_does(tiny_vlm, tmp_path):
    """What vLLM loads from the folder must make as many image tokens of the probe image as the trainer's processor:
    a folder written with another budget is refused, naming both counts."""
    from transformers import AutoProcessor

    from rl.image_budget import (
        apply_image_budget,
        check_same_image_tokens,
        image_token_count,
        probe_image,
        vllm_model_folder,
    )

    small, large = {"min_pixels": 3136, "max_pixels": 12544}, {"min_pixels": 3136, "max_pixels": 50176}

    def processor(budget):
        return apply_image_budget(AutoProcessor.from_pretrained(str(tiny_vlm)), budget)

    folder = vllm_model_folder(str(tiny_vlm), processor(small), tmp_path / "vllm-model")
    tokens = check_same_image_tokens(processor(small), folder, small)
    assert tokens == image_token_count(processor(small), probe_image(small))[0] == 12  # scaled into 12,544 px
    with pytest.raises(
        ValueError, match=r"expands a \(\d+, \d+\) image to 12 image tokens, the trainer's processor to"
    ):
        check_same_image_tokens(processor(large), folder, large)


def test_a_folder_without_a_record_or_an_older_record_takes_a_new_run(tmp_path):
    """Checkpoints with no run record beside them (another tool's) are not compared; a record written before the seed
    and max_steps were recorded holds neither against the new run."""
    from rl.run_record import RUN_RECORD, check_output_dir

    record = {
        "refiner_args": {"alpha": 0.5},
        "index": {},
        "optimisation": {"max_steps": 2},
        "seed": 0,
        "base_model": "m",
    }
    (tmp_path / "checkpoint-1").mkdir()
    check_output_dir(tmp_path, record)
    older = {"refiner_args": {"alpha": 0.5}, "index": {}, "base_model": "m"}
    (tmp_path / RUN_RECORD).write_text(json.dumps(older))
    check_output_dir(tmp_path, record)
    (tmp_path / RUN_RECORD).write_text(json.dumps({**older, "seed": 0}))
    with pytest.raises(ValueError, match=r"holds another run \(--seed: 0 → 1\)"):
        check_output_dir(tmp_path, {**record, "seed": 1})


def test_a_hub_policy_is_linked_from_its_cached_snapshot(tiny_vlm, tmp_path, monkeypatch):
    """The real configs name the policy by its hub name (Qwen/Qwen2.5-VL-3B-Instruct): the vLLM folder links the
    files of its snapshot in the Hugging Face cache, where from_pretrained put them (nothing is downloaded)."""
    import shutil

    from transformers import AutoProcessor

    from rl.image_budget import model_files, vllm_model_folder

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_vlm, snapshot)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert model_files("org/tiny") == snapshot
    assert model_files(str(tiny_vlm)) == tiny_vlm  # a folder is itself
    folder = vllm_model_folder("org/tiny", AutoProcessor.from_pretrained(str(tiny_vlm)), tmp_path / "vllm-model")
    assert (folder / "config.json").resolve() == (snapshot / "config.json").resolve()
