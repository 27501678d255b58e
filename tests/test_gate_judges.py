"""Judges: exact and token on hand-computed cases; the LLM judge against a local OpenAI-compatible stub."""

import pytest

from gate.pipeline.judges import LLMJudge, judge_all, make_judge, parse_score


@pytest.mark.parametrize(
    "reply,score",
    [
        ("Score: 4\nThe answer is right.", 4.0),
        ("score=2.5", 2.5),
        ("5\nperfect", 5.0),
        ("I think it's fine", None),
        ("Score: 9", None),
        ("Score: 4/5", 4.0),
        ("**Score:** 4\nright", 4.0),
        ("The score is 4.5.", 4.5),
        ("Score: 4.", 4.0),
        ("4.5", 4.5),
        ("Score: 10/10", None),  # out of range, not 1
        ("Score: 45", None),  # not 4
        ("1. The answer names the wrong city", None),  # a list marker, not a score
        ("", None),
        (None, None),
        # the asked-for "Score: N" line before a "score" in the reasoning, and a reasoning model's thinking left out
        ("Reasoning: a fully right answer would score 5, but this one names the wrong city.\nScore: 2", 2.0),
        ("Score (1-5): 4\nright", 4.0),
        ("<think>it could score 5, or 1</think>\nScore: 3", 3.0),
        ("- **Score**: 4", 4.0),
        ("The answer would score 5 if complete, but it misses the date.\nOverall Score: 3", 3.0),  # a qualifier
        ("Reasoning: a right answer would score 5.\n**Final score:** 1", 1.0),
        ("Score: N/A\nReasoning: a correct answer would score 5", None),  # the verdict unreadable: no score
        ("Let me draft.\nScore: 5\nWait, the year is wrong.\n</think>\nScore: 2", 2.0),  # only the closing tag
        ("Draft: Score: 5\n</THINK>\nThe year is wrong, so I give it score 1", 1.0),  # the closing tag in capitals
        ("Score: 4/10", None),  # another scale
        ("Score: 3 out of 10", None),
        ("Score: 4,5", None),
        ("Score: 4 out of 5", 4.0),
        ("I would give this answer a score of 1.", 1.0),  # unread, the same on every retry at temperature 0
        ("Reference answer score: 5\nGenerated answer score: 2", 2.0),  # the last verdict line, not the first score
        ('{"score": 1}', 1.0),  # JSON: unread, so retried and then a failed judgement
        ('{"score": 4, "reasoning": "right"}', 4.0),
        ("**Score:**\n\n4\nright", 4.0),  # a heading, the number below it
        ("Score:\n\nN/A", None),
    ],
)
def test_parse_score(reply, score):
    assert parse_score(reply) == score


@pytest.mark.parametrize(
    "judge,answer,golds,answer_eval,score",
    [
        ("exact", "The Eiffel Tower", ["eiffel tower"], None, 5.0),
        ("exact", "Louvre", ["eiffel tower"], None, 1.0),
        ("exact", "1889", [], [{"wikidata": 1889, "range": [1887, 1891]}], 5.0),
        ("token", "the red fox", ["red fox"], None, 5.0),
        ("token", "a red dog", ["red fox"], None, 3.0),
        ("token", "nothing", ["red fox"], None, 1.0),
    ],
)
def test_exact_and_token(judge, answer, golds, answer_eval, score):
    assert make_judge(judge).score("q?", answer, golds, answer_eval) == pytest.approx(score)


def test_unknown_judge_and_missing_endpoint():
    with pytest.raises(ValueError, match="unknown judge"):
        make_judge("vibes")
    with pytest.raises(ValueError, match="judge_url"):
        make_judge("llm", url="", model="m")


def test_llm_judge_retries_then_scores(stub, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_KEY", "sk-secret-123")
    server = stub(["hmm", "Score: 4\nfine"])
    judge = LLMJudge(server.url, "judge-model", api_key_env="JUDGE_KEY", retries=3, backoff=0)
    assert judge.score("Where?", "Paris", ["Paris"]) == 4.0
    assert len(server.requests) == 2 and server.requests[0]["auth"] == "Bearer sk-secret-123"
    sent = server.requests[0]["body"]
    assert sent["model"] == "judge-model" and "Reference Answer\nParis" in sent["messages"][1]["content"]
    assert "sk-secret" not in caplog.text


def test_llm_judge_failure_is_recorded_never_scored(stub):
    server = stub(["no", "still no", "nope"])
    judge = LLMJudge(server.url, "m", retries=3, backoff=0)
    assert judge.score("q", "a", ["b"]) is None and judge.failures == 1 and len(server.requests) == 3


def test_llm_judge_unreachable_endpoint_is_a_failure():
    import socket

    with socket.socket() as held:  # bound but never listening: Linux refuses every connection to its port
        held.bind(("127.0.0.1", 0))
        judge = LLMJudge(f"http://127.0.0.1:{held.getsockname()[1]}", "m", retries=2, backoff=0, timeout=2)
        assert judge.score("q", "a", ["b"]) is None and judge.last_failure == "URLError" and judge.failures == 1


def test_a_connection_dropped_mid_reply_is_retried(stub):
    """http.client's IncompleteRead is not an OSError: it is retried like any transient failure, not raised."""
    server = stub([None, "Score: 4"])
    judge = LLMJudge(server.url, "m", retries=2, backoff=0)
    assert judge.score("q", "a", ["b"]) == 4.0 and len(server.requests) == 2 and judge.failures == 0


def test_distinct_answers_are_judged_once(stub):
    server = stub(["Score: 5", "Score: 1"])
    judge = LLMJudge(server.url, "m", backoff=0)
    records = [
        {"id": "q1", "question": "Where?", "answers": ["Paris"], "samples": ["Paris", " Paris ", "Lyon", "Paris"]}
    ]
    assert judge_all(records, judge) == [[5.0, 5.0, 1.0, 5.0]]
    assert len(server.requests) == 2


@pytest.mark.parametrize("samples", [["15 m", "1.5 m"], ["1.5 m", "15 m"], ["-5", "5"]])
def test_answers_that_differ_only_in_punctuation_are_judged_apart(samples):
    """A number's point or sign is part of the answer: each sample keeps its own score, whatever the order."""
    judge = make_judge("exact")
    rec = {"id": "q1", "question": "How tall?", "answers": ["1.5"], "samples": samples}
    rec["answer_eval"] = (
        [{"wikidata": 1.5, "range": [1.4, 1.6]}] if "m" in samples[0] else [{"wikidata": 5, "range": [4, 6]}]
    )
    assert judge_all([rec], judge) == [[judge.score("q", s, rec["answers"], rec["answer_eval"]) for s in samples]]
    assert len(set(judge_all([rec], judge)[0])) == 2


def test_a_failed_judgement_is_not_cached(stub):
    """judge_all judges each distinct answer once; a failure (None) was cached, so every later sample with the same
    answer in the batch (and a resumed batch) kept the failure."""
    server = stub(["no", "Score: 5"])  # the first request unreadable, then readable
    judge = LLMJudge(server.url, "m", retries=1, backoff=0)
    rec = {"id": "q0", "question": "Where?", "answers": ["Paris"], "samples": ["Paris", "Paris"]}
    assert judge_all([rec], judge) == [[None, 5.0]] and len(server.requests) == 2


def test_an_empty_reply_is_the_models_answer_and_a_refused_request_names_its_status(stub):
    """An endpoint that replies with nothing gave an answer (the pipeline keeps it, the noise study scores it); a
    request refused with 429 failed, and its reason says which status (it said "HTTPError" for 401, 429 and 500)."""
    from common.llm import EMPTY_ANSWER, REQUEST_FAILED, endpoint_generator

    prompt = {"system": "s", "user_template": "{question} {context}"}
    empty = stub([" ", " "])
    assert endpoint_generator(empty.url, "m", prompt, "NO_KEY", 8, retries=2, backoff=0)([None], ["q"], ["c"]) == [
        (None, EMPTY_ANSWER)
    ]
    limited = stub([], status=429)
    said = endpoint_generator(limited.url, "m", prompt, "NO_KEY", 8, retries=2, backoff=0)([None], ["q"], ["c"])
    assert said == [(None, f"{REQUEST_FAILED} 2 attempts: HTTPError 429")]


@pytest.mark.parametrize(
    "headers,waited",
    [
        ({"Retry-After": "5"}, [5.0]),  # the server's wait, over the backoff's 0.1
        ({"Retry-After": "600"}, [60.0]),  # at most RETRY_AFTER_CAP
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, [0.1]),  # a date: the backoff
        ({}, [0.1]),
        ({"Retry-After": "nan"}, [0.1]),
    ],
)
def test_a_refused_request_waits_what_the_server_asks(headers, waited, monkeypatch):
    import email.message
    import urllib.error

    import common.llm as llm

    slept = []
    monkeypatch.setattr(llm.time, "sleep", slept.append)
    message = email.message.Message()
    for k, v in headers.items():
        message[k] = v

    def refused():
        raise urllib.error.HTTPError("http://x/v1/chat/completions", 429, "Too Many Requests", message, None)

    assert llm.ask_with_retries(refused, str, 2, 0.1, "bad") == (None, "HTTPError 429") and slept == waited


def test_a_reply_trickled_past_the_timeout_is_given_up(tmp_path):
    """urlopen's timeout bounds each read: a server sending a byte every 0.2 s held a request with a 1 s timeout
    for as long as it liked. The whole reply now has the timeout, and the request ends long before the reply would."""
    from common.llm import chat
    from tests.test_waits_and_writes import trickling_server

    body = b'{"choices": [{"message": {"content": "Score: 5"}}]}' + b" " * 200
    with trickling_server(body, "application/json") as (site, sent):
        with pytest.raises(TimeoutError, match="no whole reply within 1.0 s"):
            chat(f"{site}/v1", "m", [{"role": "user", "content": "q"}], timeout=1.0)
    assert len(sent) < len(body)  # given up before the server finished its reply


@pytest.mark.parametrize(
    "answer,golds,question_type,answer_eval,score",
    [
        # E-VQA's own exact step, as its official scorer's first: multi-answer by overlap, number words as digits
        ("Ottawa and Toronto", ["Ottawa && Toronto"], "multi_answer", None, 5.0),
        ("Toronto, Ottawa", ["Ottawa && Toronto"], "multi_answer", None, 5.0),
        ("Ottawa", ["Ottawa && Toronto && Calgary"], "multi_answer", None, 1.0),  # 1 of 3: below one half
        ("three", ["3"], "templated", None, 5.0),
        ("The Rhine.", ["rhine", "Rhein"], "automatic", None, 5.0),
        ("Danube", ["Rhine"], "templated", None, 1.0),
        # InfoSeek (answer_eval) and untyped records keep InfoSeek's rule
        ("three", ["3"], None, None, 1.0),
        ("1990", [], "Numerical", [{"range": [1989, 1991]}], 5.0),
    ],
)
def test_the_exact_judge_scores_evqa_by_evqas_exact_rule(answer, golds, question_type, answer_eval, score):
    """E-VQA's gate data was judged by InfoSeek's rule: answers its official scorer accepts ("three" for 3, both parts
    of a multi-answer in another order) were wrong, and the labels leaned to "search"."""
    assert make_judge("exact").score("Q?", answer, golds, answer_eval, question_type) == score
