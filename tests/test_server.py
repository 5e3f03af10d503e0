"""The OpenAI-compatible server end to end: a real `jaxllm serve` process on a free loopback
port, driven with the official `openai` client (raw HTTP through httpx where the wire format or
an invalid body is the point). One server for the whole module, with an API key."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from server_process import API_KEY, NAME, metrics, wait_idle


GREEDY = {"temperature": 0.0}
LONG = {"extra_body": {"ignore_eos": True}}  # run to max_tokens, whatever the random model says
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                         {"type": "text", "text": "there"}]}]


# --- basics ------------------------------------------------------------------------------------

def test_models(client, server, tiny_llama):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    card = httpx.get(server.url + "/v1/models",
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]
    assert card["root"] == tiny_llama and card["max_model_len"] == 128
    assert card["owned_by"] == "jaxllm"
    assert f"jaxllm API server ready at {server.url}" in server.output(tail=10**7)


def test_health_and_metrics_need_no_key_version_does(server):
    assert httpx.get(server.url + "/health").status_code == 200
    import jaxllm
    assert httpx.get(server.url + "/version").status_code == 401
    assert httpx.get(server.url + "/version", headers={"Authorization": f"Bearer {API_KEY}"}
                     ).json() == {"version": jaxllm.__version__}
    assert "jaxllm:num_requests_running" in httpx.get(server.url + "/metrics").text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}])
def test_v1_needs_the_api_key(server, headers):
    r = httpx.post(server.url + "/v1/completions", headers=headers,
                   json={"model": NAME, "prompt": "hi"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401 and set(r.json()["error"]) == {
        "message", "type", "param", "code"}


def test_openai_client_sees_authentication_error(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_request_id_header(http):
    assert http.get("/health", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"
    assert len(http.get("/health").headers["x-request-id"]) == 32


def test_cors_preflight(server):
    r = httpx.options(server.url + "/v1/completions",
                      headers={"Origin": "http://example.test",
                               "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# --- completions -------------------------------------------------------------------------------

def test_completion_usage_is_exact(client, http):
    prompt = "The capital of France is"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=7, **GREEDY, **LONG)
    (choice,) = r.choices
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.index == 0
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, 7, n_prompt + 7)
    assert http.post("/detokenize", json={"tokens": http.post(
        "/tokenize", json={"prompt": prompt}).json()["tokens"]}).json()["prompt"] == prompt


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=NAME, prompt="Hello", **LONG)
    assert r.usage.completion_tokens == 16


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=10, **GREEDY, **LONG)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_stream_wire_format(http):
    with http.stream("POST", "/v1/completions", json={
            "model": NAME, "prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert "usage" not in first and first["choices"][0]["finish_reason"] is None


def test_prompt_forms(client, http):
    texts = ["Hello world", "The quick brown fox"]
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    kw = dict(model=NAME, max_tokens=5, **GREEDY, **LONG)
    by_text = client.completions.create(prompt=texts, **kw)
    by_ids = client.completions.create(prompt=ids, **kw)
    single = client.completions.create(prompt=ids[1], **kw)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert single.choices[0].text == by_text.choices[1].text
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert by_text.usage.completion_tokens == 10


def test_n2_and_seed(client):
    kw = dict(model=NAME, prompt="Hello world", max_tokens=6, n=2, temperature=1.0, seed=11,
              **LONG)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in r.choices]
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in r.choices]


def test_completion_logprobs(client):
    r = client.completions.create(model=NAME, prompt="Hello world", max_tokens=5, logprobs=3,
                                  **GREEDY, **LONG)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the chosen token and the top 3; tokens that decode alike share one key
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy: the chosen is the best


def test_echo(client, http):
    kw = dict(model=NAME, prompt="Echo me", max_tokens=3, **GREEDY, **LONG)
    r = client.completions.create(echo=True, **kw)
    plain = client.completions.create(**kw)
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    chunks = list(client.completions.create(echo=True, logprobs=1, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    n_prompt = http.post("/tokenize", json={"prompt": "Echo me"}).json()["count"]
    first = chunks[0].choices[0].logprobs
    assert "".join(first.tokens[:n_prompt]) == "Echo me"
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == n_prompt + 3


def test_echo_logprobs_cover_the_prompt(client, http):
    kw = dict(model=NAME, prompt="The capital of France is", max_tokens=3, logprobs=2,
              echo=True, **GREEDY, **LONG)
    n_prompt = http.post("/tokenize", json={"prompt": kw["prompt"]}).json()["count"]
    lp = client.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n_prompt + 3):
        token, logprob, top = lp.tokens[i], lp.token_logprobs[i], lp.top_logprobs[i]
        # the token and the top 2; tokens that decode alike share one key (the best one's)
        assert logprob <= 0 and 1 <= len(top) <= 3 and top[token] >= logprob
        if i >= n_prompt:  # greedy completion tokens are the best
            assert logprob == max(top.values())
    assert any(lp.token_logprobs[i] < max(lp.top_logprobs[i].values())
               for i in range(1, n_prompt))  # the prompt is not the model's greedy choice
    streamed = list(client.completions.create(stream=True, **kw))
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed), []) == lp.token_logprobs


def test_prompt_logprobs_field(http):
    body = {"model": NAME, "prompt": "Hello world", "max_tokens": 2, "temperature": 0.0}
    r = http.post("/v1/completions", json={**body, "prompt_logprobs": 1}).json()
    ids = http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    positions = r["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    echo = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()
    token_logprobs = echo["choices"][0]["logprobs"]["token_logprobs"]
    for i in range(1, len(ids)):
        entry = positions[i]
        assert 1 <= len(entry) <= 2 and 1 in {e["rank"] for e in entry.values()}
        assert entry[str(ids[i])]["logprob"] == token_logprobs[i]
    chat = http.post("/v1/chat/completions", json={
        "model": NAME, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}).json()
    positions = chat["prompt_logprobs"]
    assert len(positions) == chat["usage"]["prompt_tokens"] and positions[0] is None
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1 for p in positions[1:])


def test_beam_search_completion_matches_transformers(http, tiny_llama):
    """use_beam_search with n = beam width: the choices are transformers' num_beams output,
    best first (no EOS: ignore_eos against min_new_tokens; see tests/test_beam_search.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = [5, 17, 300, 42, 8]
    r = http.post("/v1/completions", json={
        "model": NAME, "prompt": prompt, "max_tokens": 4, "n": 2, "use_beam_search": True,
        "ignore_eos": True, "length_penalty": 0.0})
    assert r.status_code == 200, r.text
    body = r.json()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2,
                         max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         length_penalty=0.0, early_stopping=True)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert [c["text"] for c in body["choices"]] == [tok.decode(s[len(prompt):])
                                                    for s in ref.tolist()]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 8
    assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_stop_strings(client):
    kw = dict(model=NAME, prompt="The quick brown fox", max_tokens=16, **GREEDY)
    text = client.completions.create(**kw, **LONG).choices[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip())
    cut = text[:text.index(stop)]
    r = client.completions.create(stop=[stop], **kw, **LONG)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert r.choices[0].stop_reason == stop  # vLLM's extra field
    kept = client.completions.create(stop=stop, **kw, extra_body={
        "ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


# --- errors: always OpenAI's shape, never a 500 or a traceback --------------------------------

LONG_PROMPT = "hello " * 200


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", b"{not json", 400, None, ["JSON"]),
    ("/v1/completions", b"[1, 2]", 400, None, ["object"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": "many"}, 400,
     "max_tokens", ["integer"]),
    ("/v1/completions", {"model": NAME, "prompt": {"a": 1}}, 400, "prompt", []),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens",
     ["at least 1"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 500}, 400, "max_tokens",
     ["128", "500"]),
    ("/v1/completions", {"model": NAME, "prompt": LONG_PROMPT}, 400, "prompt", ["128"]),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user",
                                                           "content": LONG_PROMPT}]},
     400, "prompt", ["128"]),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", ["gpt-4"]),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404, "model", ["gpt-4"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "logit_bias": {"100000": 5}}, 400,
     "logit_bias", ["100000"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "logit_bias": {"x": 5}}, 400,
     "logit_bias", []),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "logprobs": 21}, 400, "logprobs",
     ["21", "20"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "prompt_logprobs": 21}, 400,
     "prompt_logprobs", ["21", "20"]),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "logprobs", ["21"]),
    ("/v1/completions", {"model": NAME, "prompt": [5, 100000]}, 400, "prompt", ["100000"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature",
     []),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "priority": 5}, 400, None,
     ["priority"]),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages",
     ["image_url"]),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", []),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "auto"}, 400, "tool_choice",
     ["--enable-auto-tool-choice", "--tool-call-parser"]),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", ["--enable-auto-tool-choice"]),  # tools alone mean "auto", as vLLM
    ("/v1/completions", {"model": NAME}, 400, "prompt", ["required"]),
    ("/v1/nope", {}, 404, None, []),
])
def test_invalid_requests(http, path, body, status, param, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    r = http.post(path, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param
    for word in words:
        assert word in error["message"]
    assert "Traceback" not in r.text


def test_openai_client_gets_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
        client.chat.completions.create(model=NAME,
                                       messages=[{"role": "user", "content": LONG_PROMPT}])


# --- lifecycle: disconnects abort, concurrency interleaves ------------------------------------

ABORTED = "jaxllm:request_success_total{finished_reason=abort}"
# Four sequences of 120 tokens take a few hundred ms here; the client leaves after a few ms.
SLOW = {"model": NAME, "prompt": "Hello", "max_tokens": 120, "n": 4, "ignore_eos": True}


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(http):
    before = wait_idle(http)
    with http.stream("POST", "/v1/completions", json={**SLOW, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    after = wait_idle(http)
    assert after["jaxllm:num_requests_running"] == after["jaxllm:num_requests_waiting"] == 0
    assert after["jaxllm:kv_cache_usage_perc"] == 0
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    generated = after["jaxllm:generation_tokens_total"] - before["jaxllm:generation_tokens_total"]
    assert generated < 4 * 120


def test_client_timeout_on_a_plain_request_aborts(server, http):
    before = wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.05, json=SLOW,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    after = wait_idle(http)
    assert after["jaxllm:num_requests_running"] == 0
    assert after["jaxllm:kv_cache_usage_perc"] == 0
    assert after[ABORTED] == before.get(ABORTED, 0) + 1


def test_32_concurrent_streams_match_sequential_greedy(server, client):
    prompts = [f"Request number {i} says" for i in range(32)]
    kw = dict(model=NAME, max_tokens=8, **GREEDY, **LONG)
    sequential = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def run():
        # 32 connections at once on a loaded 2-core machine: the client's 5 s connect timeout
        # is not what this test is about (interleaving is), so it gets the http fixture's.
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                     timeout=120)

        async def one(p):
            text, reasons = "", []
            async for chunk in await aclient.completions.create(prompt=p, stream=True, **kw):
                text += chunk.choices[0].text
                reasons.append(chunk.choices[0].finish_reason)
            return text, reasons[-1]

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert [t for t, _ in results] == sequential
    assert all(reason == "length" for _, reason in results)


def test_metrics(client, http):
    wait_idle(http)
    before = metrics(http)
    r = client.completions.create(model=NAME, prompt="Count my tokens", max_tokens=5, **GREEDY,
                                  **LONG)
    after = metrics(http)
    assert after["jaxllm:prompt_tokens_total"] - before["jaxllm:prompt_tokens_total"] == (
        r.usage.prompt_tokens)
    assert after["jaxllm:generation_tokens_total"] - before["jaxllm:generation_tokens_total"] == 5
    key = "jaxllm:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert after[f"jaxllm:{name}_count"] - before[f"jaxllm:{name}_count"] == 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_hit_rate",
                 "num_preemptions_total"):
        assert f"jaxllm:{name}" in after
    assert after["jaxllm:prefix_cache_queries_total"] >= after["jaxllm:prefix_cache_hits_total"]
    jaxllm_names = [k for k in after if k.startswith("jaxllm:")]
    assert {k: after["vllm:" + k[7:]] for k in jaxllm_names} == {k: after[k] for k in
                                                                  jaxllm_names}  # vLLM's too
