"""Batched refiner inference: the Python API, fallback to the question, resume after an interruption."""

import json

import pytest
import torch

import rl.train_grpo as tg
from rl.export import ExportArgs, export
from rl.model import load_model
from rl.prompts import prompt_spec
from rl.refine import RefineArgs, Refiner, refine_file

QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def toy_refiner(tiny_refiner):
    model, processor = load_model(str(tiny_refiner))
    spec = {"prompt": prompt_spec("toy"), "generation": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 40}}
    return Refiner(model, processor, spec)


def test_refine_file_resumes_without_losing_or_repeating(toy_refiner, tiny_world, tmp_path, monkeypatch):
    out = tmp_path / "refined.jsonl"
    args = RefineArgs(queries=str(tiny_world / "test.jsonl"), out=str(out), batch_size=8)
    real = toy_refiner.refine_with_outputs
    calls = []

    def dying(images, questions, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(len(questions))
        return real(images, questions, **kw)

    monkeypatch.setattr(toy_refiner, "refine_with_outputs", dying)
    with pytest.raises(KeyboardInterrupt):
        refine_file(args, refiner=toy_refiner, **QUIET)
    part = tmp_path / "refined.jsonl.part0"  # this process's part; merged into out when the job finishes
    assert not out.exists() and sum(1 for _ in open(part, encoding="utf-8")) == 16  # two finished batches are on disk
    with open(part, "a", encoding="utf-8") as fh:
        fh.write('{"id": "cut-short')  # a line cut by a crash
    monkeypatch.setattr(toy_refiner, "refine_with_outputs", real)
    assert refine_file(args, refiner=toy_refiner, **QUIET) == 48 - 16
    rows = [json.loads(x) for x in open(out, encoding="utf-8")]
    inputs = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")]
    assert [r["id"] for r in rows] == [r["id"] for r in inputs]  # ids and order kept, nothing twice
    for r, q in zip(rows, inputs):
        assert {"refined_query", "raw_output", "format_ok"} <= set(r) and r["question"] == q["question"]
        if not r["format_ok"]:
            assert r["refined_query"] == r["question"]  # fallback to the original question
    assert sum(r["format_ok"] for r in rows) > len(rows) // 2
    said = []
    refine_file(
        RefineArgs(**{**vars(args), "out": str(tmp_path / "again.jsonl")}), refiner=toy_refiner, log=said.append
    )
    again = [json.loads(x) for x in open(tmp_path / "again.jsonl", encoding="utf-8")]
    ok = sum(r["format_ok"] for r in again)
    assert f"refine: {ok} of 48 output(s) here parsed ({100 * ok / 48:.1f} %); the other {48 - ok} kept" in "".join(
        said
    )
    assert refine_file(args, refiner=toy_refiner, **QUIET) == 0 and not part.exists()


def test_a_resume_with_another_model_is_refused_naming_it(toy_refiner, tiny_world, tmp_path):
    """Refined queries from two refiners are never mixed in one output: the settings that make each one are recorded
    next to it, and a resume with others is refused."""
    out = tmp_path / "refined.jsonl"
    args = RefineArgs(model="run-a", queries=str(tiny_world / "test.jsonl"), out=str(out), batch_size=8)
    refine_file(args, refiner=toy_refiner, **QUIET)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:16]))  # an interrupted run's first two batches
    with pytest.raises(ValueError, match=r"other settings \(model: 'run-a' then, 'run-b' now\)"):
        refine_file(RefineArgs(**{**vars(args), "model": "run-b"}), refiner=toy_refiner, **QUIET)
    assert out.read_text() == "".join(lines[:16])  # nothing lost
    with pytest.raises(ValueError, match=r"other settings \(backend: 'hf' then, 'vllm' now\)"):  # other numerics
        refine_file(RefineArgs(**{**vars(args), "backend": "vllm"}), refiner=toy_refiner, **QUIET)
    # another queries file into the same output: its questions were kept beside the first file's (val beside test)
    other = tmp_path / "val.jsonl"
    other.write_text((tiny_world / "val.jsonl").read_text())
    with pytest.raises(ValueError, match=r"other settings \(queries: 'sha256:"):
        refine_file(
            RefineArgs(**{**vars(args), "queries": str(other), "images_root": str(tiny_world)}),
            refiner=toy_refiner,
            **QUIET,
        )
    assert refine_file(args, refiner=toy_refiner, **QUIET) == 48 - 16


def test_sampled_refinements_repeat_under_a_seed(toy_refiner, tiny_world, tmp_path):
    """rl.refine --sample had no seed of its own: each batch now draws from --seed + its first question's position in
    the file, whatever the generator drew before it (another batch, on another process or before a resume)."""
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:16]
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    back = tmp_path / "back.jsonl"  # the same questions at other positions draw otherwise
    back.write_text("".join(json.dumps(r) + "\n" for r in rows[8:] + rows[:8]))

    def refined(q, name, seed=3):
        out = tmp_path / name
        args = RefineArgs(
            queries=str(q), out=str(out), batch_size=8, sample=True, seed=seed, images_root=str(tiny_world)
        )
        torch.manual_seed(1234 + len(name))  # whatever state the generator was left in
        refine_file(args, refiner=toy_refiner, **QUIET)
        return {r["id"]: r["raw_output"] for r in map(json.loads, open(out, encoding="utf-8"))}

    first, again = refined(queries, "a.jsonl"), refined(queries, "bb.jsonl")
    assert first == again
    reordered = refined(back, "ccc.jsonl")
    assert {k: reordered[k] for k in list(first)[8:]} != {k: first[k] for k in list(first)[8:]}  # other positions
    assert refined(back, "dddd.jsonl") == reordered
    with pytest.raises(ValueError, match=r"seed: 3 then, 4 now"):
        refined(queries, "a.jsonl", seed=4)


def test_a_refiner_exported_again_into_the_same_folder_is_not_resumed_over(toy_refiner, tiny_world, tmp_path):
    """`rl.export --force` replaces the folder's weights (a new run, the same --out): its queries are another model's,
    so a resume from the old ones is refused, although the path is the same."""
    import os

    folder = tmp_path / "refiner"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights of run a")
    out = tmp_path / "refined.jsonl"
    args = RefineArgs(model=str(folder), queries=str(tiny_world / "test.jsonl"), out=str(out), batch_size=8)
    refine_file(args, refiner=toy_refiner, **QUIET)
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:16]))
    (folder / "model.safetensors").write_bytes(b"weights of run b")
    stat = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later export
    with pytest.raises(ValueError, match=r"other settings \(weights: "):
        refine_file(args, refiner=toy_refiner, **QUIET)


def test_missing_image_is_named(toy_refiner, tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "a", "image": "gone.png", "question": "?"}) + "\n")
    with pytest.raises(ValueError, match="gone.png"):
        refine_file(
            RefineArgs(queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "o.jsonl")), refiner=toy_refiner, **QUIET
        )
    assert not (tmp_path / "o.jsonl").exists()


def unusable_images(folder, good):
    """Question rows of one image that decodes (``good``), a truncated PNG and a 300:1 strip (the Qwen2-VL processor
    refuses past 200:1)."""
    import shutil

    from PIL import Image

    shutil.copy(good, folder / "good.png")
    (folder / "cut.png").write_bytes((folder / "good.png").read_bytes()[:200])
    Image.new("RGB", (600, 2)).save(folder / "strip.png")
    return [{"id": n, "image": f"{n}.png", "question": f"what is {n}?"} for n in ("good", "cut", "strip")]


def test_a_question_whose_image_cannot_be_used_keeps_its_question_and_the_run_goes_on(
    toy_refiner, tiny_world, tmp_path
):
    """A truncated file or an image the processor refuses stopped rl.refine at the same batch on every run."""
    rows = unusable_images(
        tmp_path, tiny_world / json.loads(open(tiny_world / "test.jsonl", encoding="utf-8").readline())["image"]
    )
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = RefineArgs(queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "o.jsonl"), batch_size=3)
    lines = []
    assert refine_file(args, refiner=toy_refiner, log=lines.append) == 3
    out = {r["id"]: r for r in map(json.loads, open(tmp_path / "o.jsonl", encoding="utf-8"))}
    assert "image_error" not in out["good"] and out["good"]["raw_output"]
    assert "image unreadable" in out["cut"]["image_error"] and "cut.png" in out["cut"]["image_error"]
    assert "aspect ratio past 200:1" in out["strip"]["image_error"]
    for name in ("cut", "strip"):
        assert out[name]["refined_query"] == out[name]["question"] and out[name]["format_ok"] is False
    assert any("2 question(s) kept their question unrefined" in line for line in lines)
    # the image mended: the next run refines that question and keeps the rest
    (tmp_path / "cut.png").write_bytes((tmp_path / "good.png").read_bytes())
    assert refine_file(args, refiner=toy_refiner, log=lines.append) == 2
    again = {r["id"]: r for r in map(json.loads, open(tmp_path / "o.jsonl", encoding="utf-8"))}
    assert "image_error" not in again["cut"] and again["good"] == out["good"] and "image_error" in again["strip"]


def test_refine_without_a_model_is_named(tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "a", "image": "a.png", "question": "?"}) + "\n")
    with pytest.raises(ValueError, match="--model is required"):
        refine_file(RefineArgs(queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "o.jsonl")), **QUIET)


def test_a_checkpoint_away_from_its_run_says_which_settings_it_refines_with(tiny_refiner, tmp_path, capsys):
    """Without refiner.json or the run record, a checkpoint was refined with our wikiseeker prompt and 256 tokens,
    whatever it was trained with, and nothing said so."""
    import shutil

    from rl.refine import FALLBACK_GENERATION

    shutil.copytree(tiny_refiner, tmp_path / "moved" / "checkpoint-1")
    refiner = Refiner.load(tmp_path / "moved" / "checkpoint-1")
    said = capsys.readouterr().out
    assert "neither refiner.json" in said and "wikiseeker prompt, up to 256 new tokens" in said
    assert refiner.spec == {"prompt": prompt_spec("wikiseeker"), "generation": FALLBACK_GENERATION}
    spec = {"prompt": prompt_spec("toy"), "generation": FALLBACK_GENERATION}
    (tmp_path / "moved" / "checkpoint-1" / "refiner.json").write_text(json.dumps(spec))
    Refiner.load(tmp_path / "moved" / "checkpoint-1")  # nothing to say where the settings are known
    assert capsys.readouterr().out == ""


def test_vllm_backend_without_vllm_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    spec = {"prompt": prompt_spec("toy"), "generation": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 40}}
    (tmp_path / "refiner.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="vLLM"):
        Refiner.load(tmp_path, backend="vllm")
    with pytest.raises(ValueError, match="--backend"):
        Refiner.load(tmp_path, backend="tgi")


def test_exported_refiner_loads_and_refines(config, tiny_world, tmp_path):
    tg.main(config(max_steps=1, save_strategy="steps", save_steps=1))
    folder = export(
        ExportArgs(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "serve"), dtype="fp32", verify=False), **QUIET
    )  # loaded below, in this process (the fresh-process check: tests/test_export.py)
    refiner = Refiner.load(folder)
    assert refiner.spec["prompt"]["name"] == "toy"
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:4]
    from PIL import Image

    queries = refiner.refine([Image.open(tiny_world / r["image"]) for r in rows], [r["question"] for r in rows])
    assert len(queries) == 4 and all(q.startswith(r["question"]) for q, r in zip(queries, rows))


def test_the_training_image_budget_reaches_export_refine_and_vllm(config, tiny_world, tmp_path, monkeypatch):
    """Trained with max_pixels 64·28², the exported folder, refiner.json, rl.refine (HF and the vLLM arguments) and
    the printed `vllm serve` command all carry it: an oversized image becomes at most 64 image tokens."""
    from PIL import Image

    budget = {"min_pixels": 112 * 112, "max_pixels": 64 * 28 * 28}  # toy images still seen at 112 px, as trained
    tg.main(config(max_steps=1, save_strategy="steps", save_steps=1, **budget))
    printed = []
    folder = export(
        ExportArgs(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "serve"), dtype="fp32", verify=False),
        log=printed.append,
    )
    assert printed[-2].endswith("not verified (--verify false)")
    assert json.loads((folder / "refiner.json").read_text())["image_budget"] == budget
    assert f"--mm-processor-kwargs '{json.dumps(budget)}'" in printed[-1]
    refiner = Refiner.load(folder)
    seen = []
    pad = refiner.model.config.image_token_id
    refiner.model.register_forward_pre_hook(
        lambda m, a, kw: (
            seen.append(int((kw["input_ids"] == pad).sum(-1).max()))
            if kw.get("input_ids") is not None and kw["input_ids"].shape[1] > 1
            else None
        ),
        with_kwargs=True,
    )
    big = Image.open(
        tiny_world / json.loads(open(tiny_world / "test.jsonl", encoding="utf-8").readline())["image"]
    ).resize((900, 700))
    refiner.refine([big], ["Where does it live?"])
    assert seen and 0 < max(seen) <= 64
    unbudgeted = Refiner.load(folder)
    unbudgeted.processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    from rl.image_budget import image_token_count

    assert image_token_count(unbudgeted.processor, big)[0] > 64 >= image_token_count(refiner.processor, big)[0]
    calls = []
    monkeypatch.setattr("rl.refine.load_vllm", lambda path, image_budget=None, **k: calls.append(image_budget))
    Refiner.load(folder, backend="vllm")
    assert calls == [budget]


def test_decoding_never_comes_from_the_models_generation_config(tiny_refiner, tiny_world, tmp_path):
    """A model folder whose generation_config.json sets top_k 1 and a repetition penalty (as Qwen2.5-VL's does):
    greedy output equals the same weights' with a neutral config, and sampling is not turned into greedy by top_k 1."""
    import shutil

    from PIL import Image

    from rl.generate import NEUTRAL, generate_completions, hf_decoding

    qwen_like = tmp_path / "qwen-like"
    shutil.copytree(tiny_refiner, qwen_like)
    gen = json.loads((qwen_like / "generation_config.json").read_text())
    (qwen_like / "generation_config.json").write_text(json.dumps(gen | {"top_k": 1, "repetition_penalty": 1.5}))
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:4]
    images = [Image.open(tiny_world / r["image"]).convert("RGB") for r in rows]
    questions = [r["question"] for r in rows]
    outputs = {}
    for name, folder in (("neutral", tiny_refiner), ("qwen_like", qwen_like)):
        model, processor = load_model(str(folder), "float32", device="cpu")
        outputs[name] = generate_completions(model, processor, images, questions, prompt="toy", max_new_tokens=24)
        if name == "qwen_like":
            torch.manual_seed(0)
            samples = generate_completions(
                model,
                processor,
                images[:1] * 6,
                questions[:1] * 6,
                prompt="toy",
                max_new_tokens=24,
                do_sample=True,
                sampling={"temperature": 1.5},
            )
    assert outputs["qwen_like"] == outputs["neutral"]
    assert len(set(samples)) > 1  # top_k 1 from the folder would make every sample the greedy one
    assert hf_decoding(True, {"temperature": 0.7}) == dict(do_sample=True, **(NEUTRAL | {"temperature": 0.7}))


def test_a_transparent_image_reaches_the_vlm_at_inference_as_in_training(tiny_refiner, tmp_path):
    """TRL hands the processor a dataset image as the file holds it, and transformers composites transparency onto
    white; open_vlm_image gives inference the same pixels (PIL's convert("RGB") kept the colour under the alpha)."""
    import numpy as np
    from PIL import Image

    from rl.model import load_model, open_vlm_image

    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[..., 0] = 200  # red under a transparent half
    rgba[:, :32, 3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "logo.png")
    _, processor = load_model(str(tiny_refiner), "float32", device="cpu")
    pixels = lambda im: processor.image_processor(images=im, return_tensors="pt")["pixel_values"]  # noqa: E731
    training = pixels(Image.open(tmp_path / "logo.png"))
    assert torch.allclose(pixels(open_vlm_image(tmp_path / "logo.png")), training)
    assert not torch.allclose(pixels(Image.open(tmp_path / "logo.png").convert("RGB")), training)


@pytest.mark.parametrize("cap,words,ok", [(None, 128, True), (None, 129, False), (3, 3, True), (3, 4, False)])
def test_refine_parses_with_the_query_cap_training_scored_with(toy_refiner, monkeypatch, cap, words, ok):
    """A query longer than the run's max_query_tokens earned the format penalty in training: rl.refine does not take
    it either (the cap from refiner.json; 128, the training default, for a folder written before it was recorded)."""
    from rewards.format import format_completion

    spec = dict(toy_refiner.spec, **({"max_query_tokens": cap} if cap else {}))
    refiner = Refiner(toy_refiner.model, toy_refiner.processor, spec)
    query = " ".join(["star"] * words)
    monkeypatch.setattr(
        refiner, "generate", lambda images, questions, **kw: [format_completion(query)] * len(questions)
    )
    (out,) = refiner.refine_with_outputs([None], ["which shape?"])
    assert out["format_ok"] is ok and out["refined_query"] == (query if ok else "which shape?")


def test_vllm_sampling_is_seeded_per_request_from_torchs_generator(tiny_refiner, monkeypatch):
    """rl.generate.generate_vllm up to vLLM's boundary (``SamplingParams`` and ``LLM.generate`` replaced by recording
    stand-ins): sampling, every request carries its own seed, drawn from torch's generator, so the gate data's
    ``torch.manual_seed`` per batch makes a rerun draw the same samples with vLLM too, and R copies of one question
    are not R copies of one answer; greedy requests carry none."""
    import sys
    from types import ModuleType, SimpleNamespace

    from PIL import Image
    from transformers import AutoProcessor

    from rl.generate import generate_vllm

    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    received = []

    class RecordingLLM:
        def generate(self, prompts, params):
            received.append((prompts, params))
            return [SimpleNamespace(outputs=[SimpleNamespace(text="an answer")]) for _ in prompts]

    processor = AutoProcessor.from_pretrained(str(tiny_refiner))
    image = Image.new("RGB", (112, 112), "red")

    def seeds(sample: bool, seed: int = 7) -> list:
        torch.manual_seed(seed)
        out = generate_vllm(RecordingLLM(), processor, [image] * 4, ["Which bird?"] * 4, "toy", 8, do_sample=sample)
        prompts, params = received[-1]
        assert out == ["an answer"] * 4 and len(prompts) == len(params) == 4
        return [p.seed for p in params]

    first = seeds(True)
    assert first == seeds(True) and len(set(first)) == 4 and all(isinstance(s, int) for s in first)
    assert seeds(True, seed=8) != first
    assert seeds(False) == [None] * 4


@pytest.mark.parametrize("top_k,expected", [(-1, 0), (None, 0), (0, 0), (5, 5)])
def test_top_k_off_is_zero_for_both_backends(top_k, expected):
    """vLLM (and TRL, which passes it on) takes -1 for "off"; transformers refuses it: a run trained with -1 is
    refined and exported with 0."""
    from rl.generate import hf_decoding, sampling_settings

    assert sampling_settings({"top_k": top_k})["top_k"] == expected
    assert hf_decoding(True, {"top_k": top_k})["top_k"] == expected


def test_an_image_past_the_pixel_limit_reaches_the_vlm_as_in_training(tiny_world, monkeypatch):
    """Training's image column holds such an image downscaled (rl.data.image_column_value); open_vlm_image raised
    PIL's DecompressionBombError, which ended rl.refine, rl.baselines and the pipeline at that question."""
    import io

    import numpy as np
    from PIL import Image

    from rl.data import image_column_value
    from rl.model import open_vlm_image

    path = str(next((tiny_world / "images").glob("*.png")))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # the toy image is past it (more than twice the limit)
    trained = Image.open(io.BytesIO(image_column_value(path)["bytes"])).convert("RGB")
    assert np.array_equal(np.asarray(open_vlm_image(path)), np.asarray(trained))


class TemplateOnly:
    """A processor stand-in for the vLLM path, which only renders the chat template (vLLM runs its own processor)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return json.dumps(messages)


@pytest.mark.parametrize(
    "do_sample,sampling,expected",
    [
        (False, None, dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)),
        (  # greedy keeps the run's repetition penalty, as generate_completions does, and nothing else
            False,
            {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3},
            dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.3),
        ),
        (True, None, dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)),
        (
            True,
            {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.3},
            dict(temperature=0.7, top_p=0.9, top_k=0, min_p=0.1, repetition_penalty=1.3),
        ),
    ],
)
def test_vllm_requests_carry_every_decoding_setting(monkeypatch, do_sample, sampling, expected):
    """generate_vllm's SamplingParams (vLLM replaced by a recording stand-in): greedy is temperature 0 with the run's
    repetition penalty, sampling takes every recorded setting (top_k -1 as 0, min_p None as 0), each at most
    max_new_tokens; one image a prompt, the prompt's image block rendered, outputs in input order."""
    import sys
    from types import ModuleType, SimpleNamespace

    from rl.generate import generate_vllm

    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    received = []

    class RecordingLLM:
        def generate(self, prompts, params):
            received.append((prompts, params))
            return [SimpleNamespace(outputs=[SimpleNamespace(text=f"answer {i}")]) for i in range(len(prompts))]

    images = ["image a", "image b"]
    torch.manual_seed(5)
    out = generate_vllm(RecordingLLM(), TemplateOnly(), images, ["q1", "q2"], "toy", 9, do_sample, sampling)
    ((prompts, params),) = received
    assert out == ["answer 0", "answer 1"]
    assert [p["multi_modal_data"] for p in prompts] == [{"image": "image a"}, {"image": "image b"}]
    assert all('"type": "image"' in p["prompt"] and f"q{i + 1}" in p["prompt"] for i, p in enumerate(prompts))
    for p in params:
        assert {k: v for k, v in p.items() if k != "seed"} == dict(max_tokens=9, **expected)
    torch.manual_seed(5)
    seeds = torch.randint(0, 2**31 - 1, (2,)).tolist() if do_sample else [None, None]
    assert [p["seed"] for p in params] == seeds


class DrawingRefiner:
    """A refiner stand-in for refine_file: each output is a draw from torch's generator (what sampling reads), and
    every other one does not parse."""

    def __init__(self):
        self.calls = []

    def refine_with_outputs(self, images, questions, batch_size, sample):
        self.calls.append((len(images), list(questions), batch_size, sample))
        draws = torch.randint(0, 10**9, (len(questions),)).tolist()
        return [
            {"refined_query": f"{q} {d}" if i % 2 == 0 else q, "raw_output": str(d), "format_ok": i % 2 == 0}
            for i, (q, d) in enumerate(zip(questions, draws))
        ]


def test_refine_file_seeds_each_batch_by_its_position_and_says_its_parse_rate(tiny_world, tmp_path):
    """What refine_file does around the model, with a stand-in: the records in input order (each the input row plus
    the refiner's fields), the draw of a sampled batch from --seed + its first question's position (not from what
    ran before), greedy batches left to the generator as it is, the settings it records and the parse rate it says."""
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:5]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(name, **kw):
        refiner, said = DrawingRefiner(), []
        args = RefineArgs(
            queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / name), images_root=str(tiny_world), **kw
        )
        torch.manual_seed(99)
        assert refine_file(args, refiner=refiner, log=said.append) == 5
        out = [json.loads(x) for x in open(tmp_path / name, encoding="utf-8")]
        settings = json.loads((tmp_path / name.replace(".jsonl", ".settings.json")).read_text())
        return refiner, said, out, settings

    refiner, said, out, settings = run("s.jsonl", batch_size=2, sample=True, seed=7)
    assert [(n, s, b) for n, _, b, s in refiner.calls] == [(2, True, 2), (2, True, 2), (1, True, 2)]
    expected = []
    for start in (0, 2, 4):
        torch.manual_seed(7 + start)
        expected += torch.randint(0, 10**9, (min(2, 5 - start),)).tolist()
    assert [r["raw_output"] for r in out] == [str(d) for d in expected]
    assert [{k: r[k] for k in rows[0]} for r in out] == rows  # every input field kept, in input order
    assert [r["format_ok"] for r in out] == [True, False, True, False, True]
    assert [r["refined_query"] == r["question"] for r in out] == [False, True, False, True, False]
    assert settings["sample"] is True and settings["seed"] == 7 and settings["backend"] == "hf"
    assert any("refine: 3 of 5 output(s) here parsed (60.0 %); the other 2 kept their question" in s for s in said)

    refiner, _, greedy, settings = run("g.jsonl", batch_size=5, seed=7)  # a seed means nothing without --sample
    torch.manual_seed(99)
    assert [r["raw_output"] for r in greedy] == [str(d) for d in torch.randint(0, 10**9, (5,)).tolist()]
    assert refiner.calls[0][3] is False and settings["sample"] is False and settings["seed"] is None


@pytest.mark.parametrize(
    "do_sample,sampling,expected",
    [
        (False, None, dict(do_sample=False, temperature=None, top_p=None, top_k=None, repetition_penalty=1.0)),
        (
            False,
            {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3},
            dict(do_sample=False, temperature=None, top_p=None, top_k=None, repetition_penalty=1.3),
        ),
        (True, {}, dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)),
        (
            True,
            {
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 5,
                "min_p": 0.1,
                "repetition_penalty": 1.3,
                "max_new_tokens": 9,
            },
            dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.3),
        ),
    ],
)
def test_transformers_generate_gets_every_decoding_setting(do_sample, sampling, expected):
    """Greedy: the run's repetition penalty and nothing a folder's generation_config.json could fill in; sampling:
    every setting the run recorded, TRL's neutral value for the rest, nothing else (the length is passed apart)."""
    from rl.generate import hf_decoding

    assert hf_decoding(do_sample, sampling) == expected


@pytest.mark.parametrize("budget", [None, {"min_pixels": 3136, "max_pixels": 12544}])
def test_a_vllm_engine_gets_one_image_no_video_and_the_budget_and_is_one_per_job(monkeypatch, budget):
    """load_vllm up to vLLM's boundary (``LLM`` a recording stand-in): one image and no video a prompt, the training
    pixel budget as the processor's kwargs; refused under a launcher of several processes (each engine would start
    on the same GPU)."""
    import sys
    from types import ModuleType

    from rl.generate import load_vllm

    vllm, built = ModuleType("vllm"), []
    vllm.LLM = lambda **kw: built.append(kw) or "engine"
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert load_vllm("/x/refiner", image_budget=budget) == "engine"
    expected = {"model": "/x/refiner", "limit_mm_per_prompt": {"image": 1, "video": 0}}
    assert built == [expected | ({"mm_processor_kwargs": budget} if budget else {})]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--backend vllm runs one engine per job, but this is one of 2 launched"):
        load_vllm("/x/refiner", image_budget=budget)
    assert len(built) == 1


def test_a_checkpoint_in_its_run_folder_refines_with_its_runs_settings(tmp_path):
    """refiner.json first; else the run record beside the checkpoint (its prompt, sampling, index, image budget and
    query cap, 128 where an older record lacks it); else our defaults, said. A folder without config.json is refused
    before anything loads."""
    from rl.refine import FALLBACK_GENERATION, load_spec
    from rl.run_record import RUN_RECORD

    record = {
        "prompt": prompt_spec("toy"),
        "generation": {"temperature": 0.7, "max_new_tokens": 12},
        "index": {"alpha": 0.3},
        "image_budget": {"min_pixels": 3136, "max_pixels": 12544},
        "refiner_args": {"max_query_tokens": 9},
    }
    ckpt = tmp_path / "run" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    said = []
    assert load_spec(ckpt, say=said.append) == {"prompt": prompt_spec("wikiseeker"), "generation": FALLBACK_GENERATION}
    assert len(said) == 1 and "neither refiner.json" in said[0]
    (tmp_path / "run" / RUN_RECORD).write_text(json.dumps(record))
    assert load_spec(ckpt, say=said.append) == {k: v for k, v in record.items() if k != "refiner_args"} | {
        "max_query_tokens": 9
    }
    (tmp_path / "run" / RUN_RECORD).write_text(json.dumps(record | {"refiner_args": {}}))
    assert load_spec(ckpt, say=said.append)["max_query_tokens"] == 128
    (ckpt / "refiner.json").write_text(json.dumps({"prompt": "exported"}))
    assert load_spec(ckpt, say=said.append) == {"prompt": "exported"} and len(said) == 1
    with pytest.raises(ValueError, match="--model: .*checkpoint-5 has no config.json"):
        Refiner.load(ckpt)


def test_what_refine_file_refuses_before_any_model_loads(tiny_world, tmp_path):
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:3]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
    args = RefineArgs(model="m", queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "o.jsonl"))
    for change, message in [
        ({"backend": "tgi"}, "--backend must be one of hf, vllm, got 'tgi'"),
        ({"queries": str(tmp_path / "none.jsonl")}, "none.jsonl"),
        ({"out": None}, "--out is required"),
        ({"out": args.queries}, "--out"),
        ({"batch_size": 0}, "--batch_size must be positive, got 0"),
        ({"images_root": str(tiny_world)}, "q.jsonl"),  # an id given twice
    ]:
        with pytest.raises(ValueError, match=message):
            refine_file(RefineArgs(**{**vars(args), **change}), refiner=DrawingRefiner(), **QUIET)
    with pytest.raises(ValueError, match="image"):  # the images are under tiny_world
        refine_file(args, refiner=DrawingRefiner(), **QUIET)
    assert not (tmp_path / "o.jsonl").exists()
