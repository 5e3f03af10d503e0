"""Prompts given as embeddings (issue 51, vLLM's --enable-prompt-embeds): the rows go to the
step like an image's (jaxllm/engine/multimodal.py `prompt_embeds_inputs`), so a prompt of the
model's own input embeddings decodes exactly as its token ids do, and as transformers does
from `inputs_embeds`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError, EngineArgs

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 30, 31, 4, 4, 11, 12, 6, 2, 9, 9, 14, 15, 16, 3, 5, 8],
           [7, 3, 3, 8, 21], [4, 4, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype="float32")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # 16-token steps: the 24-row prompt is prefilled in two chunks, split inside its rows.
    return LLM(tiny_llama, dtype="float32", enable_prompt_embeds=True, max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=16)


def embeds(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.get_input_embeddings()(torch.tensor(ids)).float()


def test_embeds_decode_as_their_tokens_and_as_transformers(llm, hf):
    """A batch mixing embeddings prompts (a NumPy array and a torch tensor) with a token-id
    prompt, the long one split over two steps: each equals the token-id run of the same prompt
    and transformers' greedy decoding from inputs_embeds."""
    by_ids = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    mixed = llm.generate([{"prompt_embeds": embeds(hf, PROMPTS[0]).numpy()},
                          {"prompt_token_ids": PROMPTS[1]},
                          {"prompt_embeds": embeds(hf, PROMPTS[2])}], GREEDY, use_tqdm=False)
    for i, (a, b) in enumerate(zip(by_ids, mixed)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, i
    for i in (0, 2):
        e = embeds(hf, PROMPTS[i])[None]
        want = hf.generate(inputs_embeds=e, max_new_tokens=6, min_new_tokens=6,
                           do_sample=False)[0].tolist()
        assert mixed[i].outputs[0].token_ids == want[-6:], i
        assert mixed[i].prompt is None and len(mixed[i].prompt_token_ids) == len(PROMPTS[i])


def test_prefix_cache_keys_embeds_by_content(llm, hf):
    """The same embeddings again hit the prefix cache; one changed row does not (the cache
    keys the rows by content, the placeholder token ids being all alike)."""
    e = embeds(hf, PROMPTS[0]).numpy()
    first = llm.generate({"prompt_embeds": e}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": e}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    other = e.copy()
    other[0] = embeds(hf, [100])[0].numpy()  # the first row: no block of it may match
    changed = llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)[0]
    assert changed.num_cached_tokens == 0
    ids = [100] + PROMPTS[0][1:]
    assert changed.outputs[0].token_ids == llm.generate(
        {"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_embeds": np.zeros((3, 5), np.float32)}, GREEDY, r"\[tokens, 64\]"),
    ({"prompt_embeds": np.zeros(64, np.float32)}, GREEDY, r"\[tokens, 64\]"),
    ({"prompt_embeds": np.full((2, 64), np.nan, np.float32)}, GREEDY, "finite"),
    ({"prompt_embeds": np.zeros((2, 64), np.int32)}, GREEDY, "floating point"),
    ({"prompt_embeds": np.zeros((2, 64), np.float32), "prompt": "hi"}, GREEDY,
     "cannot be combined with prompt"),
    ({"prompt_embeds": np.zeros((2, 64), np.float32)},
     SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
    ({"prompt_embeds": np.zeros((2, 64), np.float32)},
     SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
    ({"prompt_embeds": np.zeros((65, 64), np.float32)}, GREEDY, "maximum model length"),
    # Any key the engine does not read is refused, not dropped (vLLM's token_type_ids here).
    ({"prompt_token_ids": [1, 2], "token_type_ids": [0, 0]}, GREEDY, "token_type_ids"),
])
def test_bad_embeds_are_refused_naming_the_problem(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)


def test_truncation_keeps_the_last_rows(llm, hf):
    e = embeds(hf, PROMPTS[0]).numpy()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            truncate_prompt_tokens=5)
    got = llm.generate({"prompt_embeds": e}, params, use_tqdm=False)[0]
    want = llm.generate({"prompt_token_ids": PROMPTS[0][-5:]}, params, use_tqdm=False)[0]
    assert len(got.prompt_token_ids) == 5
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("extra, match", [
    ({"pipeline_parallel_size": 2}, "pipeline-parallel-size"),
    ({"runner": "pooling"}, "runner"),
])
def test_start_up_refusals(tiny_llama, extra, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny_llama, enable_prompt_embeds=True, **extra).create_engine_config()


def test_without_the_flag_prompt_embeds_are_refused(load, tiny_llama):
    from transformers import AutoTokenizer

    from jaxllm.engine.input_processor import InputProcessor

    _, cfg, _ = load(tiny_llama)
    inputs = InputProcessor(AutoTokenizer.from_pretrained(tiny_llama), cfg, max_logprobs=0,
                            eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        inputs.process_prompt({"prompt_embeds": np.zeros((2, 64), np.float32)})


def b64_tensor(t: torch.Tensor) -> str:
    import base64
    import io
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_http_format_reads_torch_save_without_torch(dtype):
    """vLLM's wire format (base64 of torch.save) decoded by the server's restricted reader:
    the values of a strided view, in its dtype; other pickles are refused, naming the field."""
    from serving.errors import APIError
    from serving.prompt_embeds import decode_prompt_embeds

    t = torch.randn(6, 8).to(dtype)[:, ::2].t()  # a view: offset/stride matter
    got = decode_prompt_embeds(b64_tensor(t))
    assert got.shape == (4, 6) and got.dtype.itemsize == t.element_size()
    np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())
    for bad in (b64_tensor(torch.tensor([1, 2])), "not base64!", b64_tensor({"a": 1})):
        with pytest.raises(APIError, match="prompt_embeds"):
            decode_prompt_embeds(bad)


def test_completion_request_takes_one_of_prompt_and_prompt_embeds():
    from serving.errors import APIError
    from serving.protocol_completion import CompletionRequest

    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="prompt_embeds"):  # neither: a 400 on `prompt`
        CompletionRequest(model="m")
    for body, match in (({"prompt": "a", "prompt_embeds": "x"}, "either prompt"),
                        ({"prompt_embeds": "x", "echo": True}, "echo"),
                        ({"prompt_embeds": "x", "use_beam_search": True}, "use_beam_search")):
        with pytest.raises(APIError, match=match):
            CompletionRequest(model="m", **body).check_supported()
    CompletionRequest(model="m", prompt_embeds=["x", "y"]).check_supported()


@pytest.mark.slow  # a server process of its own
def test_server_prompt_embeds(tiny_llama, hf):
    """`jaxllm serve --enable-prompt-embeds`: /v1/completions with vLLM's base64 tensors (two
    prompts in one request) answers what the token ids do; a wrong width is a 400 naming it."""
    import httpx
    from server_process import ENGINE_FLAGS, ServerProcess

    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--enable-prompt-embeds")
    try:
        body = {"model": tiny_llama, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            by_ids = c.post("/v1/completions", json={**body, "prompt": PROMPTS[1:]})
            assert by_ids.status_code == 200, by_ids.text
            r = c.post("/v1/completions", json={**body, "prompt_embeds": [
                b64_tensor(embeds(hf, p)) for p in PROMPTS[1:]]})
            assert r.status_code == 200, r.text
            texts = [ch["text"] for ch in sorted(r.json()["choices"], key=lambda c: c["index"])]
            assert texts == [ch["text"] for ch in sorted(by_ids.json()["choices"],
                                                          key=lambda c: c["index"])]
            assert r.json()["usage"]["prompt_tokens"] == sum(map(len, PROMPTS[1:]))
            r = c.post("/v1/completions", json={**body,
                                               "prompt_embeds": b64_tensor(torch.zeros(3, 5))})
            assert r.status_code == 400 and "prompt_embeds" in r.text, r.text
    finally:
        srv.stop()
