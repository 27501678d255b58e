"""BEM, the learned answer-equivalence model the E-VQA scorer falls back on when exact match does not decide.

Loaded once per run through transformers by name (default ``kortukov/answer-equivalence-bem``, a PyTorch BERT
reproduction of the TF-hub BEM the official scorer calls) on an explicit device and dtype. Its input is the official
one, ``[CLS] candidate [SEP] reference [SEP] question [SEP]`` from the raw strings, built as the model card does
(text ``[CLS] candidate [SEP]``, pair ``reference [SEP] question [SEP]``, no added special tokens, at most 512
tokens); the score is softmax(logits)[1], the probability that the candidate is equivalent to the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_BEM = "kortukov/answer-equivalence-bem"


def bem_inputs(tokenizer, candidates: Sequence[str], references: Sequence[str], questions: Sequence[str],
               max_length: int = 512):
    """The tokenised batch BEM reads (padded to the longest, truncated to ``max_length``)."""
    return tokenizer(text=[f"[CLS] {c} [SEP]" for c in candidates],
                     text_pair=[f"{r} [SEP] {q} [SEP]" for r, q in zip(references, questions)],
                     add_special_tokens=False, padding=True, truncation=True, max_length=max_length,
                     return_tensors="pt")


class BEMScorer:
    """``scorer(candidates, references, questions) -> [P(equivalent)]``, in batches, on one device."""

    def __init__(self, model: str = DEFAULT_BEM, device: str | None = None, dtype: str = "auto", batch_size: int = 64,
                 log=print):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from retrieval.placement import resolve_device

        self.device = resolve_device(device)
        self.dtype = {"auto": torch.bfloat16 if self.device.startswith("cuda") else torch.float32,
                      "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForSequenceClassification.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        if self.model.config.num_labels != 2:
            raise ValueError(f"BEM model {model!r} has {self.model.config.num_labels} labels; expected 2 "
                             "(not equivalent, equivalent)")
        log(f"BEM {model}: {self.device}, {str(self.dtype).replace('torch.', '')}, batches of {batch_size}")

    def __call__(self, candidates: Sequence[str], references: Sequence[str], questions: Sequence[str]) -> list[float]:
        import torch

        out: list[float] = []
        for s in range(0, len(candidates), self.batch_size):
            batch = bem_inputs(self.tokenizer, candidates[s:s + self.batch_size], references[s:s + self.batch_size],
                               questions[s:s + self.batch_size]).to(self.device)
            with torch.no_grad():
                logits = self.model(**batch).logits.float()
            out += torch.softmax(logits, dim=-1)[:, 1].tolist()
        return out
