"""BEM, the learned answer-equivalence model the E-VQA scorer falls back on when exact match does not decide.

Loaded once per run through transformers by name (default ``kortukov/answer-equivalence-bem``, a PyTorch BERT
reproduction of the TF-hub BEM the official scorer calls) on an explicit device and dtype; the score is
softmax(logits)[1], the probability that the candidate is equivalent to the reference.

The input is ``[CLS] candidate [SEP] reference [SEP] question [SEP]`` from the raw strings. The official scorer
(google-research ``encyclopedic_vqa/evaluation_utils.py``, ``initialize_bem_scoring_function``) builds it with
``combine_segments((candidate, reference, question))``, which gives the three parts segment ids 0, 1 and 2. The
published PyTorch port is a bert-base-uncased fine-tune with two segment embeddings (an id of 2 does not exist
there), and its model card builds the input as text ``[CLS] candidate [SEP]`` and pair ``reference [SEP] question
[SEP]`` with no added special tokens: ids 0, 1, 1. So a model's segment ids follow what it can read: 0 / 1 / 1 for a
model with two segment types (the port, as its card does), the official 0 / 1 / 2 for one with three or more.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.placement import dtype_name, resolve_device, resolve_dtype

DEFAULT_BEM = "kortukov/answer-equivalence-bem"


def bem_inputs(
    tokenizer,
    candidates: Sequence[str],
    references: Sequence[str],
    questions: Sequence[str],
    max_length: int = 512,
    question_segment: int = 1,
):
    """The tokenised batch BEM reads (padded to the longest, truncated to ``max_length`` as the model card does):
    segment ids 0 for ``[CLS] candidate [SEP]``, 1 for ``reference [SEP]`` and ``question_segment`` for
    ``question [SEP]`` (1: the PyTorch port's card; 2: the official ``combine_segments``); padding keeps 0."""
    if question_segment not in (1, 2):
        raise ValueError(
            f"question_segment must be 1 (the PyTorch port) or 2 (the official input), got {question_segment}"
        )
    batch = tokenizer(
        text=[f"[CLS] {c} [SEP]" for c in candidates],
        text_pair=[f"{r} [SEP] {q} [SEP]" for r, q in zip(references, questions)],
        add_special_tokens=False,
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    if question_segment != 1:
        import torch

        pair = batch["token_type_ids"] == 1
        sep = (batch["input_ids"] == tokenizer.sep_token_id) & pair
        seps_before = torch.cumsum(sep.long(), dim=1) - sep.long()  # the pair's [SEP]s strictly before each token
        batch["token_type_ids"][pair & (seps_before >= 1)] = question_segment  # after the reference's [SEP]
    return batch


def bem_dtype(name: str | None) -> str:
    """BEM's dtype for a pipeline's ``dtype``: fp32 under ``auto`` on every device, as the official scorer runs it (a
    verdict is P(equivalent) ≥ 0.5, which bf16's 8-bit mantissa can flip near the threshold); a dtype named, as
    named."""
    return "float32" if name in (None, "auto") else name


class BEMScorer:
    """``scorer(candidates, references, questions) -> [P(equivalent)]``, in batches, on one device."""

    def __init__(
        self, model: str = DEFAULT_BEM, device: str | None = None, dtype: str = "auto", batch_size: int = 64, log=print
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(bem_dtype(dtype), self.device)
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForSequenceClassification.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        if self.model.config.num_labels != 2:
            raise ValueError(
                f"BEM model {model!r} has {self.model.config.num_labels} labels; expected 2 "
                "(not equivalent, equivalent)"
            )
        types = int(getattr(self.model.config, "type_vocab_size", 2))
        self.question_segment = 2 if types >= 3 else 1
        log(
            f"BEM {model}: {self.device}, {dtype_name(self.dtype)}, batches of {batch_size}, "
            f"segment ids 0/1/{self.question_segment} ({types} segment types)"
        )

    def __call__(self, candidates: Sequence[str], references: Sequence[str], questions: Sequence[str]) -> list[float]:
        import torch

        out: list[float] = []
        for s in range(0, len(candidates), self.batch_size):
            batch = bem_inputs(
                self.tokenizer,
                candidates[s : s + self.batch_size],
                references[s : s + self.batch_size],
                questions[s : s + self.batch_size],
                question_segment=self.question_segment,
            )
            batch = batch.to(self.device)
            with torch.no_grad():
                logits = self.model(**batch).logits.float()
            out += torch.softmax(logits, dim=-1)[:, 1].tolist()
        return out
