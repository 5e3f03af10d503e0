"""Images through the OpenAI chat API (Qwen2.5-VL, tiny random checkpoint): image_url parts
with data: URLs (PNG, JPEG, WebP), file:// under --allowed-local-media-path, streamed and not,
give transformers' greedy text; bad images get a 400 naming the problem and the server keeps
serving. A server process of its own: slow."""

from __future__ import annotations

import base64
import io

import pytest

import vlm_checkpoints as vc

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server_process import ServerProcess

    path = str(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    hf = vc.build(path)
    media = tmp_path_factory.mktemp("media")
    vc.image(3, 70, 84).save(media / "cat.png")
    srv = ServerProcess(path, "--dtype", "float32", "--max-model-len", "128",
                        "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                        "--served-model-name", "vlm", "--limit-mm-per-prompt", '{"image": 2}',
                        "--allowed-local-media-path", str(media))
    yield srv, hf, media
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _data_url(image, fmt: str) -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*urls):
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in urls),
        {"type": "text", "text": "Describe the image."}]}]


def _reference(hf, images, new_tokens=6):
    from PIL import Image

    tok = vc.tokenizer()
    text = tok.apply_chat_template(_messages(*["x"] * len(images)), tokenize=False,
                                   add_generation_prompt=True)
    images = [Image.open(io.BytesIO(b)) if isinstance(b, bytes) else b for b in images]
    px = vc.image_processor()(images=images, return_tensors="np")
    ids = vc.expand(tok.encode(text), px["image_grid_thw"], hf.config.image_token_id)
    tokens, _ = vc.hf_generate(hf, ids, px["pixel_values"], px["image_grid_thw"], new_tokens)
    return tokens, len(ids)


def _ask(client, messages, **kw):
    return client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=6, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)


def _tokens(logprobs) -> list[int]:
    """The sampled token ids (return_tokens_as_token_ids spells them token_id:N)."""
    return [int(t.token.split(":")[1]) for t in logprobs]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_url_images_match_transformers(served, fmt):
    srv, hf, _ = served
    image = vc.image(0, 60, 90)
    url = _data_url(image, fmt)
    text, prompt_len = _reference(hf, [base64.b64decode(url.split(",", 1)[1])])
    out = _ask(_client(srv), _messages(url))
    assert _tokens(out.choices[0].logprobs.content) == text
    assert out.usage.prompt_tokens == prompt_len  # the image's tokens counted
    chunks = _ask(_client(srv), _messages(url), stream=True)
    assert _tokens([t for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]) == text


def test_two_images_and_a_local_file(served):
    srv, hf, media = served
    from PIL import Image

    local = Image.open(media / "cat.png")
    other = vc.image(1, 130, 70)
    text, _ = _reference(hf, [local, other])
    out = _ask(_client(srv), _messages(f"file://{media}/cat.png", _data_url(other, "PNG")))
    assert _tokens(out.choices[0].logprobs.content) == text


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                         + base64.b64encode(b"hello").decode()}},
     ["image 0", "not a readable image"]),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, ["base64"]),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     ["'example.com'", "--allowed-media-domains"]),
    ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}},
     ["outside --allowed-local-media-path"]),
    ({"type": "video_url", "video_url": {"url": "x"}}, ["video_url", "not implemented"]),
    ({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}, ["audio"]),
])
def test_bad_images_get_a_400_naming_the_problem(served, part, words):
    srv = served[0]
    with pytest.raises(openai.BadRequestError) as e:
        _ask(_client(srv), [{"role": "user", "content": [part]}])
    for w in words:
        assert w in str(e.value)


def test_too_many_images_then_still_serving(served):
    srv, hf, _ = served
    url = _data_url(vc.image(0, 60, 90), "PNG")
    with pytest.raises(openai.BadRequestError, match="at most 2.*--limit-mm-per-prompt"):
        _ask(_client(srv), _messages(url, url, url))
    out = _ask(_client(srv), _messages(url))
    assert _tokens(out.choices[0].logprobs.content) == _reference(hf, [vc.image(0, 60, 90)])[0]
