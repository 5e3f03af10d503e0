"""The serving layer without a model: request models and their SamplingParams, the error shape,
chat-template rendering, and the stream plumbing that must abort engine requests on every exit.

End-to-end behaviour against a real engine is in test_server.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from jaxllm.engine.input_processor import (load_chat_template, normalize_messages,
                                           render_chat_prompt)
from jaxllm.engine.stats import EngineStats
from jaxllm.outputs import CompletionOutput, RequestOutput
from serving.errors import APIError, describe_validation_errors, error_body
from jaxllm.sampling_params import SamplingParams
from serving.generation import (EventStreamResponse, max_tokens_for, merge, split_prompts,
                               submit)
from serving.metrics import ServerMetrics
from serving.protocol import ChatCompletionRequest, DeltaMessage, TokenizeRequest
from serving.protocol_completion import CompletionRequest
from serving.state import Admission

# --- request models ----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert split_prompts(CompletionRequest(prompt=prompt).prompt) == expected


@pytest.mark.parametrize("prompt", [None, 3, ["a", 1], [[1, "x"]], {"a": 1}])
def test_bad_prompt_types_are_validation_errors(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=prompt)


def test_empty_prompt_is_refused():
    with pytest.raises(APIError, match="empty"):
        split_prompts(CompletionRequest(prompt=[]).prompt)


def test_openai_defaults_then_generation_config_defaults():
    req = CompletionRequest(prompt="x")
    assert req.max_tokens == 16  # OpenAI's and vLLM's completions default
    sp = req.sampling_params(16, None, None, {})
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    sp = req.sampling_params(16, None, None, defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    explicit = CompletionRequest(prompt="x", temperature=0.0, top_p=0.5, top_k=3)
    sp = explicit.sampling_params(16, None, None, defaults)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.0, 0.5, 3)


def test_sampling_fields_reach_sampling_params():
    req = CompletionRequest(prompt="x", n=2, seed=7, stop="END", presence_penalty=0.5,
                            frequency_penalty=-0.5, logit_bias={"5": 500, "6": -3},
                            min_tokens=2, ignore_eos=True, skip_special_tokens=False,
                            include_stop_str_in_output=True, stop_token_ids=[9], min_p=0.1)
    sp = req.sampling_params(10, 3, None, {})
    assert (sp.n, sp.seed, sp.stop, sp.max_tokens, sp.logprobs) == (2, 7, ["END"], 10, 3)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.min_p) == (0.5, -0.5, 0.1)
    assert sp.logit_bias == {5: 100.0, 6: -3.0}  # clamped to [-100, 100] as vLLM does
    assert sp.min_tokens == 2 and sp.ignore_eos and not sp.skip_special_tokens
    assert sp.include_stop_str_in_output and sp.stop_token_ids == [9]


@pytest.mark.parametrize("fields, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"best_of": 3}, "best_of"),
])
def test_unsupported_options_are_refused(fields, param):
    for req in (CompletionRequest(prompt="x", **fields),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)):
        with pytest.raises(APIError) as e:
            req.check_supported()
        assert e.value.status == 400 and e.value.param == param


def test_beam_search_is_refused_on_chat_only():
    CompletionRequest(prompt="x", use_beam_search=True).check_supported()
    with pytest.raises(APIError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                              use_beam_search=True).check_supported()
    assert e.value.param == "use_beam_search"


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_chat_option_checks(fields, param):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    with pytest.raises(APIError) as e:
        req.check_supported()
    assert e.value.param == param


def test_chat_max_tokens_and_logprobs_fields():
    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs).requested_max_tokens is None
    assert ChatCompletionRequest(messages=msgs, max_tokens=5).requested_max_tokens == 5
    req = ChatCompletionRequest(messages=msgs, max_tokens=5, max_completion_tokens=7)
    assert req.requested_max_tokens == 7
    assert ChatCompletionRequest(messages=msgs).num_logprobs is None
    assert ChatCompletionRequest(messages=msgs, logprobs=True).num_logprobs == 0
    assert ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=4).num_logprobs == 4


def test_unknown_fields_are_kept_aside_not_refused():
    req = CompletionRequest(prompt="x", some_new_openai_field=1)
    assert req.model_extra == {"some_new_openai_field": 1}


def test_tokenize_request_needs_exactly_one_input():
    TokenizeRequest(prompt="x")
    TokenizeRequest(messages=[{"role": "user", "content": "x"}])
    for fields in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        with pytest.raises(ValidationError):
            TokenizeRequest(**fields)


def test_max_tokens_rule_is_vllms():
    state = SimpleNamespace(max_model_len=100, generation_defaults={})
    assert max_tokens_for(state, 30, None) == 70
    assert max_tokens_for(state, 30, 70) == 70
    with pytest.raises(APIError, match=r"too large: 71.*100 tokens.*30 input tokens"):
        max_tokens_for(state, 30, 71)
    with pytest.raises(APIError, match=r"maximum context length is 100 .*100 input tokens"):
        max_tokens_for(state, 100, None)
    state.generation_defaults = {"max_new_tokens": 20}
    assert max_tokens_for(state, 30, None) == 20


# --- errors ------------------------------------------------------------------------------------

def test_error_body_shape():
    assert error_body("no", 404, "model") == {"error": {
        "message": "no", "type": "NotFoundError", "param": "model", "code": 404}}
    assert error_body("x", 400)["error"]["type"] == "BadRequestError"
    assert error_body("x", 500)["error"]["type"] == "InternalServerError"


def test_validation_errors_read_as_one_line():
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt="x", max_tokens="many", n="two")
    message, param = describe_validation_errors(e.value.errors())
    assert message == "n: Input should be a valid integer; max_tokens: Input should be a valid integer"
    assert param == "n"


def test_delta_message_sends_only_what_is_set():
    assert DeltaMessage(content="a").model_dump() == {"content": "a"}
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant",
                                                                       "content": ""}


# --- chat templates ----------------------------------------------------------------------------

def test_normalize_messages():
    msgs = normalize_messages([
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ])
    assert msgs == [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"},
                    {"role": "assistant", "content": "", "name": "bot"}]
    parsed = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).messages
    assert normalize_messages(parsed) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "image_url"),
    ([{"content": "x"}], "role"),
    ([{"role": "user", "content": 5}], "content"),
    ([], "empty"),
])
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        normalize_messages(messages)


def test_load_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("/no/such/template.jinja")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_render_with_the_tokenizers_template(tokenizer):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert render_chat_prompt(tokenizer, msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat_prompt(tokenizer, msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")


def test_render_with_override_and_kwargs(tokenizer):
    template = "{{ greeting }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    out = render_chat_prompt(tokenizer, [{"role": "user", "content": "x"}],
                             chat_template=template, chat_template_kwargs={"greeting": "Hey"})
    assert out == "Hey[user:x]"
    with pytest.raises(ValueError, match="may not set tokenize"):
        render_chat_prompt(tokenizer, [{"role": "user", "content": "x"}],
                           chat_template_kwargs={"tokenize": True})


def test_render_errors(tokenizer):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="chat template error: roles"):
        render_chat_prompt(tokenizer, msgs, chat_template="{{ raise_exception('roles') }}")
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_prompt(SimpleNamespace(chat_template=None), msgs)
    with pytest.raises(ValueError, match="tokenizer"):
        render_chat_prompt(None, msgs)


# --- stream plumbing: every exit closes the engine generators (= aborts) ----------------------

def _output(rid: str, tokens: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], None,
                         [CompletionOutput(0, "", list(tokens), None, None,
                                           "length" if finished else None)],
                         finished, metrics={"arrival_time": 0.0, "first_token_time": 0.5})


class FakeEngine:
    """Yields one token per tick forever (until closed); `bad` request ids fail validation."""

    def __init__(self):
        self.open: set[str] = set()
        self.closed: list[str] = []

    def stats(self):
        return EngineStats(num_running=len(self.open), num_free_blocks=1, num_total_blocks=1)

    async def generate(self, prompt, params, request_id, priority=0):
        if "bad" in request_id:
            raise ValueError("bad request")
        self.open.add(request_id)
        try:
            tokens = []
            while True:
                await asyncio.sleep(0.001)
                tokens.append(7)
                yield _output(request_id, tokens, False)
        finally:
            self.open.discard(request_id)
            self.closed.append(request_id)


def _state(engine, admission=None):
    return SimpleNamespace(engine=engine, metrics=ServerMetrics(engine, "m"),
                           log_request=lambda *a: None,
                           admission=admission or Admission(0, None))


def _prompt():
    return SimpleNamespace(token_ids=[1, 2], text=None)


PARAMS = [SamplingParams(), SamplingParams()]


def test_closing_a_merged_stream_closes_every_engine_request():
    async def run():
        engine = FakeEngine()
        state = _state(engine)
        streams = await submit(state, [_prompt(), _prompt()], PARAMS, "r", 0)
        outputs = merge(streams)
        seen = {(await outputs.__anext__())[0] for _ in range(6)}
        assert seen == {0, 1} and engine.open == {"r-0", "r-1"}
        await outputs.aclose()
        assert engine.open == set() and sorted(engine.closed) == ["r-0", "r-1"]
        text = state.metrics.exposition().decode()
        assert 'jaxllm:request_success_total{finished_reason="abort",model_name="m"} 2.0' in text
    asyncio.run(run())


def test_cancelling_the_consumer_closes_every_engine_request():
    async def run():
        engine = FakeEngine()
        streams = await submit(_state(engine), [_prompt(), _prompt()], PARAMS, "r", 0)

        async def consume():
            async for _ in merge(streams):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert engine.open == set() and sorted(engine.closed) == ["r-0", "r-1"]
    asyncio.run(run())


def test_a_refused_prompt_is_a_400_and_aborts_its_siblings():
    async def run():
        engine = FakeEngine()
        with pytest.raises(APIError, match="bad request") as e:
            await submit(_state(engine), [_prompt(), _prompt()], PARAMS, "bad", 0)
        assert e.value.status == 400 and engine.open == set()

        class HalfBad(FakeEngine):
            def generate(self, prompt, params, request_id, priority=0):
                return super().generate(prompt, params,
                                        "bad" if request_id.endswith("1") else request_id)

        engine = HalfBad()
        with pytest.raises(APIError):
            await submit(_state(engine), [_prompt(), _prompt()], PARAMS, "r", 0)
        assert engine.open == set() and engine.closed == ["r-0"]
    asyncio.run(run())


def test_event_stream_closes_its_source_when_the_client_disconnects():
    async def run():
        closed = asyncio.Event()

        async def events():
            try:
                while True:
                    yield "data: x\n\n"
                    await asyncio.sleep(0.001)
            finally:
                await asyncio.sleep(0)  # clean-up may await (an anyio cancel scope forbids it)
                closed.set()

        messages = []

        async def receive():
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        async def send(message):
            messages.append(message)

        await EventStreamResponse(events())({"type": "http"}, receive, send)
        assert closed.is_set()
        assert messages[0]["type"] == "http.response.start"
        assert (b"content-type", b"text/event-stream; charset=utf-8") in messages[0]["headers"]
    asyncio.run(run())


# --- the app's middleware, in process ----------------------------------------------------------

def _client(monkeypatch, *flags, env_key=None, root_path=""):
    from starlette.testclient import TestClient

    from serving.cli.serve import parse_args
    from serving.api_server import build_app

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if env_key is None:
        monkeypatch.delenv("JAXLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("JAXLLM_API_KEY", env_key)
    engine = SimpleNamespace(health=lambda stall_after: None)
    state = SimpleNamespace(served_model_names=["m"], model_path="/m", max_model_len=8,
                            engine=engine)
    return TestClient(build_app(state, parse_args(list(flags))), root_path=root_path)


def test_api_key_from_the_environment(monkeypatch):
    c = _client(monkeypatch, env_key="k")
    r = c.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "m"
    assert c.get("/health").status_code == 200


def test_root_path_keeps_v1_protected(monkeypatch):
    c = _client(monkeypatch, "--api-key", "k", root_path="/api")  # as uvicorn --root-path sets
    assert c.get("/api/v1/models").status_code == 401
    assert c.get("/api/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_fastapi_docs_can_be_disabled(monkeypatch):
    assert _client(monkeypatch).get("/openapi.json").status_code == 200
    r = _client(monkeypatch, "--disable-fastapi-docs").get("/openapi.json")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_cors_settings_are_applied(monkeypatch):
    c = _client(monkeypatch, "--allowed-origins", '["http://ok.test"]')
    preflight = {"Access-Control-Request-Method": "POST"}
    ok = c.options("/v1/models", headers={"Origin": "http://ok.test", **preflight})
    assert ok.headers["access-control-allow-origin"] == "http://ok.test"
    other = c.options("/v1/models", headers={"Origin": "http://evil.test", **preflight})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object"}}}}, "json"),
    ({"guided_json": {"type": "object"}}, "json"),
    ({"guided_regex": "a+", "guided_decoding_backend": "auto"}, "regex"),
    ({"guided_choice": ["a", "b"]}, "choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "json"),
    ({"response_format": {"type": "text"}}, None),
])
def test_structured_output_fields_reach_sampling_params(fields, kind):
    for req in (CompletionRequest(prompt="x", **fields),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)):
        req.check_supported()
        so = req.sampling_params(4, None, None, {}).structured_outputs
        assert (so.kind if so is not None else None) == kind


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": "{", "guided_regex": "a"}, None),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
])
def test_bad_structured_output_fields_name_the_field(fields, param):
    req = CompletionRequest(prompt="x", **fields)
    with pytest.raises(APIError) as e:
        req.sampling_params(4, None, None, {})
    assert e.value.status == 400 and e.value.param == param


def test_bad_words_and_truncation_reach_sampling_params():
    req = CompletionRequest(prompt="x", bad_words=["no"], truncate_prompt_tokens=3)
    sp = req.sampling_params(4, None, None, {})
    assert sp.bad_words == ["no"] and sp.truncate_prompt_tokens == 3
