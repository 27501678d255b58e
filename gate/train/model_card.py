"""A trained gate's model card: what gate/train/sft.py's ``final/`` folder and output dir say about the gate, in place
of TRL's placeholder card.

``gate_card`` is pure: gate.json (variant, verbalisers, base model, prompt) and the held-out figures
(``gate_eval.json``) in, markdown out. ``write_gate_cards`` is the edge gate/train/sft.py calls on the main process
after ``final/`` and ``gate_eval.json`` are written (TRL writes its own card into the output dir at every checkpoint
save, so ours must come last).
"""

from __future__ import annotations

from pathlib import Path

from common.files import read_json
from common.model_card import code_block, figures_table, format_rate, format_value, render_card, write_card
from gate.scoring import DEFAULT_THRESHOLDS, GATE_FILE
from gate.variants import BINARY, spec

# variant → (name, what the gate does, what its training labels mean); labels: gate.train.labels, gate.train.build_data
VARIANTS = {
    "hkb": (
        "hard knowledge boundary",
        "decides whether answering the question about the image needs a search of an external knowledge base, "
        "or whether the model already knows the answer",
        "positive (search needed) when the mean judged score (1–5) of the base VLM's sampled answers is below ε",
    ),
    "skb": (
        "soft knowledge boundary",
        "rates from 1 to 5 how much answering the question about the image needs a search (5 = certainly)",
        "6 − the mean judged score (1–5) of the base VLM's sampled answers, written as one digit (rounded down or "
        "up at random so that the digit's expectation is the score, or to the nearest with `skb_target: round`)",
    ),
    "kbm-acc": (
        "knowledge-boundary model, accuracy labels",
        "says whether it can answer the question about the image reliably (known) or needs to retrieve "
        "knowledge first (unknown)",
        "positive (unknown: search) when the share of the base VLM's sampled answers judged correct is below τ",
    ),
    "kbm-cert": (
        "knowledge-boundary model, certainty labels",
        "says whether it can answer the question about the image reliably (known) or needs to retrieve "
        "knowledge first (unknown)",
        "positive (unknown: search) when the certainty C = 1 − H/Hmax of the base VLM's sampled answers "
        "(entropy over clusters of normalised answers) is below τ; no gold answer is needed",
    ),
    "ret": (
        "retrieval token",
        "decides whether answering the question about the image needs retrieval",
        "positive (retrieve) unless the base VLM answered correctly without retrieval",
    ),
    "srt": (
        "relevance token",
        "decides whether a retrieved document helps answer the question about the image",
        "positive (relevant) when the document turns the base VLM's wrong answer right, negative when it turns a "
        "right answer wrong; documents that change nothing are left out",
    ),
    "mct": (
        "multi-document consistency",
        "lists the numbered retrieved documents that are relevant to the question and consistent with the image "
        "and each other, most relevant first, with a summary of what they say",
        "the positions of the relevant documents: P(relevant) from an SRT gate, or from whether the base VLM's "
        "answer with each document was judged right, then a summary of them (`--mct_rule srt`); or the gold "
        "entity's sections (`--mct_rule gold-entity`)",
    ),
    "inspector": (
        "Inspector",
        "checks whether a retrieved section is about the entity in the image and contains the answer to "
        "the question; when it does not, it answers the question itself",
        "pass when the section is the gold section (the gold entity's, holding the answer), else fail "
        "with the gold answer as its own",
    ),
    "answer": (
        "answerer",
        "answers the question about the image with a short phrase, optionally reading a retrieved section",
        "the gold answer",
    ),
}
POSITIVE = {
    "hkb": "search needed",
    "kbm-acc": "search needed",
    "kbm-cert": "search needed",
    "ret": "retrieval needed",
    "srt": "relevant",
    "inspector": "pass",
}
NO_FIGURES = "No held-out figures: the gate was trained without an `eval_file`, so no `gate_eval.json` was written."


def output_section(variant: str, verbalisers) -> str:
    """What the gate writes, and how the pipeline reads it."""
    verbs = [str(v) for v in verbalisers]
    if variant in BINARY:
        threshold = DEFAULT_THRESHOLDS.get(variant, 0.5)
        shown = (
            [f'`{{"pass": "{verbs[0]}"}}`', f'`{{"pass": "{verbs[1]}", "answer": "…"}}`']
            if variant == "inspector"
            else [f"`{verbs[0]}`", f"`{verbs[1]}`"]
        )
        return (
            f"One of two verbalisers: {shown[0]} (positive: {POSITIVE.get(variant, 'positive')}) or {shown[1]} "
            "(negative). It is read from the first answer token"
            + (' after the JSON opening `{"pass": "`' if variant == "inspector" else "")
            + ": the probability of the positive verbaliser, renormalised over the two, is the gate's score, "
            f"positive when it reaches the threshold γ (default {format_value(float(threshold))})."
            + (
                " A failing section's own answer comes from generating and parsing the JSON."
                if variant == "inspector"
                else ""
            )
        )
    if variant == "skb":
        return (
            f"One digit, {', '.join(f'`{v}`' for v in verbs)} (1 = certainly known, 5 = certainly search). Its "
            "score is the expected digit under the first answer token's probabilities over those digits, compared "
            f"with the threshold t (default {format_value(float(DEFAULT_THRESHOLDS['skb']))}): search at or above it."
        )
    if variant == "mct":
        return 'JSON `{"consistent": [document numbers], "summary": "…"}`, generated and parsed.'
    return "A short answer phrase, generated."


def usage_section(variant: str, folder) -> str:
    load = f'model, processor, spec = load_gate("{folder}", device="cuda")  # spec: variant, verbalisers, prompt'
    if variant in BINARY or variant == "skb":
        threshold = format_value(float(DEFAULT_THRESHOLDS.get(variant, 0.5)))
        code = "\n".join(
            [
                "from gate.scoring import decisions, first_token_scores, load_gate",
                "",
                load,
                "scores = first_token_scores(model, processor, spec, images, questions"
                + (", contexts)" if "{context}" in spec(variant)["user"] else ")"),
                f"positive = decisions(scores, {threshold})",
            ]
        )
        extra = "\n\nHeld-out scoring and a threshold sweep on rendered rows:\n\n" + code_block(
            f"python -m gate.train.evaluation --model {folder} --data ROWS.jsonl --out DIR", "bash"
        )
    else:
        code = "\n".join(
            [
                "from gate.scoring import generate_parsed, load_gate",
                "",
                load,
                "outputs = generate_parsed(model, processor, spec, images, questions, contexts)",
            ]
        )
        extra = ""
    return (
        "Load it with `gate.scoring.load_gate`, which reads `gate.json` and checks the verbalisers:\n\n"
        + code_block(code, "python")
        + extra
    )


def training_line(training: dict | None) -> str:
    """How the gate's weights were trained, from gate.json's ``training`` (a gate saved before it was kept: the
    defaults, said to be such)."""
    if not training:
        return "a LoRA adapter, when one was trained, is merged into the weights (settings not recorded)"
    tower = "vision tower frozen" if training.get("freeze_vision_tower", True) else "vision tower trained too"
    weights = (
        f"a LoRA adapter (r = {training['lora_r']}) merged into the weights"
        if training.get("lora_r") is not None
        else "every weight trained (full fine-tune)"
    )
    return (
        f"{tower}; {weights}; learning rate {format_rate(training.get('learning_rate'))}, "
        f"{format_value(training.get('global_step'))} steps"
    )


def gate_card(info: dict, metrics: dict | None, *, name: str, folder) -> str:
    """The card of a trained gate from its gate.json (``info``) and held-out figures (gate_eval.json; None or {} when
    there are none)."""
    variant = info.get("variant")
    label, does, labels = VARIANTS.get(variant, (str(variant), "(an unknown variant)", "(unknown)"))
    s = (
        spec(variant, info.get("verbalisers"), info.get("prompt"))
        if variant in VARIANTS
        else {"system": "", "user": "", "verbalisers": info.get("verbalisers") or ()}
    )
    base = info.get("base_model")
    context = "{context}" in s["user"] or variant == "answer"
    model = (
        f"- Base model: `{format_value(base)}`\n"
        f"- Variant: `{variant}` ({label}; `gate/variants.py`)\n"
        "- Training: supervised fine-tuning (TRL's SFTTrainer, `gate/train/sft.py`) on rendered gate rows, loss "
        f"on the completion only; {training_line(info.get('training'))}"
    )
    task = (
        f"The gate {does}.\n\n"
        "- Input: one image and the question"
        + (" with a retrieved text as context" if context else "")
        + ", in the model's chat format, with the system prompt and user turn below.\n"
        f"- Output: {output_section(variant, s['verbalisers'])}\n"
        f"- Training labels: {labels}.\n\n"
        "System prompt:\n\n"
        + code_block(str(s["system"] or "(none recorded)"))
        + "\n\nUser turn (`{question}`"
        + (", `{context}`" if "{context}" in s["user"] else "")
        + " filled in):\n\n"
        + code_block(str(s["user"] or "(none recorded)"))
    )
    figures = {k: v for k, v in (metrics or {}).items() if k != "variant"}
    evaluation = (
        (
            "Held-out rows scored after training (`gate_eval.json`): accuracy"
            + (
                " at the default threshold, next to the majority-class baseline to beat"
                if "majority_baseline" in figures
                else " of the parsed output"
            )
            + ".\n\n"
            + figures_table(figures, NO_FIGURES)
        )
        if figures
        else NO_FIGURES
    )
    sections = [
        ("Model", model),
        ("Task", task),
        ("Held-out evaluation", evaluation),
        ("Use", usage_section(variant, folder) if variant in VARIANTS else ""),
    ]
    return render_card(base, ["refine-rl", "gate", str(variant), "sft", "trl"], f"{name}: {label} gate", sections)


def write_gate_cards(output_dir, metrics: dict | None) -> str:
    """Our card over TRL's in a gate's ``final/`` folder and its output dir (main process, after final/ is saved)."""
    output_dir = Path(output_dir)
    info = read_json(output_dir / "final" / GATE_FILE)
    text = gate_card(info, metrics, name=output_dir.resolve().name, folder=(output_dir / "final").resolve())
    for folder in (output_dir / "final", output_dir):
        write_card(folder, text)
    return text
