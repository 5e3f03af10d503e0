"""Pooling (embeddings) through `LLM.embed`/`LLM.encode`, against transformers' hidden states.

The oracle is `AutoModel` (the decoder without its LM head): its `last_hidden_state` is the
final-normed hidden state of every position, which is what jaxllm pools. Prompts of several
lengths (one crossing a block boundary, one past the smallest 16-token bucket) run one by one
through the scratch cache; float32, so the vectors must agree to ~1e-4.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxllm import LLM, PoolingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.worker.pooler import PoolerConfig, read_pooler_config

ATOL = 1e-4
PROMPT_LENS = (1, 5, 17, 40)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in PROMPT_LENS]


def _hf_hidden(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in prompts]


def _pooling_llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", block_size=4, use_tqdm_on_load=False,
               disable_log_stats=True, **{"runner": "pooling", **kw})


@pytest.fixture(scope="module")
def pooling_llm(tiny_llama):
    return _pooling_llm(tiny_llama)


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama):
    return _hf_hidden(tiny_llama, _prompts())


def test_embed_matches_transformers_last_token_normalized(pooling_llm, hf_hidden):
    outs = pooling_llm.embed(_prompts(), use_tqdm=False)
    for out, ids, ref in zip(outs, _prompts(), hf_hidden):
        want = ref[-1] / np.linalg.norm(ref[-1])
        got = np.asarray(out.outputs.embedding)
        assert out.prompt_token_ids == ids and out.finished
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL)


def test_encode_token_embed_and_unnormalized(pooling_llm, hf_hidden):
    outs = pooling_llm.encode(_prompts(), PoolingParams(use_activation=False), use_tqdm=False,
                              pooling_task="token_embed")
    for out, ref in zip(outs, hf_hidden):
        assert out.outputs.data.shape == ref.shape
        np.testing.assert_allclose(out.outputs.data, ref, atol=ATOL)
    raw = pooling_llm.encode(_prompts()[:1], PoolingParams(use_activation=False), use_tqdm=False)
    np.testing.assert_allclose(raw[0].outputs.data, hf_hidden[0][-1], atol=ATOL)


def test_sentence_transformers_mean_pooling(tiny_llama, tmp_path):
    """modules.json + 1_Pooling/config.json choose mean pooling and normalization, and make
    --runner auto pick the pooling runner."""
    path = str(tmp_path / "st")
    shutil.copytree(tiny_llama, path)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"}], f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, f)
    assert read_pooler_config(path) == PoolerConfig("MEAN", True)
    assert read_pooler_config(path, {"use_activation": False}) == PoolerConfig("MEAN", False)
    assert read_pooler_config(path, {"normalize": False, "seq_pooling_type": "last"}) == \
        PoolerConfig("LAST", False)
    llm = _pooling_llm(path, runner="auto")
    prompts = _prompts()[2:]
    for out, ref in zip(llm.embed(prompts, use_tqdm=False), _hf_hidden(path, prompts)):
        want = ref.mean(0) / np.linalg.norm(ref.mean(0))
        np.testing.assert_allclose(out.outputs.embedding, want, atol=ATOL)


def test_generate_and_embed_refused_on_the_other_runner(pooling_llm, tiny_llama):
    with pytest.raises(ValueError, match="--runner generate"):
        pooling_llm.generate("hello", use_tqdm=False)
    gen = LLM(tiny_llama, dtype="float32", use_tqdm_on_load=False, enforce_eager=True,
              max_num_seqs=2, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="--runner pooling"):
        gen.embed("hello", use_tqdm=False)


def test_refused_pooling_fields():
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=8)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=4)


@pytest.mark.parametrize("kwargs, flag", [
    ({"runner": "generate", "convert": "classify"}, "--convert"),
    ({"runner": "generate", "convert": "embed"}, "--convert"),
    ({"task": "embed", "runner": "generate"}, "--runner"),
    ({"pooler_config": '{"pooling": "MEAN"}'}, None),
])
def test_runner_flags_refused(kwargs, flag):
    if flag is None:  # pooler_config keys are checked where the model's config is read
        with pytest.raises(ConfigError, match="--pooler-config"):
            read_pooler_config("/nonexistent", EngineArgs(**kwargs).pooler_config)
        return
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**kwargs)


def test_deprecated_task_maps_to_runner_and_convert(caplog):
    args = EngineArgs(task="embed")
    assert (args.runner, args.convert) == ("pooling", "embed")
    assert "--task is deprecated" in caplog.text
    from jaxllm.engine.runner_settings import runner_type

    options = EngineArgs(convert="embed").create_engine_config().model
    assert runner_type(options, "/nonexistent") == "pooling"
    assert runner_type(EngineArgs().create_engine_config().model, "/nonexistent") == "generate"


# --- the server: /v1/embeddings and /pooling ------------------------------------------------------

@pytest.fixture(scope="module")
def embed_server(tiny_llama):
    from server_process import ENGINE_FLAGS, ServerProcess
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--runner", "pooling", "--block-size", "4",
                        "--served-model-name", "emb")
    yield srv
    srv.stop()


def test_embeddings_endpoint_matches_transformers(embed_server, hf_hidden):
    import base64

    import httpx
    import openai

    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="none")
    prompts = _prompts()
    resp = client.embeddings.create(model="emb", input=prompts)
    assert [d.index for d in resp.data] == list(range(len(prompts)))
    assert resp.usage.prompt_tokens == sum(PROMPT_LENS)
    for d, ref in zip(resp.data, hf_hidden):
        np.testing.assert_allclose(d.embedding, ref[-1] / np.linalg.norm(ref[-1]), atol=ATOL)
    raw = httpx.post(embed_server.url + "/v1/embeddings", json={
        "input": prompts[1], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, resp.data[1].embedding, atol=1e-6)
    text = client.embeddings.create(model="emb", input=["hello world", "hi"])
    assert len(text.data) == 2 and len(text.data[0].embedding) == len(resp.data[0].embedding)
    pooled = httpx.post(embed_server.url + "/pooling", json={
        "input": prompts[2], "task": "token_embed", "use_activation": False}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], hf_hidden[2], atol=ATOL)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ({"input": ""}, "input"), ({"input": []}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "normalize": False}, "normalize"),
    ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype"),
])
def test_embeddings_refusals(embed_server, body, param):
    import httpx
    r = httpx.post(embed_server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_generation_refused_on_a_pooling_server(embed_server):
    import httpx
    r = httpx.post(embed_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"]
