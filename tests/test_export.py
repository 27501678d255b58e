"""Export of a trained refiner: full fine-tune and LoRA round trips, atomic writes, refusals."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

import rl.export as ex
import rl.train_grpo as tg
from rl.export import ExportArgs, export

QUIET = dict(log=lambda *a: None)


def weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def our_card(folder, base_model) -> str:
    """folder/README.md is our refiner card (rl.model_card), not TRL's or PEFT's placeholder."""
    card = (folder / "README.md").read_text()
    assert "[None]" not in card and "fine-tuned version of" not in card
    assert yaml.safe_load(card.split("---\n")[1])["base_model"] == str(base_model.resolve())
    assert f"Base model: `{base_model.resolve()}`" in card and "- α (image weight of a query): 0.5" in card
    return card


def train(config, tmp_path, name, **kw):
    tg.main(config(max_steps=1, save_strategy="steps", save_steps=1, output_dir=str(tmp_path / name), **kw))
    return tmp_path / name


def test_full_fine_tune_round_trip(config, tmp_path, tiny_refiner):
    run = train(config, tmp_path, "full", reward_weights=[0.5, 2.0])
    out = export(ExportArgs(checkpoint=str(run), out=str(tmp_path / "serve"), dtype="fp32"), **QUIET)
    trained, exported = weights(run / "checkpoint-1"), weights(out)
    assert set(trained) == set(exported)
    assert all(torch.allclose(trained[k].float(), exported[k].float(), atol=1e-6) for k in trained)
    spec = json.loads((out / "refiner.json").read_text())
    assert spec["prompt"]["name"] == "toy" and spec["index"]["alpha"] == 0.5
    assert spec["index"]["image_encoder"] == "tiny" and spec["training_step"] == 1 and spec["parser_version"]
    assert spec["max_query_tokens"] == 128  # the run's cap: rl.refine parses with it, as training did
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["temperature"] == 1.0 and gen["max_new_tokens"] == 40
    assert (out / "chat_template.jinja").exists() or "chat_template" in (out / "tokenizer_config.json").read_text()
    assert not list(tmp_path.glob(".serve.tmp-*"))
    card = our_card(out, tiny_refiner)  # the export's card, written before the rename
    assert ex.vllm_serve_command(out.resolve(), "float32", spec["image_budget"]) in card
    assert f"python -m rl.refine --model {out.resolve()}" in card and "No held-out figures" in card
    for folder in (run, run / "final"):  # the run's, over the card TRL wrote at its checkpoint
        assert "python -m rl.export" in our_card(folder, tiny_refiner)
    assert "0.5 × format + 2 × retrieval" in card and "- GRPO: 4 completions per question" in card  # as TRL trained
    assert ex.step_and_metrics(run / "final")[0] == 1  # final, exported, says its step too (save_model writes none)


def test_lora_is_merged(config, tmp_path, tiny_refiner):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    run = train(
        config,
        tmp_path,
        "lora",
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=["q_proj", "v_proj"],
        learning_rate=1e-2,
    )
    assert (run / "checkpoint-1" / "adapter_config.json").exists()
    out = export(  # reloaded below, in this process; the fresh-process check: test_full_fine_tune_round_trip
        ExportArgs(checkpoint=str(run / "checkpoint-1"), out=str(tmp_path / "serve"), dtype="fp32", verify=False),
        **QUIET,
    )
    base = AutoModelForImageTextToText.from_pretrained(str(tiny_refiner), dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, str(run / "checkpoint-1")).merge_and_unload().state_dict()
    assert not any("lora" in k for k in weights(out))
    exported = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert set(exported) == set(merged)
    assert all(torch.allclose(exported[k], merged[k], atol=1e-6) for k in merged)
    changed = [k for k in merged if not torch.allclose(merged[k], original[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)  # the LoRA update, and only it
    assert f"Exported from `{(run / 'checkpoint-1').resolve()}`" in our_card(out, tiny_refiner)


def test_failed_verification_leaves_no_folder(config, tmp_path, monkeypatch):
    run = train(config, tmp_path, "full")

    class Failed:
        returncode, stdout, stderr = 1, "", "Traceback …\nValueError: exported model's output does not parse"

    def too_long(*a, timeout=None, **k):
        raise ex.subprocess.TimeoutExpired(a[0], timeout)

    for fake, message in (
        (lambda *a, **k: Failed(), "verification of the exported folder failed: .*does not parse"),
        (too_long, f"did not finish within {ex.VERIFY_TIMEOUT_S} s"),
    ):
        monkeypatch.setattr(ex.subprocess, "run", fake)
        with pytest.raises(ValueError, match=message):
            export(ExportArgs(checkpoint=str(run), out=str(tmp_path / "serve")), **QUIET)
        assert not (tmp_path / "serve").exists() and not list(tmp_path.glob(".serve.tmp-*"))


def test_refusals(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="not empty"):
        export(ExportArgs(checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "busy")))
    with pytest.raises(ValueError, match="--out: .*x is a file, not a folder"):  # was a NotADirectoryError
        export(ExportArgs(checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "busy" / "x"), force=True))
    with pytest.raises(ValueError, match="holds no model weights"):
        export(ExportArgs(checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "new")))
    with pytest.raises(ValueError, match="--checkpoint"):
        export(ExportArgs(checkpoint=str(tmp_path / "none"), out=str(tmp_path / "new")))
    with pytest.raises(ValueError, match="--dtype"):
        export(ExportArgs(checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "new"), dtype="int3"))
    (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/missing"}))
    (tmp_path / "refine_rl_run.json").write_text(json.dumps({"base_model": "org/missing"}))
    with pytest.raises(ValueError, match="needs its base model 'org/missing'"):
        export(ExportArgs(checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "new")))


def test_an_out_that_holds_the_checkpoint_is_refused_even_with_force(tmp_path):
    """--out naming the run folder (or the checkpoint) with --force replaced it with the export: every checkpoint,
    the run record and the logs were deleted."""
    ckpt = tmp_path / "run" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    for out in (tmp_path / "run", ckpt, tmp_path / "run" / "." / "checkpoint-1"):
        for given in (tmp_path / "run", ckpt):
            with pytest.raises(ValueError, match="--out: .* holds the checkpoint .*checkpoint-1 being exported"):
                export(ExportArgs(checkpoint=str(given), out=str(out), force=True), **QUIET)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-1"]


def test_corrupt_weights_are_named(config, tmp_path):
    run = train(config, tmp_path, "full")
    weights_file = next((run / "checkpoint-1").glob("*.safetensors"))
    weights_file.write_bytes(weights_file.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot load the checkpoint .*checkpoint-1"):
        export(ExportArgs(checkpoint=str(run / "checkpoint-1"), out=str(tmp_path / "serve")), **QUIET)
    assert not (tmp_path / "serve").exists()


def test_the_best_checkpoint_is_found_from_any_working_directory(tmp_path, monkeypatch):
    """The trainer records best_model_checkpoint as output_dir/checkpoint-N with output_dir as the run was given it
    (configs give relative paths): exported from elsewhere, the run folder's own checkpoint-N is the best one."""
    run = tmp_path / "elsewhere" / "grpo-evqa"
    for step in (1, 2):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        state = {"best_model_checkpoint": "outputs/grpo-evqa/checkpoint-1", "global_step": step}
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    monkeypatch.chdir(tmp_path)
    assert ex.resolve_checkpoint(run) == run / "checkpoint-1"
    state["best_model_checkpoint"] = "outputs/other/checkpoint-7"  # gone: the latest, said
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    assert ex.resolve_checkpoint(run) == run / "checkpoint-2"
    # the run renamed, and a new run of the same config under the recorded path: the renamed folder's own best
    state["best_model_checkpoint"] = "outputs/grpo-evqa/checkpoint-1"
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "outputs" / "grpo-evqa" / "checkpoint-1").mkdir(parents=True)
    renamed = run.rename(run.with_name("grpo-evqa-run1"))
    assert ex.resolve_checkpoint(renamed) == renamed / "checkpoint-1"
    # a last checkpoint whose save was cut short (no trainer_state.json, written last): the best of the saved ones
    (renamed / "checkpoint-3").mkdir()
    (renamed / "checkpoint-3" / "model.safetensors").write_bytes(b"")
    assert ex.resolve_checkpoint(renamed) == renamed / "checkpoint-1"


def test_the_export_samples_as_the_run_did_not_as_the_base_model_says(config, tmp_path, tiny_refiner):
    """Qwen2.5-VL's generation_config.json sets a repetition penalty and a top-k; TRL samples with its own settings
    (repetition_penalty 1.0, top_k 0 by default). The export writes every one the run used, none inherited."""
    base = tmp_path / "base"
    shutil.copytree(tiny_refiner, base)
    gen = json.loads((base / "generation_config.json").read_text()) | {"repetition_penalty": 1.05, "top_k": 1}
    (base / "generation_config.json").write_text(json.dumps(gen))
    run = train(config, tmp_path, "run", model_name_or_path=str(base), top_p=0.9)
    out = export(ExportArgs(checkpoint=str(run), out=str(tmp_path / "serve"), dtype="fp32", verify=False), **QUIET)
    written = json.loads((out / "generation_config.json").read_text())
    assert written["do_sample"] is True and written["top_p"] == 0.9
    assert written.get("repetition_penalty", 1.0) == 1.0 and written.get("top_k", 0) == 0
    assert ex.sampling({"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 64}) == dict(  # an older run record
        temperature=0.7, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, max_new_tokens=64
    )


def test_the_exports_check_decodes_as_rl_refine_does(config, tmp_path, monkeypatch):
    """The check generated greedily without the run's repetition penalty, which rl.refine's greedy decoding applies:
    it could pass on output rl.refine never gives. It now decodes with the run's settings."""
    from rewards.format import format_completion

    run = train(config, tmp_path, "run", repetition_penalty=1.3)
    out = export(ExportArgs(checkpoint=str(run), out=str(tmp_path / "serve"), dtype="fp32", verify=False), **QUIET)
    asked = []
    monkeypatch.setattr(
        ex, "generate_completions", lambda *a, **k: asked.append(k) or [format_completion("a red cross")]
    )
    assert ex.verify(out) == format_completion("a red cross")
    (kwargs,) = asked
    assert kwargs.get("do_sample", False) is False and kwargs["sampling"]["repetition_penalty"] == 1.3


def test_the_exports_check_takes_the_first_question_whose_image_can_be_used(tiny_world, tmp_path):
    """A truncated first image of the run's eval file refused the export, though training had left it out."""
    from rl.export import probe_question
    from tests.test_refine import unusable_images

    rows = unusable_images(
        tmp_path, tiny_world / json.loads(open(tiny_world / "test.jsonl", encoding="utf-8").readline())["image"]
    )
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))  # strip, cut, good
    record = {"refiner_args": {"eval_file": str(tmp_path / "eval.jsonl")}}
    assert probe_question(record) == (str(tmp_path / "good.png"), "what is good?")
    assert probe_question(record, tries=2) == (None, "What is shown in this image?")


def test_neutral_sampling_is_trls_default():
    """The settings every generation passes when a run recorded none are TRL's GRPOConfig defaults."""
    from dataclasses import fields

    from trl import GRPOConfig

    from rl.generate import NEUTRAL

    assert NEUTRAL == {f.name: f.default for f in fields(GRPOConfig) if f.name in NEUTRAL}


@pytest.mark.parametrize(
    "files,shards_only",
    [
        (["latest", "config.json"], True),
        (["latest", "config.json", "model.safetensors"], False),
        (["latest", "model-00001-of-00002.safetensors"], False),
        (["latest", "pytorch_model.bin"], False),
        (["latest", "pytorch_model-00001-of-00002.bin"], False),
        (["config.json"], False),
        (["model.safetensors"], False),
    ],
)
def test_a_checkpoint_is_gathered_from_zero_shards_only_when_it_holds_no_weights(tmp_path, files, shards_only):
    for name in files:
        (tmp_path / name).write_text("x")
    assert ex.zero_shards_only(tmp_path) is shards_only


def test_a_run_folder_with_final_only_exports_final_and_one_without_a_record_is_named(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    assert ex.resolve_checkpoint(run) == run / "final"
    with pytest.raises(ValueError, match="no refine_rl_run.json next to .*final: export needs the run's record"):
        ex.run_record(run / "final")
    (run / "refine_rl_run.json").write_text(json.dumps({"base_model": "b"}))
    assert ex.run_record(run / "final") == {"base_model": "b"}


def test_the_step_and_held_out_figures_are_the_checkpoints(tmp_path):
    """The step in the checkpoint's own trainer_state.json (its run folder's when it has none) and the last
    evaluation at or before it."""
    history = [
        {"step": 1, "loss": 0.5},
        {"step": 2, "eval_reward": 1.5, "eval_retrieval/hit@1": 0.25},
        {"step": 3, "loss": 0.4},
        {"step": 4, "eval_reward": 2.5},
    ]
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    assert ex.step_and_metrics(ckpt) == (None, {})
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": history}))
    assert ex.step_and_metrics(ckpt) == (4, {"step": 4, "eval_reward": 2.5})
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": history}))
    assert ex.step_and_metrics(ckpt) == (3, {"step": 2, "eval_reward": 1.5, "eval_retrieval/hit@1": 0.25})


def test_the_exports_check_skips_rows_without_an_image_or_question_and_reads_the_train_file_too(tiny_world, tmp_path):
    image = json.loads(open(tiny_world / "test.jsonl", encoding="utf-8").readline())["image"]
    rows = [["not", "a", "row"], {"image": image}, {"question": "no image?"}, {"image": image, "question": "ok?"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"eval_file": str(tmp_path / "gone.jsonl"), "train_file": str(tmp_path / "train.jsonl")}
    assert ex.probe_question({"refiner_args": args}) == (None, "What is shown in this image?")  # not under tmp_path
    args["images_root"] = str(tiny_world)
    assert ex.probe_question({"refiner_args": args}) == (str(tiny_world / image), "ok?")


@pytest.mark.parametrize("image", ["", "/data/a.png"])
def test_the_verify_process_reads_its_folder_image_and_question(monkeypatch, capsys, image):
    asked = []
    monkeypatch.setattr(ex, "verify", lambda *a: asked.append(a) or "<answer>q</answer>")
    ex.main([ex.VERIFY_MODE, "/x/serve", image, "which bird?"])
    assert asked == [(ex.Path("/x/serve"), image or None, "which bird?")]
    assert capsys.readouterr().out == "generated: <answer>q</answer>\n"


def test_the_command_line_reaches_the_export(tmp_path):
    with pytest.raises(ValueError, match=f"--checkpoint: folder '{tmp_path / 'none'}' does not exist"):
        ex.main(["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "serve")])
