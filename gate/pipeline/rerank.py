"""Reranking retrieved sections, WikiSeeker's two stages:

1. over the top-k sections of different articles, a multimodal reranker (image + question against the section):
   β1·retrieval score + (1−β1)·reranker score (``combine``) picks the article. By name: ``vlm:<VLM>`` — any VLM,
   zero-shot, scored by its first token's P(Yes) to "does this section help answer the question about the image" (the
   gates' first-token scoring code); ``gate:<dir>`` — a trained ``srt`` gate's P(Rel); or a text CrossEncoder;
2. within the chosen article (all its sections, from the article store), a text reranker (a sentence-transformers
   CrossEncoder: BAAI/bge-reranker-v2-m3 in the real configs; ``tiny``: the toy world's seeded random tiny BERT
   cross-encoder, registered by toy.models): (1−β2)·the query's text similarity to the section + β2·text-reranker
   score (``within_article``); the first stage scored only the top-k sections, not the article's others.

A CrossEncoder's logit goes through one sigmoid to [0, 1] (``CrossEncoderReranker.score``); every reranker loads on
an explicit device and dtype."""

from __future__ import annotations

import numpy as np

from common.placement import resolve_dtype
from gate.scoring import first_token_scores, load_gate, verbaliser_ids
from gate.variants import spec
from retrieval.encoder_names import registered_builder
from rl.model import load_model


def combine(retrieval_scores, reranker_scores, beta: float) -> np.ndarray:
    """β·retrieval + (1−β)·reranker: the section stage with β = β1 (β1 = 1 keeps the retrieval order)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"β must lie in [0, 1], got {beta}")
    return beta * np.asarray(retrieval_scores, dtype=float) + (1 - beta) * np.asarray(reranker_scores, dtype=float)


def within_article(similarity, reranker_scores, beta2: float) -> np.ndarray:
    """(1−β2)·similarity + β2·text reranker: the within-article stage (β2 = 0 ranks by the similarity alone)."""
    return combine(similarity, reranker_scores, 1.0 - beta2)


def unflatten(flat: np.ndarray, sections: list[list]) -> list[np.ndarray]:
    """Scores of all (question, section) pairs back into one array per question."""
    bounds = np.cumsum([0] + [len(secs) for secs in sections])
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


class CrossEncoderReranker:
    def __init__(self, name: str, device: str = "cpu", dtype: str | None = None):
        from sentence_transformers import CrossEncoder

        builder = registered_builder("cross_encoders", name)
        path = builder() if builder else name
        self.name = name
        self.model = CrossEncoder(str(path), device=device, model_kwargs={"dtype": resolve_dtype(dtype, device)})
        if self.model.num_labels != 1:  # (n, 2) scores would broadcast in the β-weighted sum and pick past the article
            raise ValueError(
                f"text reranker {name}: a cross-encoder with {self.model.num_labels} output labels; a reranker gives "
                "one relevance logit per (question, section) pair"
            )

    def score(self, images, queries: list[str], sections: list[list[str]]) -> list[np.ndarray]:
        """sigmoid(logit) per (question, section) pair. ``predict`` gets the identity activation: it applies the
        model's own otherwise (a sigmoid for one-label models), and a second sigmoid would squeeze every score into
        about (0.5, 0.73), weakening the reranker against the retrieval score it is mixed with."""
        import torch

        pairs = [(q, s) for q, secs in zip(queries, sections) for s in secs]
        logits = self.model.predict(pairs, activation_fn=torch.nn.Identity(), show_progress_bar=False) if pairs else []
        return unflatten(1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=float))), sections)


class FirstTokenReranker:
    """A VLM's P(positive verbaliser | image, question, section) from its first token: a trained srt gate
    (``gate:DIR``, P(Rel)) or any VLM zero-shot (``vlm:NAME``, P(Yes) to a relevance question)."""

    VLM_SYSTEM = (
        "You are given an image, a question about it and a document. Does the document help answer the "
        "question about the entity in the image? Reply Yes or No."
    )

    def __init__(self, model, processor, spec: dict, name: str):
        self.model, self.processor, self.spec, self.name = model, processor, spec, name

    @classmethod
    def srt_gate(cls, path: str, device: str = "cpu", dtype: str | None = None) -> FirstTokenReranker:
        model, processor, s = load_gate(path, device=device, dtype=dtype)
        if s["name"] != "srt":
            raise ValueError(f"reranker gate:{path} is a {s['name']} gate, not srt")
        return cls(model, processor, s, f"gate:{path}")

    @classmethod
    def vlm(
        cls, path: str, device: str = "cpu", dtype: str | None = None, verbalisers=("Yes", "No")
    ) -> FirstTokenReranker:
        model, processor = load_model(path, dtype=dtype, device=device)
        s = dict(spec("srt", verbalisers), system=cls.VLM_SYSTEM.replace("Yes or No", " or ".join(verbalisers)))
        verbaliser_ids(processor.tokenizer, s)  # the verbalisers must start with different tokens of this model
        return cls(model.eval(), processor, s, f"vlm:{path}")

    def score(self, images, queries: list[str], sections: list[list[str]]) -> list[np.ndarray]:
        flat_images = [im for im, secs in zip(images, sections) for _ in secs]
        flat_q = [q for q, secs in zip(queries, sections) for _ in secs]
        flat_s = [s for secs in sections for s in secs]
        return unflatten(
            first_token_scores(self.model, self.processor, self.spec, flat_images, flat_q, flat_s), sections
        )


def load_reranker(name: str | None, device: str = "cpu", dtype: str | None = None, verbalisers=("Yes", "No")):
    """The first-stage (multimodal) reranker by name: none | vlm:NAME | gate:DIR | a CrossEncoder | tiny."""
    if name in (None, "", "none"):
        return None
    if name.startswith("gate:"):
        return FirstTokenReranker.srt_gate(name[len("gate:") :], device=device, dtype=dtype)
    if name.startswith("vlm:"):
        return FirstTokenReranker.vlm(name[len("vlm:") :], device=device, dtype=dtype, verbalisers=verbalisers)
    return CrossEncoderReranker(name, device=device, dtype=dtype)


def load_text_reranker(name: str | None, device: str = "cpu", dtype: str | None = None):
    """The within-article text reranker: none | a CrossEncoder (BAAI/bge-reranker-v2-m3) | tiny."""
    if name in (None, "", "none"):
        return None
    if name.startswith(("gate:", "vlm:")):
        raise ValueError(
            f"--text_reranker {name!r}: the within-article stage takes a text cross-encoder "
            "(e.g. BAAI/bge-reranker-v2-m3); multimodal rerankers go in --reranker"
        )
    return CrossEncoderReranker(name, device=device, dtype=dtype)
