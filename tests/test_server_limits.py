"""The hardening pieces without a server: request limits, strict and finite request types, the
template time budget, admission tickets and bounded request logs (end to end:
test_server_hostile.py and test_server_lifecycle.py)."""

from __future__ import annotations

import gc
import logging
import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from jaxllm.sampling_params import SamplingParams
from serving.errors import APIError
from serving.generation import RenderTimeout, call_with_deadline
from serving.protocol import ChatCompletionRequest
from serving.protocol_completion import CompletionRequest
from serving.state import (Admission, RequestLimits, ServingState, check_request_limits,
                           check_text_length)


@pytest.mark.parametrize("fields, num_prompts, param", [
    (dict(n=9), 1, "n"),
    (dict(n=3), 3, "prompt"),
    (dict(stop=["a", "b", "c"]), 1, "stop"),
    (dict(stop="x" * 101), 1, "stop"),
    (dict(logit_bias={"1": 1.0, "2": 1.0, "3": 1.0}), 1, "logit_bias"),
])
def test_request_limits_name_the_field(fields, num_prompts, param):
    limits = RequestLimits(max_n_sequences=8, max_stop_strings=2, max_logit_bias=2,
                           max_prompt_chars=100)
    with pytest.raises(APIError) as e:
        check_request_limits(limits, CompletionRequest(prompt="x", **fields), num_prompts)
    assert e.value.param == param and e.value.status == 400
    check_request_limits(limits, CompletionRequest(prompt="x", n=2, stop=["a", "b"]), 4)


def test_a_text_longer_than_the_context_can_hold_is_refused_unread():
    limits = RequestLimits(max_prompt_chars=128 * 16)
    check_text_length(limits, "x" * 2048, 128)
    with pytest.raises(APIError, match="at least 128 input tokens"):
        check_text_length(limits, "x" * 2049, 128)


@pytest.mark.parametrize("fields", [
    dict(temperature=float("inf")), dict(top_p=float("nan")), dict(logit_bias={"1": float("nan")}),
    dict(temperature="Infinity"), dict(stream="yes"), dict(max_tokens=True), dict(seed="1"),
    dict(n=2.0), dict(prompt="a\ud800"), dict(stop=["\udfff"]), dict(model="\ud800"),
])
def test_strict_finite_and_valid_unicode(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**{"prompt": "x", **fields})


@pytest.mark.parametrize("role", ["wizard", "", "USER"])
def test_unknown_roles_are_refused(role):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": role, "content": "x"}])
    assert ChatCompletionRequest(messages=[{"role": "developer", "content": "x"}])


def test_template_time_budget():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    endless = env.from_string("{% for a in range(99999) %}{% for b in range(99999) %}{{ b }}"
                              "{% endfor %}{% endfor %}")
    start = time.monotonic()
    with pytest.raises(RenderTimeout, match="0.2 s"):
        call_with_deadline(endless.render, 0.2)
    assert time.monotonic() - start < 2
    quick = env.from_string("{% for i in range(3) %}{{ i }}{% endfor %}")
    assert call_with_deadline(quick.render, 0.2) == "012"


def test_admission_tickets_come_back_however_the_request_ends():
    admission = Admission(running_capacity=4, max_waiting=2)
    a = admission.enter(5)
    with pytest.raises(APIError) as e:
        admission.enter(2)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    a.release()
    a.release()  # once only
    assert admission.in_flight == 0
    admission.enter(6)  # dropped without release (a stream never started)
    gc.collect()
    assert admission.in_flight == 0
    assert Admission(4, None).enter(10**6).sequences == 10**6  # no cap


def test_request_logs_hide_prompts_and_are_bounded(caplog):
    state = ServingState(engine=None, served_model_names=["m"], model_path="m", tokenizer=None,
                         max_model_len=8, vocab_size=8, max_logprobs=1, metrics=None)
    params = SamplingParams(stop=["s" * 50] * 20)
    with caplog.at_level(logging.INFO, logger="jaxllm.serving"):
        state.log_request("r1", "secret prompt", [1, 2, 3], params)
        assert caplog.records == []  # off by default, as vLLM's --enable-log-requests
        state.log_requests, state.max_log_len = True, 40
        state.log_request("r2", "secret prompt", [1, 2, 3], params)
    (record,) = caplog.records
    assert "secret" not in record.getMessage() and len(record.getMessage()) < 150
    with caplog.at_level(logging.DEBUG, logger="jaxllm.serving"):
        state.log_request("r3", "secret prompt " * 10, [1, 2, 3] * 50, params)
    assert "secret prompt" in caplog.text and "more characters" in caplog.text
    state.close()


def test_unsupported_vllm_fields_are_refused_and_unknown_ones_logged_briefly(caplog):
    with pytest.raises(APIError) as e:
        ServingState.warn_ignored_fields(CompletionRequest(prompt="x", guided_rgx="a+"))
    assert e.value.param == "guided_rgx"
    with caplog.at_level(logging.WARNING, logger="jaxllm.serving"):
        ServingState.warn_ignored_fields(CompletionRequest(
            prompt="x", **{f"f{i}": 1 for i in range(500)}))
    assert "480 more" in caplog.text and len(caplog.text) < 2000


def test_max_prompt_chars_comes_from_the_longest_token():
    from serving.state import longest_token_chars
    tokenizer = SimpleNamespace(get_vocab=lambda: {"a": 0, "abcd": 1, "<|im_end|>": 2})
    assert longest_token_chars(tokenizer) == len("<|im_end|>")


def test_openapi_says_400_with_openai_errors(monkeypatch):
    from starlette.testclient import TestClient

    from serving.cli.serve import parse_args
    from serving.api_server import build_app

    monkeypatch.delenv("JAXLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    state = SimpleNamespace(served_model_names=["m"], model_path="/m", max_model_len=8,
                            engine=SimpleNamespace(health=lambda stall_after: None))
    doc = TestClient(build_app(state, parse_args([]))).get("/openapi.json").json()
    body_routes = [op for ops in doc["paths"].values() for op in ops.values()
                   if "requestBody" in op]
    assert len(body_routes) == 13  # completions, chat, responses, embeddings, pooling,
    # (de)tokenize, classify, score and v1/score, rerank and v1/ v2/rerank
    for op in body_routes:
        assert "422" not in op["responses"]
        assert {"400", "401", "404", "413", "503"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    # "stream": true answers server-sent events; the document says so (schemathesis' content
    # type check found it undocumented), and keeps JSON for the rest.
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        assert content["text/event-stream"]["schema"] == {"type": "object"}  # each event's data
    assert "text/event-stream" not in doc["paths"]["/v1/embeddings"]["post"]["responses"]["200"][
        "content"]


@pytest.mark.parametrize("argv", [["--max-n-sequences", "0"], ["--chat-template-timeout", "-1"],
                                  ["--max-waiting-requests", "-1"], ["--max-log-len", "-5"],
                                  ["--http-read-timeout", "nan"]])
def test_bad_limit_flags_are_refused_by_name(argv, capsys):
    from serving.cli.serve import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert f"argument {argv[0]}" in capsys.readouterr().err
    limits = parse_args(["--max-waiting-requests", "0", "--shutdown-timeout", "0"])
    assert (limits.max_waiting_requests, limits.shutdown_timeout) == (0, 0.0)
