"""Qwen3-VL images through the OpenAI chat API (tiny random checkpoint): an image_url data URL,
streamed and not, gives transformers' greedy tokens; a video part gets a 400 naming it and the
server keeps serving. A server process of its own: slow."""

from __future__ import annotations

import pytest

import qwen3vl_checkpoints as qc
import vlm_checkpoints as vc
from test_vlm_server import _ask, _data_url, _messages, _tokens

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server_process import ServerProcess

    path = str(tmp_path_factory.mktemp("tiny_qwen3_vl"))
    hf = qc.build(path)
    srv = ServerProcess(path, "--dtype", "float32", "--max-model-len", "128",
                        "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
                        "--served-model-name", "vlm")
    yield srv, hf
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _reference(hf, images):
    text = vc.tokenizer().apply_chat_template(_messages(*["x"] * len(images)), tokenize=False,
                                              add_generation_prompt=True)
    ids, tokens, _ = qc.reference(hf, text, images, 6)
    return tokens, len(ids)


def test_image_urls_match_transformers_streamed_and_not(served):
    """Two images (PNG: lossless, so the server's decoded pixels are the reference's), the
    prompt split into 16-token chunks inside the second."""
    srv, hf = served
    images = [vc.image(0, 60, 90), vc.image(1, 130, 70)]
    tokens, prompt_len = _reference(hf, images)
    urls = [_data_url(im, "PNG") for im in images]
    out = _ask(_client(srv), _messages(*urls))
    assert _tokens(out.choices[0].logprobs.content) == tokens
    assert out.usage.prompt_tokens == prompt_len  # the images' tokens counted
    chunks = _ask(_client(srv), _messages(*urls), stream=True)
    assert _tokens([t for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]) == tokens


def test_video_gets_a_400_then_still_serving(served):
    srv, hf = served
    with pytest.raises(openai.BadRequestError) as e:
        _ask(_client(srv), [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "x"}}]}])
    assert "video_url" in str(e.value) and "not implemented" in str(e.value)
    image = vc.image(2, 70, 84)
    out = _ask(_client(srv), _messages(_data_url(image, "PNG")))
    assert _tokens(out.choices[0].logprobs.content) == _reference(hf, [image])[0]
