"""A hostile corpus against a real `jaxllm serve` (issue 28): requests built to hurt the server
(huge n, prompt floods, template bombs, lone surrogates, non-finite numbers, coerced types,
oversized bodies and headers, missing keys) must each get a quick 4xx in OpenAI's error shape,
never a 5xx, and the server must still serve afterwards."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from server_process import ENGINE_FLAGS, ServerProcess

API_KEY = "hostile-key"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "Hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"
NESTED_LOOPS = ("{% for a in range(99999) %}{% for b in range(99999) %}{{ a }}{% endfor %}"
                "{% endfor %}")


@pytest.fixture(scope="module")
def server(tiny_llama, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_API_KEY", API_KEY)  # honoured like --api-key
    monkeypatch_module.delenv("JAXLLM_API_KEY", raising=False)
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME,
                        "--enable-request-id-headers", "--trust-request-chat-template",
                        "--chat-template-timeout", "1", "--max-request-body-size", "4000000",
                        "--max-n-sequences", "64", "--max-stop-strings", "8",
                        "--max-logit-bias", "50", "--http-read-timeout", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def raw(text: str) -> bytes:
    """A JSON body exactly as written (lone surrogates, NaN and Infinity included)."""
    return text.encode()


def comp(**fields) -> dict:
    return {"model": NAME, "prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": NAME, "messages": USER, "max_tokens": 2, **fields}


def both(fields: dict, status: int, param=None) -> list:
    """The same hostile fields on /v1/completions and /v1/chat/completions."""
    return [(C, comp(**fields), status, param), (CHAT, chat(**fields), status, param)]


SURROGATE_BODIES = [
    (C, raw('{"model": "tiny", "prompt": "a\\ud800b"}'), "prompt"),
    (C, raw('{"model": "tiny", "prompt": ["ok", "\\udfff"]}'), "prompt"),
    (C, raw('{"model": "\\ud800", "prompt": "a"}'), "model"),
    (C, raw('{"model": "tiny", "prompt": "a", "stop": ["\\ud83d"]}'), "stop"),
    (C, raw('{"model": "tiny", "prompt": "a", "logit_bias": {"\\ud800": 1}}'), "logit_bias"),
    (C, raw('{"model": "tiny", "prompt": "a", "\\ud800": 1}'), "a field name"),
    (CHAT, raw('{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'),
     "messages"),
    (CHAT, raw('{"model": "tiny", "messages": [{"role": "\\ud800", "content": "x"}]}'),
     "messages"),
    (CHAT, raw('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
               '"text": "\\udc00"}]}]}'), "messages"),
    ("/tokenize", raw('{"prompt": "\\ud800"}'), "prompt"),
    ("/detokenize", raw('{"tokens": [1], "model": "\\ud800"}'), "model"),
]

TEMPLATE_BOMBS = ["{{ 1/0 }}", "{% for i in range(10**9) %}x{% endfor %}", NESTED_LOOPS,
                  "{% for i in range(99999) %}{{ messages }}{% endfor %}",
                  "{{ messages[5]['content'] }}", "{{ undefined_function() }}", "{% if %}",
                  "{{ ''.__class__.__mro__ }}", "{{ raise_exception('nope') }}"]

CASES = [
    # one request must not take the engine: n, prompts per request, stops, logit_bias, logprobs
    *both({"n": 9223372036854775807}, 400, "n"),
    *both({"n": 1000}, 400, "n"),
    *both({"n": 65}, 400, "n"),
    *both({"n": 0}, 400, "n"),
    (C, comp(prompt=["Hi"] * 1000), 400, "prompt"),
    (C, comp(prompt=[[5, 6]] * 65), 400, "prompt"),
    (C, comp(prompt=["Hi"] * 8, n=9), 400, "prompt"),
    *both({"stop": ["x"] * 10000}, 400, "stop"),
    *both({"stop": ["x"] * 9}, 400, "stop"),
    *both({"stop": "y" * 200000}, 400, "stop"),
    *both({"logit_bias": {str(i): 1 for i in range(51)}}, 400, "logit_bias"),
    (C, comp(logprobs=21), 400, "logprobs"),
    (C, comp(prompt_logprobs=21), 400, "prompt_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "logprobs"),
    (CHAT, chat(top_logprobs=-1), 400, "top_logprobs"),
    (C, comp(prompt="hello " * 500000), 400, "prompt"),  # 3 MB: refused before tokenizing
    (CHAT, chat(messages=[{"role": "user", "content": "hello " * 500000}]), 400, "prompt"),
    ("/tokenize", {"prompt": "hello " * 500000}, 400, "prompt"),
    (C, comp(max_tokens=2**63), 400, "max_tokens"),
    (C, comp(seed=2**64), 400, "seed"),
    (C, comp(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    # non-finite numbers
    *both({"temperature": "Infinity"}, 400, "temperature"),
    *both({"repetition_penalty": "inf"}, 400, "repetition_penalty"),
    *both({"top_p": "NaN"}, 400, "top_p"),
    (C, raw('{"model": "tiny", "prompt": "a", "temperature": Infinity}'), 400, "temperature"),
    (C, raw('{"model": "tiny", "prompt": "a", "temperature": -Infinity}'), 400, "temperature"),
    (C, raw('{"model": "tiny", "prompt": "a", "logit_bias": {"5": NaN}}'), 400, "logit_bias"),
    (CHAT, raw('{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
               '"presence_penalty": NaN}'), 400, "presence_penalty"),
    (C, raw('{"model": "tiny", "prompt": "a", "top_p": 1e999}'), 400, "top_p"),
    # strict types: coercion would hide the client's mistake
    *both({"stream": "yes"}, 400, "stream"),
    *both({"max_tokens": True}, 400, "max_tokens"),
    *both({"seed": "1"}, 400, "seed"),
    *both({"n": "2"}, 400, "n"),
    *both({"temperature": "0.5"}, 400, "temperature"),
    *both({"ignore_eos": "false"}, 400, "ignore_eos"),
    *both({"stop_token_ids": ["1"]}, 400, "stop_token_ids"),
    *both({"max_tokens": 2.5}, 400, "max_tokens"),
    (C, comp(echo="true"), 400, "echo"),
    (C, comp(logprobs="3"), 400, "logprobs"),
    (CHAT, chat(logprobs="true"), 400, "logprobs"),
    # roles and messages
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "", "content": "x"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": None, "content": "x"}]), 400, "messages"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    (CHAT, chat(messages="hello"), 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "x"}}]}]),
     400, "messages"),
    # request-supplied templates: a failure or an overrun is the request's 400
    *[(CHAT, chat(chat_template=t), 400, None) for t in TEMPLATE_BOMBS],
    *[("/tokenize", {"messages": USER, "chat_template": t}, 400, None) for t in TEMPLATE_BOMBS],
    (CHAT, chat(chat_template_kwargs={"messages": []}), 400, "messages"),
    # options this server cannot honour are refused, not ignored
    *both({"logits_processors": ["my.module:Proc"]}, 400, "logits_processors"),
    *both({"guided_foo": 1}, 400, "guided_foo"),
    # structured output, bad_words, truncation: malformed, conflicting or uncompilable -> 400
    *both({"bad_words": "x"}, 400, "bad_words"),
    *both({"bad_words": [""]}, 400, "bad_words"),
    *both({"truncate_prompt_tokens": -5}, 400, "truncate_prompt_tokens"),
    *both({"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    *both({"truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens"),
    *both({"return_tokens_as_token_ids": "yes"}, 400, "return_tokens_as_token_ids"),
    *both({"guided_json": "{not json"}, 400, "guided_json"),
    *both({"guided_json": {"type": "object"}, "guided_regex": "a"}, 400, "conflicting"),
    *both({"guided_choice": []}, 400, "guided_choice"),
    *both({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, 400, "xgrammar"),
    *both({"guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern"),
    *both({"structured_outputs": {"choice": ["a"], "regex": "b"}}, 400, "structured_outputs"),
    *both({"structured_outputs": {"jsn": {}}}, 400, "structured_outputs"),
    *both({"response_format": {"type": "yaml"}}, 400, "response_format"),
    *both({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    *both({"guided_regex": "(unclosed"}, 400, "regex"),  # the grammar engine's compile error
    *both({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
          400, "json"),
    *both({"guided_grammar": "root ::= undefined_rule"}, 400, "grammar"),
    (CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    (C, comp(use_beam_search=True, stream=True), 400, "stream"),
    (C, comp(use_beam_search=True, logprobs=2), 400, "logprobs"),
    (C, comp(use_beam_search=True, top_p=0.5), 400, "top_p"),
    (C, comp(use_beam_search=True, guided_regex="a+"), 400, "guided_regex"),
    (C, comp(use_beam_search=True, response_format={"type": "json_object"}), 400,
     "response_format"),
    (C, comp(use_beam_search=True, n=11), 400, "n"),  # 2 x 11 logprobs > --max-logprobs
    *both({"best_of": 3}, 400, "best_of"),
    (C, comp(suffix="x"), 400, "suffix"),
    (C, comp(max_tokens=0), 400, "max_tokens"),  # only echo may ask for no tokens
    # malformed bodies
    (C, b"{not json", 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"null", 400, None),
    (C, b"[" * 100000 + b"]" * 100000, 400, None),
    (C, raw('{"model": "tiny", "prompt": "a", "logit_bias": {"1": ' + "[" * 900 + "]" * 900
            + "}}"), 400, "logit_bias"),
    (CHAT, raw('{"model": "tiny", "messages": [{"role": "user", "content": ' + "[" * 900
               + "]" * 900 + "}]}"), 400, "messages"),
    (C, raw('{"model": "tiny", "prompt": "a", "n": 0, "deep": ' + "[" * 900 + "]" * 900 + "}"),
     400, "n"),
    (C, b'{"prompt": "a", "prompt": 5}', 400, "prompt"),
    (C, comp(prompt=5), 400, "prompt"),
    (C, comp(prompt=[[1, "x"]]), 400, "prompt"),
    (C, comp(prompt=[-1]), 400, "prompt"),
    (C, comp(prompt=[10**12]), 400, "prompt"),
    (C, comp(prompt=""), 400, "prompt"),
    (C, comp(prompt=[]), 400, "prompt"),
    (C, comp(model="gpt-4"), 404, "model"),
    ("/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400, None),
    ("/v1/nope", {}, 404, None),
    *[(path, body, 400, param) for path, body, param in SURROGATE_BODIES],
]


def read_reply(sock: socket.socket) -> str:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data.decode()


def check_error(r: httpx.Response, status: int, param) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param or param in error["message"], error


def post_case(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def test_hostile_corpus(server):
    """Every case: the expected 4xx, OpenAI-shaped, within seconds; then the server serves."""
    assert len(CASES) >= 100
    slowest = 0.0
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body, status, param in CASES:
            start = time.monotonic()
            try:
                r = post_case(http, path, body)
            except httpx.RemoteProtocolError:
                # The keep-alive race every HTTP/1.1 client knows: the server closed the idle
                # connection (--http-read-timeout, 2 s here) as the next request went out. A
                # live server answers the resend on a new connection; a dead one does not.
                assert server.proc.poll() is None, "the server died"
                start = time.monotonic()
                r = post_case(http, path, body)
            elapsed = time.monotonic() - start
            slowest = max(slowest, elapsed)
            assert r.status_code < 500, (path, str(body)[:200], r.text[:500])
            check_error(r, status, param)
            assert elapsed < 10, (path, str(body)[:200], elapsed)
        ok = http.post(C, json=comp(max_tokens=3, ignore_eos=True))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert http.get("/health").status_code == 200


def test_template_bomb_does_not_stall_other_requests(server):
    """A template rendering forever is cut at --chat-template-timeout (1 s here)."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        start = time.monotonic()
        r = http.post(CHAT, json=chat(chat_template=NESTED_LOOPS))
        assert r.status_code == 400 and "1 s" in r.json()["error"]["message"]
        assert time.monotonic() - start < 5
        r = http.post("/tokenize", json={"prompt": "still here"})
        assert r.status_code == 200 and r.json()["count"] > 0


def test_echo_with_max_tokens_0_scores_the_prompt(server):
    """vLLM's prompt scoring: the prompt back with its logprobs, no completion tokens."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        prompt = "The capital of France is"
        n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
        body = comp(prompt=prompt, echo=True, max_tokens=0, logprobs=1)
        r = http.post(C, json=body).json()
        (choice,) = r["choices"]
        assert choice["text"] == prompt
        assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                              "total_tokens": n_prompt, "prompt_tokens_details": None}
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
        assert all(x <= 0 for x in lp["token_logprobs"][1:])
        with http.stream("POST", C, json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == prompt


def test_body_header_and_request_id_limits(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        big = json.dumps(comp(prompt="x" * 4_100_000))
        check_error(http.post(C, content=big, headers={"content-type": "application/json"}),
                    413, None)
        many = {f"x-h{i}": "1" for i in range(300)}
        check_error(http.post(C, json=comp(), headers=many), 431, None)
        for request_id in ("x" * 129, "has space", "", "é".encode()):
            check_error(http.post(C, json=comp(), headers={"X-Request-Id": request_id}), 400,
                        "X-Request-Id")
        r = http.post(C, json=comp(), headers={"X-Request-Id": "my-id-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
        assert r.json()["id"] == "cmpl-my-id-1"
    # Headers over --h11-max-incomplete-event-size (64 KiB), whole or in pieces.
    r = httpx.post(server.url + C, json=comp(), headers={**AUTH, "x-big": "y" * 70_000})
    check_error(r, 431, None)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(80):  # until the server answers
            if select.select([sock], [], [], 0.01)[0]:
                break
            sock.sendall(b"z" * 1024)
        reply = read_reply(sock)
    assert reply.startswith("HTTP/1.1 400") and json.loads(reply.split("\r\n\r\n", 1)[1])[
        "error"]["code"] == 400


def test_slow_clients_are_cut_off(server):
    """A request head or body that does not arrive within --http-read-timeout (2 s here)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert 1.5 < time.monotonic() - start < 8
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: 100"
                     f"\r\n\r\n{{\"prompt\": ".encode())
        reply = read_reply(sock)
    assert reply.startswith("HTTP/1.1 408") and json.loads(reply.split("\r\n\r\n", 1)[1])[
        "error"]["code"] == 408


OPEN = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/metrics")]
CLOSED = [("GET", "/v1/models"), ("POST", C), ("POST", CHAT), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/openapi.json"),
          ("GET", "/docs"), ("GET", "/redoc")]


@pytest.mark.parametrize("method, path", CLOSED)
def test_every_route_needs_the_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.request(method, server.url + path, headers=headers, json={})
        check_error(r, 401, None)
    r = httpx.request(method, server.url + path, headers=AUTH,
                      json={"prompt": "x", "tokens": [1], "messages": USER}
                      if path in ("/tokenize", "/detokenize") else comp())
    assert r.status_code != 401


@pytest.mark.parametrize("method, path", OPEN)
def test_probes_need_no_key(server, method, path):
    assert httpx.request(method, server.url + path).status_code == 200


def test_prompts_are_not_logged_by_default(server):
    secret = "my-secret-prompt-text"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        assert http.post(C, json=comp(prompt=secret)).status_code == 200
    log = server.output(tail=10**7)
    assert secret not in log and "Received request" not in log
