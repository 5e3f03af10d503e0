"""Gemma 3 images through the OpenAI chat API (tiny random checkpoint): image_url parts with
PNG data: URLs, streamed and not, give transformers' greedy tokens; a part over the image limit
gets a 400 and the server keeps serving. A server process of its own: slow."""

from __future__ import annotations

import base64
import io

import pytest

import gemma3v_checkpoints as gc

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server_process import ServerProcess

    path = str(tmp_path_factory.mktemp("tiny_gemma3v"))
    hf = gc.build(path)
    srv = ServerProcess(path, "--dtype", "float32", "--max-model-len", "96",
                        "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
                        "--served-model-name", "vlm", "--limit-mm-per-prompt", '{"image": 2}')
    yield srv, hf
    srv.stop()


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(n: int):
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": _data_url(gc.image(i, 60 + 10 * i, 90))}}
          for i in range(n)),
        {"type": "text", "text": "Describe the image."}]}]


def _reference(hf, n: int) -> tuple[list[int], int]:
    text = gc.tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}] * n
          + [{"type": "text", "text": "Describe the image."}]}],
        tokenize=False, add_generation_prompt=True)
    inp = gc.inputs(text, [gc.image(i, 60 + 10 * i, 90) for i in range(n)])
    return gc.hf_generate(hf, inp, 6)[0], inp["input_ids"].shape[1]


def _ask(client, messages, **kw):
    return client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=6, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)


def _tokens(logprobs) -> list[int]:
    return [int(t.token.split(":")[1]) for t in logprobs]


@pytest.mark.parametrize("n", [1, 2])
def test_data_url_images_match_transformers(served, n):
    srv, hf = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    tokens, prompt_len = _reference(hf, n)
    out = _ask(client, _messages(n))
    assert out.usage.prompt_tokens == prompt_len
    assert _tokens(out.choices[0].logprobs.content) == tokens
    streamed = []
    for chunk in _ask(client, _messages(n), stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += _tokens(chunk.choices[0].logprobs.content)
    assert streamed == tokens


def test_too_many_images_is_a_400_and_the_server_keeps_serving(served):
    srv, hf = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        _ask(client, _messages(3))
    assert _tokens(_ask(client, _messages(1)).choices[0].logprobs.content) == _reference(hf, 1)[0]
