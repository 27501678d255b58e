"""What colocated vLLM receives for an image, on TRL's own code path: rl/train_grpo.py runs real GRPO steps with
use_vllm (colocate) where only vLLM's ``LLM`` (and its ``SamplingParams``) are replaced by a recording stand-in — vLLM
cannot run on this kind of machine. TRL tokenizes the prompt with the processor (the image expanded into N pads) and
calls ``LLM.generate`` itself; the stand-in asserts nothing, it records what it was given and answers with a fixed
completion, so the trainer's loss, rewards and weight sync all run. Plus the pure function, table-driven and with
hypothesis."""

import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl.vllm_prompts import collapse_vllm_prompts, fix_colocated_vllm_prompts, image_runs, one_placeholder_per_image

PAD = 7


@pytest.mark.parametrize(
    "ids,expected",
    [
        ([1, 2, 3], [1, 2, 3]),
        ([1, PAD, PAD, PAD, 2], [1, PAD, 2]),
        ([PAD], [PAD]),
        ([], []),
        ([5, PAD, PAD, 6, 5, PAD, PAD, PAD, 6], [5, PAD, 6, 5, PAD, 6]),  # two images: one pad each
        ([PAD, PAD, 1, PAD], [PAD, 1, PAD]),
    ],
)
def test_each_run_of_pads_becomes_one(ids, expected):
    assert one_placeholder_per_image(ids, PAD) == expected


@pytest.mark.parametrize(
    "ids,runs",
    [
        ([1, 2, 3], []),
        ([], []),
        ([PAD], [1]),
        ([1, PAD, PAD, PAD, 2], [3]),
        ([5, PAD, PAD, 6, 5, PAD, PAD, PAD, 6], [2, 3]),  # the probe compares each image's run, not their count
        ([PAD, PAD, 1, PAD], [2, 1]),
    ],
)
def test_image_runs_are_the_length_of_each_run_in_order(ids, runs):
    assert image_runs(ids, PAD) == runs


@given(st.lists(st.sampled_from([1, 2, PAD]), max_size=60))
def test_collapsing_keeps_every_other_token_and_one_pad_per_run(ids):
    out = one_placeholder_per_image(ids, PAD)
    assert [t for t in out if t != PAD] == [t for t in ids if t != PAD]
    assert image_runs(out, PAD) == [1] * len(image_runs(ids, PAD))
    assert one_placeholder_per_image(out, PAD) == out


IMAGE = object()  # the raw image TRL hands vLLM beside the prompt
EXPANDED = [1, PAD, PAD, PAD, 2]


@pytest.mark.parametrize(
    "prompt,sent",
    [
        (
            {"prompt_token_ids": EXPANDED, "multi_modal_data": {"image": IMAGE}},
            {"prompt_token_ids": [1, PAD, 2], "multi_modal_data": {"image": IMAGE}},
        ),
        ({"prompt_token_ids": EXPANDED}, {"prompt_token_ids": EXPANDED}),  # no image: nothing for vLLM to expand
        (
            {"prompt_token_ids": EXPANDED, "multi_modal_data": None},
            {"prompt_token_ids": EXPANDED, "multi_modal_data": None},
        ),
        (
            {"prompt": "a text prompt", "multi_modal_data": {"image": IMAGE}},
            {"prompt": "a text prompt", "multi_modal_data": {"image": IMAGE}},
        ),
        ("a text prompt", "a text prompt"),
    ],
)
def test_the_wrapped_generate_collapses_only_token_prompts_with_images(prompt, sent):
    calls = []
    generate = collapse_vllm_prompts(lambda prompts, *a, **k: calls.append((prompts, a, k)) or "answer", PAD)
    assert generate([prompt, prompt], "sampling", use_tqdm=False) == "answer"
    assert calls == [([sent, sent], ("sampling",), {"use_tqdm": False})]
    assert prompt == sent or prompt["prompt_token_ids"] == EXPANDED  # TRL's own prompt is left as it was


@pytest.mark.parametrize(
    "generation,wrapped",
    [
        (None, False),
        (SimpleNamespace(mode="server"), False),
        (SimpleNamespace(mode="server", llm=SimpleNamespace(generate=print)), False),  # TRL's server client: no LLM
        (SimpleNamespace(mode="colocate", llm=None), False),
        (SimpleNamespace(mode="colocate", llm=SimpleNamespace(generate=print)), True),
    ],
)
def test_only_a_colocated_engine_is_wrapped_and_only_once(generation, wrapped):
    trainer = SimpleNamespace(vllm_generation=generation) if generation is not None else SimpleNamespace()
    assert fix_colocated_vllm_prompts(trainer, PAD) is wrapped
    assert fix_colocated_vllm_prompts(trainer, PAD) is wrapped  # a second call (a second trainer setup) adds nothing
    llm = getattr(generation, "llm", None)
    if wrapped:
        assert llm.generate.wrapped is print  # one wrapper, around the engine's own generate
    elif llm is not None:
        assert llm.generate is print


@pytest.fixture(scope="module")
def probe_processor(tiny_refiner):
    """The refiner's processor under the 56²–112² px budget (the probe image: 12 image tokens), the budget, its pad."""
    from transformers import AutoProcessor

    from rl.image_budget import apply_image_budget, check_budget

    budget = check_budget(3136, 12544)
    processor = apply_image_budget(AutoProcessor.from_pretrained(str(tiny_refiner)), budget)
    return processor, budget, processor.tokenizer.convert_tokens_to_ids(processor.image_token)


def split_run(ids: list[int], pad: int) -> list[int]:
    """As many tokens, the image's run cut in two (its sixth pad another token)."""
    i = ids.index(pad) + 5
    return ids[:i] + [ids[0]] + ids[i + 1 :]


@pytest.mark.parametrize(
    "mode,sampled_from,served,refused",
    [
        ("colocate", lambda ids, pad: ids, None, None),
        ("colocate", lambda ids, pad: [*ids, ids[-1]], None, r"runs \[12\], the trainer's \d+ with \[12\]"),
        ("colocate", split_run, None, r"runs \[5, 6\], the trainer's \d+ with \[12\]"),
        ("server", lambda ids, pad: ids, [12], None),
        ("server", lambda ids, pad: ids, [16], r"the vLLM server makes \[16\] image tokens .* the trainer \[12\]"),
        ("server", split_run, [12], r"vLLM \(server\) samples from another prompt"),
    ],
)
def test_the_probe_compares_vllms_prompt_with_the_trainers(probe_processor, mode, sampled_from, served, refused):
    """The start-up probe on a stand-in of TRL's ``vllm_generation`` (its ``generate`` reports the prompt vLLM
    sampled from; in server mode the client reports the placeholder lengths of the server's own render): vLLM's
    prompt must be the trainer's in length and in its runs of image tokens, and a server must make as many image
    tokens of the image; anything else stops the run. A colocated engine has no server to ask."""
    from rl.vllm_prompts import probe_vllm_prompt

    processor, budget, pad = probe_processor
    client = SimpleNamespace(
        image_features=lambda images: [{"mm_placeholders": {"image": [{"length": n} for n in served]}}]
    )
    generation = SimpleNamespace(
        mode=mode,
        generate=lambda prompts, images, num_generations: ([sampled_from(list(prompts[0]), pad)], None),
        accelerator=SimpleNamespace(is_main_process=True),
        **({"vllm_client": client} if mode == "server" else {}),
    )
    trainer = SimpleNamespace(vllm_generation=generation)
    if refused:
        with pytest.raises(RuntimeError, match=refused):
            probe_vllm_prompt(trainer, processor, budget)
    else:
        probe = probe_vllm_prompt(trainer, processor, budget)
        assert probe["image_tokens"] == [12] and probe["probe_size"] == [261, 224] and probe["prompt_tokens"] > 12
    assert probe_vllm_prompt(SimpleNamespace(), processor, budget) is None  # no vLLM, nothing to compare


def test_a_server_render_is_asked_by_process_0_and_broadcast_to_the_others(monkeypatch):
    """On a process other than 0, which holds no client, the placeholder lengths come from process 0's broadcast
    (here a stand-in that fills the list in place, as torch's does)."""
    import accelerate.utils

    from rl.vllm_prompts import server_image_tokens

    def broadcast(objects, from_process):
        assert from_process == 0
        objects[0] = [12]

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    generation = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=False))  # no vllm_client
    assert server_image_tokens(generation, None) == [12]


class RecordingLLM:
    """vLLM's ``LLM`` at its boundary: what TRL constructs it with and every ``generate`` call, answered with one
    fixed completion per prompt (logprobs included, for TRL's importance-sampling correction)."""

    instances: list = []
    variants: list = []  # completions answered in turn, prompt by prompt, when set (else ``answer`` to each)

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: self.loaded.extend(weights)))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )
        RecordingLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.calls.append(prompts)
        logprob = SimpleNamespace(logprob=-0.5, rank=1)
        answers = [self.variants[i % len(self.variants)] if self.variants else self.answer for i in range(len(prompts))]
        return [
            SimpleNamespace(
                prompt_token_ids=self.expanded(p),
                outputs=[SimpleNamespace(token_ids=list(answer), logprobs=[{t: logprob} for t in answer])],
            )
            for p, answer in zip(prompts, answers)
        ]

    def expanded(self, prompt: dict) -> list[int]:
        """The prompt vLLM reports having sampled from: for the i-th image, the i-th ``<|image_pad|>`` replaced by the
        image's N tokens, N from the HF processor of the folder vLLM loads (vLLM's Qwen2-VL prompt replacement,
        which targets a single pad: an already expanded run of N becomes 2N−1)."""
        from transformers import AutoProcessor

        images = (prompt.get("multi_modal_data") or {}).get("image")
        if images is None:
            return list(prompt["prompt_token_ids"])
        proc = AutoProcessor.from_pretrained(self.kwargs["model"])
        pad = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
        merge = proc.image_processor.merge_size**2
        sizes = [
            int(proc.image_processor(images=[im])["image_grid_thw"][0].prod()) // merge
            for im in (images if isinstance(images, list) else [images])
        ]
        out = []
        for t in prompt["prompt_token_ids"]:
            out += [pad] * sizes.pop(0) if t == pad and sizes else [t]
        return out

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        pass

    def reset_prefix_cache(self):
        pass


@pytest.fixture()
def recording_vllm(tiny_refiner, monkeypatch):
    """vLLM's ``LLM`` and ``SamplingParams`` replaced in TRL's generation module by the recording stand-in, which
    answers with one well-formed completion; returns the refiner's tokenizer."""
    import trl.generation.vllm_generation as vg
    from transformers import AutoProcessor

    from rewards.format import format_completion

    tok = AutoProcessor.from_pretrained(str(tiny_refiner)).tokenizer
    RecordingLLM.instances, RecordingLLM.variants = [], []
    RecordingLLM.answer = tok(format_completion("a red striped star"), add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    monkeypatch.setattr(vg, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vg, "LLM", RecordingLLM, raising=False)
    monkeypatch.setattr(vg, "SamplingParams", lambda **kw: SimpleNamespace(**kw), raising=False)
    return tok


def test_colocated_vllm_receives_one_placeholder_per_image(config, recording_vllm, tiny_world, monkeypatch, capsys):
    import trl.generation.vllm_generation as vg

    import rl.train_grpo as tg

    tok = recording_vllm
    trainer_prompts = []  # what TRL's trainer tokenized (its own prompt ids), recorded on the way through
    generate = vg.VLLMGeneration.generate
    monkeypatch.setattr(
        vg.VLLMGeneration,
        "generate",
        lambda self, prompts, *a, **k: trainer_prompts.extend(prompts) or generate(self, prompts, *a, **k),
    )
    result = tg.main(config(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False, max_steps=2))

    (llm,) = RecordingLLM.instances
    assert llm.kwargs["model"].endswith("vllm-model")  # the policy's folder with the training image budget
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    (probe,), *steps = llm.calls  # the start-up probe first, as one prompt through TRL's generate, then the steps
    # the probe (261×224 px, over the 112² budget) is 12 image tokens in the trainer's prompt, one pad for vLLM
    assert image_runs(probe["prompt_token_ids"], pad) == [1] and image_runs(trainer_prompts.pop(0), pad) == [12]
    sent = [p for call in steps for p in call]
    assert len(steps) == 2 and len(sent) == len(trainer_prompts) == 2 * 8  # 2 steps × 2 prompts × 4 generations
    questions = {json.loads(x)["question"] for x in open(tiny_world / "train.jsonl", encoding="utf-8")}
    for prompt, trainers in zip(sent, trainer_prompts):
        ids = prompt["prompt_token_ids"]
        assert prompt["multi_modal_data"]["image"].size == (56, 56)  # the raw image, for vLLM to process
        assert image_runs(trainers, pad) == [16]  # the trainer's prompt: 112 px → 8×8 patches → 16 image tokens
        assert image_runs(ids, pad) == [1]  # what vLLM gets: one placeholder, which it expands to 16 itself
        assert ids == one_placeholder_per_image(trainers, pad)  # otherwise the very same prompt, token for token
        assert any(q in tok.decode(ids) for q in questions)
    # the trainer kept its expanded prompt: the loss ran on the completions the stand-in gave
    assert [h["step"] for h in result["log_history"] if "loss" in h] == [1, 2]
    assert llm.loaded  # the policy's weights were pushed to the engine before generating
    said = capsys.readouterr().out
    assert "colocated vLLM receives one image placeholder per image" in said
    assert (
        "vLLM probe: a [261, 224] image gives a" in said
        and "-token prompt with image-token runs [12] in vLLM, as in the trainer's" in said
    )


def test_training_is_refused_when_vllm_would_sample_from_another_prompt(config, recording_vllm, tmp_path, monkeypatch):
    """Without the one-placeholder fix, the start-up probe sees vLLM expand the trainer's 12 pads into 23 (2N−1) and
    stops
    the run before any training step."""
    import rl.train_grpo as tg

    monkeypatch.setattr("rl.trainer_parts.fix_colocated_vllm_prompts", lambda *a: False)
    with pytest.raises(
        RuntimeError,
        match=r"its prompt has \d+ tokens with image-token runs \[23\], the trainer's "
        r"\d+ with \[12\]",
    ):
        tg.main(config(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False, max_steps=1))
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "final").exists()


def test_a_lora_adapter_trained_with_vllm_names_the_real_base_model(config, recording_vllm, tiny_refiner, tmp_path):
    """TRL's vLLM loads model.name_or_path, which the entry point points at <output_dir>/vllm-model (links into this
    run); once vLLM is built, the adapter and the config name the real base again, so rl.export works elsewhere."""
    import rl.train_grpo as tg

    tg.main(
        config(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_enable_sleep_mode=False,
            max_steps=1,
            use_peft=True,
            lora_r=4,
            lora_alpha=8,
            lora_target_modules=["q_proj", "v_proj"],
        )
    )
    assert RecordingLLM.instances[0].kwargs["model"].endswith("vllm-model")  # vLLM itself got the budget folder
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_refiner)


def test_lora_with_vllm_leaves_the_frozen_weights_as_they_were(
    config, recording_vllm, tiny_refiner, monkeypatch, capsys
):
    """At every weight sync TRL merges the LoRA adapters into the frozen weights and unmerges them (TRL's own sync
    code, run here up to vLLM's ``load_weights``). Frozen in bf16, each round trip rounded some of them: the adapters
    trained against weights that drifted from the base export merges them into."""
    import torch
    from trl import GRPOTrainer

    tok = recording_vllm

    import rl.train_grpo as tg
    from rl.model import load_model

    trainers = []
    train = GRPOTrainer.train
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, *a, **k: trainers.append(self) or train(self, *a, **k))
    end = tok.convert_tokens_to_ids("<|im_end|>")  # completions that differ in reward: the adapters have a gradient
    RecordingLLM.variants = [RecordingLLM.answer, tok("no query here", add_special_tokens=False)["input_ids"] + [end]]
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])
    tg.main(
        config(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False, max_steps=3, dtype="bfloat16", **lora)
    )
    said = capsys.readouterr().out
    (llm,) = RecordingLLM.instances
    syncs = sum(name.endswith("q_proj.weight") for name, _ in llm.loaded) // 2  # two layers' q_proj a sync
    assert syncs >= 3  # the probe's and each step's: the adapters moved before the later ones
    base = dict(load_model(str(tiny_refiner), "float32", device="cpu")[0].named_parameters())
    model = trainers[0].model
    frozen = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): p
        for n, p in model.named_parameters()
        if ".base_layer." in n
    }
    assert len(frozen) == 8 and set(frozen) <= set(base)  # q_proj and v_proj, weight and bias, of two layers
    assert all(p.dtype == torch.float32 for p in frozen.values())
    assert any(
        float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n
    )  # adapters trained
    drift = max(float((p.detach() - base[name].detach()).abs().max()) for name, p in frozen.items())
    assert drift < 1e-6, drift
    assert "weights in float32, frozen (dtype bfloat16 asked for: LoRA with vLLM" in said


class StandInServer:
    """TRL's ``VLLMClient`` with only its network boundary replaced (built as a subclass in ``served_by``): the
    server's render endpoint (``image_features``) processes images with the processor of the folder the server was
    started on, its generate endpoint (``_post``) records each request and answers ``n`` fixed completions with their
    logprobs; weight sync is recorded. TRL's own ``VLLMGeneration.generate``, ``_place_features``,
    ``VLLMClient.generate`` and ``_generate_from_features`` all run."""

    folder: str = ""  # the folder `trl vllm-serve --model` was given
    instances: list = []

    def __init__(self, base_url=None, *args, **kwargs):
        self.base_url, self.model, self.requests, self.synced = base_url, "stand-in", [], []
        type(self).instances.append(self)

    def init_communicator(self, device=0):
        pass

    def get_server_info(self):
        return {"model_config": {"model": self.folder, "logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, params):
        self.synced += [name for name, _ in params]

    def reset_prefix_cache(self):
        pass

    def image_features(self, images, **kwargs):
        from transformers import AutoProcessor

        from rl.image_budget import image_token_count

        proc = AutoProcessor.from_pretrained(self.folder)
        return [
            None
            if not ims
            else {"mm_placeholders": {"image": [{"offset": 0, "length": image_token_count(proc, im)[0]} for im in ims]}}
            for ims in images
        ]

    def _post(self, url, json):
        self.requests.append((url, json))
        tokens = [f"token_id:{t}" for t in self.answer]
        content = [{"token": t, "logprob": -0.5, "top_logprobs": []} for t in tokens]
        return {
            "choices": [{"token_ids": list(self.answer), "logprobs": {"content": content}}]
            * json["sampling_params"]["n"]
        }


@pytest.fixture()
def served_by(recording_vllm, monkeypatch):
    """Returns a function that puts the stand-in server, started on ``folder``, in TRL's generation module."""
    import trl.generation.vllm_generation as vg
    from trl.generation.vllm_client import VLLMClient

    def serve(folder):
        server = type("Server", (StandInServer, VLLMClient), {"folder": folder, "instances": []})
        server.answer = RecordingLLM.answer
        monkeypatch.setattr(vg, "VLLMClient", server)
        return server

    return serve


def test_server_mode_trains_on_the_folder_the_run_wrote(config, recording_vllm, served_by, tmp_path):
    """The server started on the run's own vllm-model folder: the probe passes, its generate requests carry the
    trainer's prompt with the image features placed at its 16-pad run, and the steps train."""
    import rl.train_grpo as tg

    server = served_by(str(tmp_path / "run" / "vllm-model"))
    result = tg.main(config(use_vllm=True, vllm_mode="server", max_steps=1))
    (client,) = server.instances
    probe, *steps = [json for url, json in client.requests]
    pad = recording_vllm.convert_tokens_to_ids("<|image_pad|>")
    assert (
        image_runs(probe["token_ids"], pad) == [12] and probe["features"]["mm_placeholders"]["image"][0]["length"] == 12
    )
    assert steps and all(image_runs(r["token_ids"], pad) == [16] for r in steps)
    assert client.synced  # the policy's weights went to the server
    assert [h["step"] for h in result["log_history"] if "loss" in h] == [1]


def test_server_mode_refuses_a_server_with_another_image_budget(config, served_by, tiny_refiner, tmp_path):
    """The server started on a folder with another pixel budget (a real run's raw model: Qwen2.5-VL's own budget is
    far larger than the training one): TRL would bind its image features, made for more tokens, to the trainer's
    12-pad run; the probe asks the server's render and stops the run before any training step."""
    from transformers import AutoProcessor

    import rl.train_grpo as tg
    from rl.image_budget import apply_image_budget, check_budget

    other = tmp_path / "other-budget"
    apply_image_budget(AutoProcessor.from_pretrained(str(tiny_refiner)), check_budget(3136, 200_704)).save_pretrained(
        other
    )
    server = served_by(str(other))
    with pytest.raises(RuntimeError, match=r"the vLLM server makes \[(\d+)\] image tokens .* the trainer \[12\]"):
        tg.main(config(use_vllm=True, vllm_mode="server", max_steps=1))
    assert server.instances and not list((tmp_path / "run").glob("checkpoint-*"))
    assert not (tmp_path / "run" / "final").exists()
