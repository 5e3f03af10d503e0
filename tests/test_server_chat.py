"""The server's chat completions (streamed and not, logprobs and n, template options) and
structured output, bad_words, truncation and token ids, through the OpenAI client and raw
HTTP against a `jaxllm serve` process of their own."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from server_process import NAME
from test_server import GREEDY, LONG, MESSAGES


# --- chat --------------------------------------------------------------------------------------


def test_chat(client, http):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, **GREEDY,
                                       **LONG)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)


def test_chat_stream_matches_non_stream(client):
    kw = dict(model=NAME, messages=MESSAGES, max_completion_tokens=8, **GREEDY, **LONG)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content
    assert chunks[-1].usage.model_dump(exclude_none=True) == full.usage.model_dump(
        exclude_none=True)


def test_chat_default_max_tokens_fills_the_context(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, **GREEDY, **LONG)
    assert r.usage.total_tokens == 128  # vLLM: max_model_len - prompt length
    assert r.choices[0].finish_reason == "length"


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, logprobs=True,
                                       top_logprobs=2, n=2, temperature=1.0, seed=3, **LONG)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 8
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        for c in content:
            assert len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
            assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob


def test_chat_template_kwargs_and_no_generation_prompt(http):
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}],
            "add_generation_prompt": False}
    with_prompt = http.post("/tokenize", json={**body, "add_generation_prompt": True}).json()
    without = http.post("/tokenize", json=body).json()
    assert with_prompt["count"] > without["count"]
    custom = http.post("/tokenize", json={
        **body, "chat_template": "{{ word }}", "chat_template_kwargs": {"word": "Hello"},
        "return_token_strs": True}).json()
    assert custom["tokens"] == http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]


# --- structured output, bad_words, truncation, token ids ---------------------------------------

class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    size: int = Field(ge=1, le=9)
    ok: bool


def test_chat_completions_parse_returns_the_pydantic_object(client):
    """The openai client's `parse(response_format=Model)` (a strict json_schema request)."""
    r = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "Pick"}],
                                      response_format=Pick, max_tokens=40, temperature=1.0,
                                      seed=1)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Pick)


def test_parse_of_json_cut_by_max_tokens_raises_the_clients_length_error(client):
    """A real max_tokens limit inside the object: finish_reason "length", which the openai
    client's parse() turns into its LengthFinishReasonError, as with OpenAI."""
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "Pick"}],
                                      response_format=Pick, max_tokens=3, temperature=1.0,
                                      seed=1)


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"choice": ["x y", "z"]}}, lambda t: t in ("x y", "z")),
    ({"guided_grammar": 'root ::= "(" [a-c]+ ")"'}, lambda t: re.fullmatch(r"\([a-c]+\)", t)),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     lambda t: all(isinstance(v, bool) for v in json.loads(t))),
])
def test_structured_output_spellings(client, extra, check):
    for stream in (False, True):
        kw = dict(model=NAME, max_tokens=40, temperature=1.0, seed=5, extra_body=extra)
        if stream:
            chunks = client.chat.completions.create(
                messages=[{"role": "user", "content": "Go"}], stream=True, **kw)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.completions.create(prompt="Go", **kw).choices[0].text
        assert check(text), (extra, text)


def test_uncompilable_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=NAME, prompt="x", extra_body={"guided_regex": "(a"})


def test_bad_words_truncation_and_token_ids(client, http):
    kw = dict(model=NAME, prompt="The quick brown fox", max_tokens=6, **GREEDY)
    base = client.completions.create(logprobs=0, **kw, **LONG).choices[0].logprobs.tokens
    i, word = next((i, t) for i, t in enumerate(base) if t.strip())  # greedy: deterministic
    banned = client.completions.create(logprobs=0, **kw, extra_body={
        "ignore_eos": True, "bad_words": [word]}).choices[0].logprobs.tokens
    assert banned[:i] == base[:i] and banned[i] != base[i]  # the same until the bad word
    assert word not in banned
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    cut = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                     "truncate_prompt_tokens": 2})
    ref = client.completions.create(model=NAME, prompt=ids[-2:], max_tokens=6, **GREEDY, **LONG)
    assert cut.usage.prompt_tokens == 2 and cut.choices[0].text == ref.choices[0].text
    as_ids = client.completions.create(logprobs=1, **kw, extra_body={
        "ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = as_ids.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens)
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp.top_logprobs for t in top)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
        top_logprobs=2, **GREEDY, extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
