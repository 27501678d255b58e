"""The pipeline's stages: loading each stage's model (a failure names the stage), the RAG path
(refine → retrieve → rerank → inspect → generate) and one batch through the gate and both answer paths, with
per-stage latency."""

from __future__ import annotations

import time

import numpy as np

from gate.context_data import resolve_alpha, section_text, vlm_answerer
from gate.metrics import official_correct, token_accuracy

BOUNDARY_VARIANTS = ("hkb", "skb", "kbm-acc", "kbm-cert", "ret")
GENERATOR_PROMPTS = {
    "infoseek": {"system": "You are a helpful assistant that answers questions about an image using a retrieved "
                           "encyclopedia section. Answer with a short phrase only: an entity, a number or a date.",
                 "user_template": "Context: {context}\nQuestion: {question}\nShort answer:"},
    "evqa": {"system": "You are a helpful assistant that answers questions about an image using a retrieved "
                       "encyclopedia section. Answer in a few words, without explanation.",
             "user_template": "Context: {context}\nQuestion: {question}\nAnswer:"},
    "toy": {"system": "Answer the question about the image with a short phrase.",  # the toy answerer's own prompt
            "user_template": "Context: {context}\nQuestion: {question}"},
}


class Stages:
    """The loaded models of every stage; a load failure names its stage."""

    def __init__(self, args):
        from retrieval.placement import resolve_device
        from rl.model import resolve_dtype

        self.args = args
        self.device = resolve_device(args.device)  # every model of the pipeline on this process's device
        self.dtype = args.dtype
        self.placement = {}  # stage → "device dtype", reported in metrics.json
        self.gate = self.answer = self.refiner = self.index = None
        self.gate_threshold = self.alpha = None
        self.reranker = self.text_reranker = self.inspector = self.generate = None
        self.store = None  # retrieval.articles.ArticleStore: index rows and every section of every article, on disk
        self.section_emb: dict[str, np.ndarray] = {}
        load = self._load
        if args.gate not in ("always", "never"):
            from gate.scoring import DEFAULT_THRESHOLDS

            self.gate = load("gate", _load_boundary_gate, args.gate, self.device, self.dtype)
            self.gate_threshold = args.gate_threshold if args.gate_threshold is not None else \
                DEFAULT_THRESHOLDS.get(self.gate[2]["name"], 0.5)
        if args.answerer:
            self.answer = load("answerer", _answer_alone, args.answerer, args.max_new_tokens, self.device, self.dtype)
        if args.index:
            self._load_retrieval(load)
        if args.inspector != "none":
            self.inspector = load("inspector", _load_gate_of, args.inspector, self.device, self.dtype, "inspector")
        if args.generator:
            self.generate = load("generator", _load_generator, args, self.device, self.dtype)
        self.bem = None
        if args.metric == "evqa" and args.bem != "none":
            from gate.bem import BEMScorer

            self.bem = load("BEM", lambda: BEMScorer(args.bem, device=args.bem_device or self.device,
                                                     batch_size=args.batch_size))
        where = f"{self.device} {str(resolve_dtype(self.dtype, self.device)).replace('torch.', '')}"
        for stage, obj in (("gate", self.gate), ("answerer", self.answer), ("refiner", self.refiner),
                           ("reranker", self.reranker), ("text reranker", self.text_reranker),
                           ("inspector", self.inspector), ("generator", self.generate)):
            if obj is not None:
                self.placement[stage] = where
        if args.generator == "endpoint":
            self.placement["generator"] = f"endpoint {args.generator_url}"
        if self.index is not None:
            self.placement["index"] = f"encoders {self.index.device}, FAISS {self.index.search_device}"
        if self.bem is not None:
            self.placement["BEM"] = f"{self.bem.device} {str(self.bem.dtype).replace('torch.', '')}"

    def _load_retrieval(self, load) -> None:
        from gate.rerank import load_reranker, load_text_reranker
        from retrieval import MultimodalIndex
        from retrieval.articles import open_store
        from retrieval.cli import require_index

        if self.args.refiner != "none":
            from rl.refine import Refiner

            self.refiner = load("refiner", lambda: Refiner.load(self.args.refiner, device=self.device,
                                                                dtype=self.dtype))
        self.alpha = resolve_alpha(self.args.alpha, self.refiner)
        self.index = load("index", lambda: MultimodalIndex.load(self.args.index, device=self.device))
        load("index encoders", lambda: (self.index.image_encoder, self.index.text_encoder))  # now, not mid-run
        manifest = require_index(self.args.index)
        self.store = load("article store", open_store, self.args.kb or manifest["kb_path"], self.args.articles)
        self.reranker = load("reranker", load_reranker, self.args.reranker, self.device, self.dtype,
                             tuple(self.args.reranker_verbalisers.split(",")))
        self.text_reranker = load("text reranker", load_text_reranker, self.args.text_reranker, self.device,
                                  self.dtype)

    @staticmethod
    def _load(stage: str, fn, *a):
        try:
            return fn(*a)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{stage}: could not load ({type(e).__name__}: {e})") from e


def _load_gate_of(path: str, device: str, dtype: str | None, *variants):
    from gate.scoring import load_gate

    model, processor, s = load_gate(path, device=device, dtype=dtype)
    if s["name"] not in variants:
        raise ValueError(f"{path} is a {s['name']} gate; expected {' or '.join(variants)}")
    return model, processor, s


def _load_boundary_gate(path: str, device: str, dtype: str | None):
    return _load_gate_of(path, device, dtype, *BOUNDARY_VARIANTS)


def _answer_alone(path: str, max_new_tokens: int, device: str, dtype: str | None):
    """answer(images, questions) → the VLM's greedy answers without retrieval."""
    generate = vlm_answerer(path, max_new_tokens, device=device, dtype=dtype)
    return lambda images, questions: [t.strip() for t in generate(images, questions, False)]


def _load_generator(args, device: str, dtype: str | None):
    from gate.generator import endpoint_generator, text_generator

    prompt = GENERATOR_PROMPTS[args.generator_prompt]
    if args.generator == "endpoint":
        return endpoint_generator(args.generator_url, args.generator_model, prompt, args.generator_key_env,
                                  args.max_new_tokens, retries=args.generator_retries, backoff=args.generator_backoff)
    if args.generator_image:
        vlm = vlm_answerer(args.generator, args.max_new_tokens, system=prompt["system"], device=device, dtype=dtype)

        def generate(images, questions, contexts):
            texts = [prompt["user_template"].format(question=q, context=c) for q, c in zip(questions, contexts)]
            return [(a.strip() or None, None if a.strip() else "empty answer") for a in vlm(images, texts, False)]
        return generate
    return text_generator(args.generator, prompt, args.max_new_tokens, device=device, dtype=dtype)


# ---------------------------------------------------------------- running


def answered(answer: str | None, failed: str | None = None) -> dict:
    """An answer, or why there is none (a failed answer is judged wrong)."""
    return {"answer": answer} if answer is not None else {"answer": None, "failed": failed or "no answer"}


def judge(st: Stages, pairs: list[tuple[dict, dict]]) -> None:
    """Fill ``correct`` (the benchmark's official rule, ``args.metric``; BEM once for the whole list) and
    ``token_accuracy`` into each answer dict of (question record, answer dict) pairs."""
    if not pairs:
        return
    correct = official_correct(st.args.metric, [r for r, _ in pairs], [a["answer"] for _, a in pairs], st.bem)
    for (r, a), ok in zip(pairs, correct):
        a["correct"] = bool(ok)
        a["token_accuracy"] = token_accuracy(a["answer"], r.get("answers") or []) if a["answer"] is not None else 0.0


class Clock:
    """Seconds per stage for one batch; per-question latency = batch seconds / questions in the stage."""

    def __init__(self, bars: dict | None = None):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.bars = bars or {}

    def time(self, stage: str, n: int, fn, *a, **kw):
        t = time.perf_counter()
        result = fn(*a, **kw)
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t
        self.counts[stage] = self.counts.get(stage, 0) + n
        if stage in self.bars:
            self.bars[stage].update(n)
        return result

    def per_question(self) -> dict[str, float]:
        return {s: self.seconds[s] / max(1, self.counts[s]) for s in self.seconds}


SKIPPED_SECTIONS = ("external links", "references")  # as EchoSight: no evidence there


def article_sections(st: Stages, entity_id: str) -> list[dict]:
    """Every section of an article from the store (not only those paired with an image in the index)."""
    return st.store.sections(entity_id, skip_titles=SKIPPED_SECTIONS) or \
        st.store.sections(entity_id)  # an article of references only still has something to show


def choose_sections(st: Stages, images, questions, text_emb, hits) -> list[dict]:
    """The selected section per question: the best article after reranking (β1), then the article's best section
    among all its sections in the article store (β2 over text similarity to the query and the text reranker; text
    similarity alone without one)."""
    from gate.rerank import combine, within_article

    args, index = st.args, st.index
    template = index.manifest.get("text_template", "{title}. {section_title}. {text}")
    entries = [[st.store.entry(h.entry_id) for h in hs] for hs in hits]
    missing = [h.entry_id for hs, es in zip(hits, entries) for h, e in zip(hs, es) if e is None]
    if missing:
        raise ValueError(f"article store {st.store.path} has no entry {missing[0]!r} ({len(missing)} missing): it was "
                         "built from another KB than the index")
    if st.reranker is not None:
        rr = st.reranker.score(images, questions, [[section_text(e) for e in es] for es in entries])
        best = [int(np.argmax(combine([h.score for h in hs], r, args.beta1))) for hs, r in zip(hits, rr)]
    else:
        best = [0] * len(hits)
    chosen_articles = [article_sections(st, hs[b].entity_id) for hs, b in zip(hits, best)]
    flat = [e for art in chosen_articles for e in art]
    new = list({e["entry_id"]: e for e in flat if e["entry_id"] not in st.section_emb}.values())
    if new:  # each section is embedded once per run
        emb = index.encode_documents([template.format(**{"section_title": "", **e}) for e in new])
        st.section_emb.update({e["entry_id"]: v for e, v in zip(new, emb)})
    sims = np.stack([st.section_emb[e["entry_id"]] for e in flat]) if flat else None
    rr2 = st.text_reranker.score(images, questions, [[section_text(e) for e in art] for art in chosen_articles]) \
        if st.text_reranker is not None else None
    out, i = [], 0
    for q, art in enumerate(chosen_articles):
        sim = sims[i:i + len(art)] @ text_emb[q]
        i += len(art)
        score = within_article(sim, rr2[q], args.beta2) if rr2 is not None else sim
        j = int(np.argmax(score))
        out.append(art[j])
    return out


def rag_path(st: Stages, batch: list[dict], images, clock: Clock) -> list[dict]:
    """refine → retrieve → rerank → inspect → generate for a batch; one result dict per question."""
    from gate.labels import is_gold_section
    from gate.scoring import first_token_scores, generate_parsed

    args, n = st.args, len(batch)
    if not n:
        return []
    questions = [r["question"] for r in batch]
    queries = clock.time("refine", n, st.refiner.refine, images, questions, batch_size=n) \
        if st.refiner is not None else questions

    def retrieve():
        text_emb = st.index.encode_texts(queries)
        hits, ranks = st.index.search_and_rank(images, text_emb, [str(r.get("entity_id")) for r in batch], st.alpha,
                                               args.k)
        return text_emb, hits, ranks
    text_emb, hits, ranks = clock.time("retrieve", n, retrieve)
    chosen = clock.time("rerank", n, choose_sections, st, images, questions, text_emb, hits)
    contexts = [section_text(e) for e in chosen]
    verdicts = [None] * n
    if st.inspector is not None:
        model, processor, s = st.inspector

        def inspect():
            p = first_token_scores(model, processor, s, images, questions, contexts, batch_size=n)
            fail = [i for i in range(n) if p[i] < args.inspector_threshold]
            parsed = generate_parsed(model, processor, s, [images[i] for i in fail], [questions[i] for i in fail],
                                     [contexts[i] for i in fail], batch_size=max(1, len(fail))) if fail else []
            out = [{"pass": True, "p_pass": float(x), "answer": None} for x in p]
            for i, res in zip(fail, parsed):
                out[i] = {"pass": False, "p_pass": float(p[i]), "answer": (res or {}).get("answer")}
            return out
        verdicts = clock.time("inspect", n, inspect)
    # with baselines, the generator also answers where the Inspector failed the section: the pipeline without the
    # Inspector (WikiSeeker's ablation) comes from the same run
    to_generate = [i for i in range(n) if verdicts[i] is None or verdicts[i]["pass"] or args.baselines]
    generated = dict(zip(to_generate, clock.time(
        "generate", len(to_generate), st.generate, [images[i] for i in to_generate],
        [questions[i] for i in to_generate], [contexts[i] for i in to_generate]))) if to_generate else {}
    results = []
    for i, r in enumerate(batch):
        if verdicts[i] is None or verdicts[i]["pass"]:
            answer, reason = generated[i]
        else:
            answer = verdicts[i]["answer"]
            reason = None if answer else "the Inspector failed the section and gave no parseable answer"
        entry = chosen[i]
        results.append({"query": queries[i], "retrieved": [h.entity_id for h in hits[i]], "gold_rank": ranks[i],
                        "section": entry["entry_id"],
                        "section_right": is_gold_section(entry["entity_id"], entry.get("section"), r.get("entity_id"),
                                                         r.get("evidence_section_id")),
                        "inspector": verdicts[i], **answered(answer, reason)})
        if verdicts[i] is not None and i in generated:  # the generator's answer with this section, Inspector or not
            results[-1]["without_inspector"] = answered(*generated[i])
    return results


def run_batch(st: Stages, batch: list[dict], images, bars: dict | None = None) -> list[dict]:
    from gate.scoring import first_token_scores

    args, n = st.args, len(batch)
    clock = Clock(bars)
    questions = [r["question"] for r in batch]
    if st.gate is not None:
        model, processor, s = st.gate
        scores = clock.time("gate", n, first_token_scores, model, processor, s, images, questions, batch_size=n)
        retrieve = [bool(x >= st.gate_threshold) for x in scores]
    else:
        scores, retrieve = [None] * n, [args.gate == "always"] * n
    alone_idx = [i for i in range(n) if args.baselines or not retrieve[i]]
    rag_idx = [i for i in range(n) if args.baselines or retrieve[i]]
    alone = dict(zip(alone_idx, clock.time("answer alone", len(alone_idx), st.answer,
                                           [images[i] for i in alone_idx], [questions[i] for i in alone_idx])))\
        if alone_idx else {}
    rag = dict(zip(rag_idx, rag_path(st, [batch[i] for i in rag_idx], [images[i] for i in rag_idx], clock)))
    per_question = clock.per_question()
    out = []
    alone = {i: answered(a) for i, a in alone.items()}
    judge(st, [(batch[i], a) for i, a in alone.items()] + [(batch[i], x) for i, x in rag.items()] +
          [(batch[i], x["without_inspector"]) for i, x in rag.items() if "without_inspector" in x])
    for i, r in enumerate(batch):
        a = alone.get(i)
        chosen = rag.get(i) if retrieve[i] else a
        went = {"gate"} | ({"answer alone"} if i in alone else set())
        if i in rag:
            verdict = rag[i]["inspector"]
            went |= {"refine", "retrieve", "rerank", "inspect"} | ({"generate"} if not verdict or verdict["pass"] else set())
        latency = {s: v for s, v in per_question.items() if s in went}  # summed over questions = stage seconds
        out.append({"id": r["id"], "split": r.get("split"), "question": r["question"], "answers": r.get("answers"),
                    "entity_id": r.get("entity_id"), "question_type": r.get("question_type"),
                    "gate": {"score": None if scores[i] is None else float(scores[i]), "retrieve": retrieve[i]},
                    "alone": a, "rag": rag.get(i), "answer": chosen["answer"], "correct": chosen["correct"],
                    "latency": latency})
    return out


