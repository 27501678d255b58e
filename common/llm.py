"""Answer generators for the pipeline's RAG path: a text LLM through transformers, or an OpenAI-compatible chat
endpoint (key from an environment variable, never logged; bounded retries with backoff, then the question is
recorded as failed — never given an empty answer). Each returns generate(images, questions, contexts) →
[(answer or None, failure reason or None)]."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request

from common.http import read_reply
from common.placement import dtype_name, resolve_dtype

REQUEST_FAILED = "generator failed after"  # the reason of an answer no request got: gate.pipeline redoes it
EMPTY_ANSWER = "empty answer"  # the model answered nothing: an answer, kept (no REQUEST_FAILED prefix)
RETRY_AFTER_CAP = 60.0  # seconds: the longest a server's Retry-After is waited

# OSError covers urllib's URLError, timeouts and refused connections; http.client.HTTPException a dropped or garbled
# one (IncompleteRead mid-body, BadStatusLine); the rest, a reply that is not the JSON expected
RETRYABLE = (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError)


def chat_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def chat(
    url: str,
    model: str,
    messages: list[dict],
    api_key_env: str = "OPENAI_API_KEY",
    timeout: float = 60.0,
    temperature: float = 0.0,
    max_tokens: int | None = None,
) -> str:
    """One chat completion from an OpenAI-compatible endpoint; the reply's text. ``timeout`` bounds the whole reply (a
    server sending a byte now and then cannot hold the job), a TimeoutError past it."""
    body = {"model": model, "temperature": temperature, "messages": messages}
    if max_tokens:
        body["max_tokens"] = max_tokens
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(chat_url(url), data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        content = json.loads(read_reply(response, timeout))["choices"][0]["message"]["content"]
    if content is None:  # a reasoning model that spent its tokens thinking: no answer, as an empty one
        return ""
    if not isinstance(content, str):
        raise ValueError("reply has no text content")
    return content


def ask_with_retries(ask, read, retries: int, backoff: float, bad_reply: str):
    """(value, None) for the first reply that ``read`` accepts (not None), else (None, why the last attempt failed):
    the exception's type name — never the request, which carries the key — or ``bad_reply``. Waits backoff × attempt
    between attempts."""
    reason = None
    for attempt in range(retries):
        asked_to_wait = 0.0
        try:
            value = read(ask())
        except RETRYABLE as e:
            value, reason = None, type(e).__name__
            if isinstance(e, urllib.error.HTTPError):  # the status says why (429 rate limit, 401 key, 500 server)
                reason = f"HTTPError {e.code}"
                asked_to_wait = retry_after(e.headers)
        else:
            reason = bad_reply
        if value is not None:
            return value, None
        if attempt + 1 < retries:
            time.sleep(max(backoff * (attempt + 1), asked_to_wait))
    return None, reason


def request_failed(why) -> bool:
    """Whether a generator's reason for no answer means no request got one (``REQUEST_FAILED``: the next run asks
    again), not an answer the model gave empty (``EMPTY_ANSWER``) or a stage's own reason."""
    return isinstance(why, str) and why.startswith(REQUEST_FAILED)


def retry_after(headers) -> float:
    """Seconds a server's ``Retry-After`` asks to wait (a number of seconds; an HTTP date or nothing: 0), at most
    ``RETRY_AFTER_CAP``."""
    try:
        seconds = float((headers or {}).get("Retry-After", 0))
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(seconds) else min(max(seconds, 0.0), RETRY_AFTER_CAP)


def endpoint_generator(
    url: str,
    model: str,
    prompt: dict,
    api_key_env: str,
    max_new_tokens: int,
    retries: int = 3,
    backoff: float = 1.0,
    timeout: float = 60.0,
):
    def generate(images, questions, contexts):
        out = []
        for q, c in zip(questions, contexts):
            messages = [
                {"role": "system", "content": prompt["system"]},
                {"role": "user", "content": prompt["user_template"].format(question=q, context=c)},
            ]
            answer, reason = ask_with_retries(
                lambda m=messages: chat(url, model, m, api_key_env, timeout, max_tokens=max_new_tokens),
                lambda text: text.strip() or None,
                retries,
                backoff,
                "empty reply",
            )
            if answer is None and reason == "empty reply":  # the last reply came, empty: the model's answer
                out.append((None, EMPTY_ANSWER))
            else:
                out.append((answer, None if answer else f"{REQUEST_FAILED} {retries} attempts: {reason}"))
        return out

    return generate


def text_generator(name_or_path: str, prompt: dict, max_new_tokens: int, device: str = "cpu", dtype: str | None = None):
    """A causal LM with a chat template, batched greedy generation, left padding, on ``device`` in ``dtype`` (default:
    bf16 on a GPU, fp32 on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch_dtype = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype).to(device).eval()
    logging.getLogger("refine_rl.model").info("%s on %s in %s", name_or_path, device, dtype_name(torch_dtype))

    def generate(images, questions, contexts):
        texts = [
            tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": prompt["system"]},
                    {"role": "user", "content": prompt["user_template"].format(question=q, context=c)},
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
            for q, c in zip(questions, contexts)
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            ids = model.generate(  # greedy, and nothing from the folder's generation_config.json (a repetition
                **batch,  # penalty there applies to greedy decoding too: answers would hang on an unrecorded setting)
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                repetition_penalty=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        return [(a.strip() or None, None if a.strip() else EMPTY_ANSWER) for a in answers]

    return generate


def replier(
    system: str,
    max_new_tokens: int,
    url: str | None = None,
    model: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    local: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
):
    """replies(user_turns) → one reply per already formatted user turn (None when the request failed, "" when the
    model answered nothing: its answer, not a failure to ask again), from an
    OpenAI-compatible endpoint (``url`` + ``model``) or else a local text LLM (``local``), with ``system`` as the
    system prompt: for stages whose user turn is not a question and a context (answer expansion, section summaries)."""
    one_turn = {"system": system, "user_template": "{question}"}  # the user turn arrives formatted
    generate = (
        endpoint_generator(url, model, one_turn, api_key_env, max_new_tokens)
        if url
        else text_generator(local, one_turn, max_new_tokens, device=device, dtype=dtype)
    )
    return lambda users: [
        "" if reason == EMPTY_ANSWER else text
        for text, reason in generate([None] * len(users), users, [""] * len(users))
    ]
