"""The pipeline's stages, one small object each, in the order of WikiSeeker's Figure 2: the boundary gate, the VLM
answering alone, the refiner, retrieval, reranking, the Inspector, the generator — and the judge that scores answers by
the benchmark's rule. Each loads its model on one explicit device and dtype and has one batch method; ``Stages``
loads them all (a failure names its stage) and records where each runs. gate.pipeline strings them together."""

from __future__ import annotations

import numpy as np

from common.llm import endpoint_generator, text_generator
from common.placement import dtype_name, local_rank, resolve_device, resolve_dtype
from common.prompts import load_prompt
from gate.pipeline.bem import BEMScorer
from gate.pipeline.consistency import ConsistencyChecker
from gate.pipeline.context import resolve_alpha, section_text, vlm_answerer
from gate.pipeline.metrics import official_correct, token_accuracy
from gate.pipeline.rerank import combine, load_reranker, load_text_reranker, within_article
from gate.scoring import check_threshold, first_token_scores, gate_of, generate_parsed
from gate.variants import completion
from retrieval.index import MultimodalIndex
from retrieval.upstream.articles import open_store
from rl.refine import Refiner

BOUNDARY_VARIANTS = ("hkb", "skb", "kbm-acc", "kbm-cert", "ret")
GENERATOR_PROMPTS = {
    "infoseek": {
        "system": "You are a helpful assistant that answers questions about an image using a retrieved "
        "encyclopedia section. Answer with a short phrase only: an entity, a number or a date.",
        "user_template": "Context: {context}\nQuestion: {question}\nShort answer:",
    },
    "evqa": {
        "system": "You are a helpful assistant that answers questions about an image using a retrieved "
        "encyclopedia section. Answer in a few words, without explanation.",
        "user_template": "Context: {context}\nQuestion: {question}\nAnswer:",
    },
    "toy": {
        "system": "Answer the question about the image with a short phrase.",  # the toy answerer's own prompt
        "user_template": "Context: {context}\nQuestion: {question}",
    },
}


def generator_prompt(value: str) -> dict:
    """A built-in generator prompt by name (``GENERATOR_PROMPTS``) or a YAML prompt file with ``{context}`` and
    ``{question}`` in its user template (rl.prompts.load_prompt)."""
    return load_prompt(value, GENERATOR_PROMPTS, ("{question}", "{context}"), "--generator_prompt")


class BoundaryGate:
    """A trained hkb / skb / kbm / ret gate: its score per question (P(search), or the expected 1–5 for skb) and the
    decision score ≥ γ (ε for skb)."""

    def __init__(self, path: str, threshold: float | None, device: str, dtype: str | None):
        self.model, self.processor, self.spec = gate_of(path, device, dtype, *BOUNDARY_VARIANTS)
        self.threshold = check_threshold(self.spec["name"], threshold, "--gate_threshold")

    def __call__(self, images, questions) -> list[float]:
        return [
            float(x)
            for x in first_token_scores(
                self.model, self.processor, self.spec, images, questions, batch_size=len(questions)
            )
        ]


class Answerer:
    """The VLM without retrieval: its greedy answer per question."""

    def __init__(self, path: str, max_new_tokens: int, device: str, dtype: str | None):
        self._generate = vlm_answerer(path, max_new_tokens, device=device, dtype=dtype)

    def __call__(self, images, questions) -> list[str]:
        return [t.strip() for t in self._generate(images, questions, False)]


class Retriever:
    """The index: top-k entities (their best sections) and the gold entity's rank for each query."""

    def __init__(self, args, refiner, device: str):
        self.k = args.k
        self.index = MultimodalIndex.load(args.index, device=device)
        self.alpha = resolve_alpha(args.alpha, refiner, self.index.manifest)
        self.encoders = (self.index.image_encoder, self.index.text_encoder)  # loaded now, not mid-run

    def __call__(self, images, queries, entity_ids):
        text_emb = self.index.encode_texts(queries)
        hits, ranks = self.index.search_and_rank(images, text_emb, [str(e) for e in entity_ids], self.alpha, self.k)
        return text_emb, hits, ranks


SKIPPED_SECTIONS = ("external links", "references")  # as EchoSight: no evidence there


class SectionRanker:
    """The section a question gets: the best article after the first-stage reranker (β1·retrieval +
    (1−β1)·reranker over the top-k sections), then that article's best section among all its sections in the article
    store ((1−β2)·text similarity to the query + β2·text reranker; text similarity alone without one)."""

    def __init__(self, args, index, device: str, dtype: str | None):
        self.index, self.beta1, self.beta2 = index, args.beta1, args.beta2
        self.store = open_store(args.kb or index.manifest["kb_path"], args.articles)
        self.reranker = load_reranker(args.reranker, device, dtype, tuple(args.reranker_verbalisers.split(",")))
        self.text_reranker = load_text_reranker(args.text_reranker, device, dtype)
        self.section_emb: dict[str, np.ndarray] = {}  # each section embedded once per run

    def article_sections(self, entity_id: str) -> list[dict]:
        """Every section of an article from the store (not only those paired with an image in the index)."""
        return self.store.sections(entity_id, skip_titles=SKIPPED_SECTIONS) or self.store.sections(
            entity_id
        )  # an article of references only still has something to show

    def first_stage(self, images, questions, hits) -> list[list[dict]]:
        """Each question's top-k sections (article-store entries), best first by β1·retrieval + (1−β1)·reranker
        (the retrieval order without a reranker)."""
        entries = [[self.store.entry(h.entry_id) for h in hs] for hs in hits]
        missing = [h.entry_id for hs, es in zip(hits, entries) for h, e in zip(hs, es) if e is None]
        if missing:
            raise ValueError(
                f"article store {self.store.path} has no entry {missing[0]!r} ({len(missing)} missing): "
                "it was built from another KB than the index"
            )
        if self.reranker is None:
            return entries
        rr = self.reranker.score(images, questions, [[section_text(e) for e in es] for es in entries])
        order = [np.argsort(-combine([h.score for h in hs], r, self.beta1), kind="stable") for hs, r in zip(hits, rr)]
        return [[es[j] for j in o] for es, o in zip(entries, order)]

    def within(self, images, questions, text_emb, entity_ids) -> list[dict]:
        """The chosen article's best section per question: (1−β2)·text similarity to the query + β2·text reranker."""
        template = self.index.manifest.get("text_template", "{title}. {section_title}. {text}")
        articles = [self.article_sections(e) for e in entity_ids]
        flat = [e for art in articles for e in art]
        new = list({e["entry_id"]: e for e in flat if e["entry_id"] not in self.section_emb}.values())
        if new:
            emb = self.index.encode_documents([template.format(**{"section_title": "", **e}) for e in new])
            self.section_emb.update({e["entry_id"]: v for e, v in zip(new, emb)})
        sims = np.stack([self.section_emb[e["entry_id"]] for e in flat]) if flat else None
        rr2 = (
            self.text_reranker.score(images, questions, [[section_text(e) for e in art] for art in articles])
            if self.text_reranker is not None
            else None
        )
        out, i = [], 0
        for q, art in enumerate(articles):
            sim = sims[i : i + len(art)] @ text_emb[q]
            i += len(art)
            score = within_article(sim, rr2[q], self.beta2) if rr2 is not None else sim
            out.append(art[int(np.argmax(score))])
        return out


class Inspector:
    """WikiSeeker's Inspector: PASS when P(pass) ≥ its threshold; on FAIL, its own answer, generated after the FAIL
    verdict written for it: at a threshold other than 0.5 a section can fail with P(pass) above 0.5, where free
    generation would write PASS and no answer."""

    def __init__(self, path: str, threshold: float, device: str, dtype: str | None):
        self.model, self.processor, self.spec = gate_of(path, device, dtype, "inspector")
        self.threshold = threshold

    def __call__(self, images, questions, contexts) -> list[dict]:
        n = len(questions)
        p = first_token_scores(self.model, self.processor, self.spec, images, questions, contexts, batch_size=n)
        fail = [i for i in range(n) if p[i] < self.threshold]
        parsed = (
            generate_parsed(
                self.model,
                self.processor,
                self.spec,
                [images[i] for i in fail],
                [questions[i] for i in fail],
                [contexts[i] for i in fail],
                batch_size=max(1, len(fail)),
                reply_prefix=completion(self.spec, {"pass": "false", "answer": ""})[: -len('"}')],
            )
            if fail
            else []
        )
        out = [{"pass": True, "p_pass": float(x), "answer": None} for x in p]
        for i, res in zip(fail, parsed):
            out[i] = {"pass": False, "p_pass": float(p[i]), "answer": (res or {}).get("answer")}
        return out


def load_generator(args, device: str, dtype: str | None):
    """generate(images, questions, contexts) → [(answer or None, why not)]: a text LLM, a VLM, or an endpoint."""
    prompt = generator_prompt(args.generator_prompt)
    if args.generator == "endpoint":
        return endpoint_generator(
            args.generator_url,
            args.generator_model,
            prompt,
            args.generator_key_env,
            args.max_new_tokens,
            retries=args.generator_retries,
            backoff=args.generator_backoff,
        )
    if args.generator_image:
        vlm = vlm_answerer(args.generator, args.max_new_tokens, system=prompt["system"], device=device, dtype=dtype)

        def generate(images, questions, contexts):
            texts = [prompt["user_template"].format(question=q, context=c) for q, c in zip(questions, contexts)]
            return [(a.strip() or None, None if a.strip() else "empty answer") for a in vlm(images, texts, False)]

        return generate
    try:
        return text_generator(args.generator, prompt, args.max_new_tokens, device=device, dtype=dtype)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ValueError(
            f"generator {args.generator}: not a text-only causal LM ({str(e).splitlines()[0][:160]}); a "
            "vision-language model answers with generator_image: true"
        ) from None


class Judge:
    """Answers scored by the benchmark's official rule (``metric``), BEM loaded once for ``evqa``."""

    def __init__(self, args, device: str):
        self.metric = args.metric
        self.bem = None
        if args.metric == "evqa" and args.bem != "none":
            self.bem = BEMScorer(
                args.bem, device=args.bem_device or device, dtype=args.dtype or "auto", batch_size=args.batch_size
            )

    def __call__(self, pairs: list[tuple[dict, dict]]) -> None:
        """Fill ``correct`` and ``token_accuracy`` into each answer dict of (question record, answer dict) pairs, with
        one BEM call for the whole list."""
        if not pairs:
            return
        correct = official_correct(self.metric, [r for r, _ in pairs], [a["answer"] for _, a in pairs], self.bem)
        for (r, a), ok in zip(pairs, correct):
            a["correct"] = bool(ok)
            a["token_accuracy"] = (
                token_accuracy(a["answer"], r.get("answers") or []) if a["answer"] is not None else 0.0
            )


# the stages `stage_gpus` places, and the order placement names them in
PLACED_STAGES = ("gate", "answerer", "refiner", "index", "reranker", "consistency", "inspector", "generator", "bem")


def parse_stage_gpus(text: str | None, gpus_per_process: int) -> dict[str, int]:
    """``"gate:0,inspector:1"`` → {stage: GPU offset within a process's ``gpus_per_process`` GPUs}; a ValueError
    names an unknown stage, a malformed part or an offset the process does not have."""
    if not isinstance(gpus_per_process, int) or gpus_per_process < 1:
        raise ValueError(f"--gpus_per_process must be a positive integer, got {gpus_per_process!r}")
    out = {}
    for part in str(text or "").split(","):
        if not part.strip():
            continue
        name, _, offset = (x.strip() for x in part.partition(":"))
        if name not in PLACED_STAGES:
            raise ValueError(f"--stage_gpus: unknown stage {name!r} (stages: {', '.join(PLACED_STAGES)})")
        if not offset.isdigit():
            raise ValueError(f"--stage_gpus: {part.strip()!r} is not stage:GPU (a GPU offset such as gate:0)")
        if int(offset) >= gpus_per_process:
            raise ValueError(
                f"--stage_gpus: {name} on GPU {offset} of the process's {gpus_per_process} (--gpus_per_process): "
                f"offsets run from 0 to {gpus_per_process - 1}"
            )
        out[name] = int(offset)
    return out


def stage_devices(args, device: str, rank: int, visible_gpus: int) -> dict[str, str]:
    """Each stage's device. One GPU a process (the default): every stage on ``device``. With ``gpus_per_process`` k,
    process ``rank`` (its local rank) holds GPUs rank·k … rank·k + k − 1 and each stage goes to the one
    ``stage_gpus`` names (the first when unnamed): the paper's stages do not fit one 80 GB GPU (docs/scaling.md)."""
    k, offsets = args.gpus_per_process, parse_stage_gpus(args.stage_gpus, args.gpus_per_process)
    if k == 1 and not offsets:
        return dict.fromkeys(PLACED_STAGES, device)
    if not device.startswith("cuda"):
        raise ValueError(
            f"--gpus_per_process {k} / --stage_gpus {args.stage_gpus!r} spread the stages over GPUs; this process "
            f"runs on {device}"
        )
    if (rank + 1) * k > visible_gpus:
        raise ValueError(
            f"process {rank} takes GPUs {rank * k}–{rank * k + k - 1} (--gpus_per_process {k}), but {visible_gpus} "
            f"are visible: launch {visible_gpus // k or 1} process(es) per node"
        )
    return {s: f"cuda:{rank * k + offsets.get(s, 0)}" for s in PLACED_STAGES}


class Stages:
    """Every stage the configuration names, loaded before the first question on this process's device and dtype (or
    spread over its GPUs: ``stage_devices``); ``placement`` says where each runs (printed, and in metrics.json)."""

    def __init__(self, args, device: str | None = None):
        import torch

        self.args = args
        device, dtype = device or resolve_device(args.device), args.dtype
        self.device, self.dtype = device, dtype
        on = stage_devices(args, device, local_rank(), torch.cuda.device_count())
        load = _load
        self.gate = (
            load("gate", BoundaryGate, args.gate, args.gate_threshold, on["gate"], dtype)
            if args.gate not in ("always", "never")
            else None
        )
        self.answer = (
            load("answerer", Answerer, args.answerer, args.max_new_tokens, on["answerer"], dtype)
            if args.answerer
            else None
        )
        self.refiner = self.retrieve = self.rerank = None
        if args.index:
            if args.refiner != "none":
                self.refiner = load("refiner", lambda: Refiner.load(args.refiner, device=on["refiner"], dtype=dtype))
            self.retrieve = load("index", Retriever, args, self.refiner, on["index"])
            self.rerank = load("reranker", SectionRanker, args, self.retrieve.index, on["reranker"], dtype)
        self.consistency = None
        if args.index and args.consistency != "none":
            self.consistency = load(
                "consistency",
                ConsistencyChecker,
                args.consistency,
                args.consistency_strategy,
                args.consistency_max_new_tokens,
                on["consistency"],
                dtype,
            )
        self.inspect = (
            load("inspector", Inspector, args.inspector, args.inspector_threshold, on["inspector"], dtype)
            if args.inspector != "none"
            else None
        )
        self.generate = load("generator", load_generator, args, on["generator"], dtype) if args.generator else None
        self.judge = load("BEM", Judge, args, on["bem"])

        def where(stage: str) -> str:
            return f"{on[stage]} {dtype_name(resolve_dtype(dtype, on[stage]))}"

        self.placement = {
            name: where(stage)
            for name, stage, present in (
                ("gate", "gate", self.gate),
                ("answerer", "answerer", self.answer),
                ("refiner", "refiner", self.refiner),
                ("reranker", "reranker", self.rerank and self.rerank.reranker),
                ("text reranker", "reranker", self.rerank and self.rerank.text_reranker),
                ("consistency", "consistency", self.consistency),
                ("inspector", "inspector", self.inspect),
                ("generator", "generator", self.generate),
            )
            if present is not None
        }
        if args.generator == "endpoint":
            self.placement["generator"] = f"endpoint {args.generator_url}"
        if self.retrieve is not None:
            index = self.retrieve.index
            self.placement["index"] = f"encoders {index.device}, FAISS {index.search_device}"
            self.placement["index α"] = f"{self.retrieve.alpha:g}" + (" (the refiner's)" if args.alpha is None else "")
        if self.judge.bem is not None:
            self.placement["BEM"] = f"{self.judge.bem.device} {dtype_name(self.judge.bem.dtype)}"


def _load(stage: str, fn, *a):
    try:
        return fn(*a)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{stage}: could not load ({type(e).__name__}: {e})") from e
