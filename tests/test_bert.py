"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa) on the pooling runner, against
transformers: embeddings (`LLM.embed`) of a sentence-transformers folder (mean pooling,
Normalize) and of a bare BertModel (vLLM's default: CLS, normalized), cross-encoder scores
(`LLM.score`, `/score`, `/rerank` through run-batch's lines) of BERT, whose pair encoding
carries token types, and of XLM-RoBERTa, whose positions start after its padding index.

Tiny random float32 checkpoints (tests/bert_checkpoints.py; hidden 32, 2 layers), so the
vectors and scores agree to ~1e-5. Prompts of several lengths run one by one through
buckets of 16, 32 and 64 tokens.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from bert_checkpoints import make_encoder
from jaxllm import LLM, PoolingParams
from jaxllm.config import ConfigError, EngineArgs

ATOL = 1e-5
QUERY = "what is the cat"
DOCS = ["the cat sat on the mat", "hello world", "a big red fish eats the small bird",
        "where is the dog"]
TEXTS = ["the cat sat on the mat", "hello", "what is the big red fish eating? " * 4]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", block_size=4, use_tqdm_on_load=False,
               disable_log_stats=True, **kw)


def _hf_hidden(path: str, encs: list[dict]) -> list[np.ndarray]:
    """transformers' last_hidden_state of each encoding (input_ids [, token_type_ids])."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**{k: torch.tensor([v]) for k, v in e.items()}).last_hidden_state[0]
                .numpy() for e in encs]


def _hf_scores(path: str, query: str, docs: list[str], types: bool = True):
    """(each pair's tokens, transformers' sigmoid relevance) of `query` against each doc;
    types=False drops the token types (segment 0 throughout)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    encs = [{k: v for k, v in tok(query, d).items() if k != "attention_mask"} for d in docs]
    if not types:
        encs = [{k: v for k, v in e.items() if k != "token_type_ids"} for e in encs]
    with torch.no_grad():
        z = [model(**{k: torch.tensor([v]) for k, v in e.items()}).logits[0, 0].item()
             for e in encs]
    return [e["input_ids"] for e in encs], 1 / (1 + np.exp(-np.asarray(z)))


def _tokens(path: str, texts: list[str]) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [{"input_ids": tok(t)["input_ids"]} for t in texts]


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory):
    return make_encoder(str(tmp_path_factory.mktemp("bert_mean")), "BertModel", seed=0,
                        pooling="mean", normalize=True)


@pytest.fixture(scope="module")
def bert_bare(tmp_path_factory):
    return make_encoder(str(tmp_path_factory.mktemp("bert_bare")), "BertModel", seed=1)


@pytest.fixture(scope="module")
def bert_ce(tmp_path_factory):
    return make_encoder(str(tmp_path_factory.mktemp("bert_ce")),
                        "BertForSequenceClassification", seed=2)


@pytest.fixture(scope="module")
def xlmr_ce(tmp_path_factory):
    return make_encoder(str(tmp_path_factory.mktemp("xlmr_ce")),
                        "XLMRobertaForSequenceClassification", seed=3)


@pytest.fixture(scope="module")
def ce_llm(bert_ce):
    return _llm(bert_ce)


# --- embeddings ----------------------------------------------------------------------------

def test_sentence_transformers_mean_pooling_matches_transformers(bert_mean):
    llm = _llm(bert_mean)  # --runner auto: pooling (an encoder-only architecture)
    assert llm.llm_engine.supported_tasks == ("embed", "token_embed")
    encs = _tokens(bert_mean, TEXTS)
    ids_prompts = [np.random.default_rng(0).integers(5, 60, n).tolist() for n in (1, 17, 40)]
    outs = llm.embed(TEXTS + ids_prompts, use_tqdm=False)
    refs = _hf_hidden(bert_mean, encs + [{"input_ids": p} for p in ids_prompts])
    assert [o.prompt_token_ids for o in outs[:3]] == [e["input_ids"] for e in encs]
    assert len(encs[2]["input_ids"]) > 32  # the 64-token bucket
    for out, ref in zip(outs, refs):
        want = ref.mean(0) / np.linalg.norm(ref.mean(0))
        np.testing.assert_allclose(out.outputs.embedding, want, atol=ATOL)
    raw = llm.embed(TEXTS[:1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.embedding, refs[0].mean(0), atol=ATOL)


def test_bare_bert_pools_cls_normalized_and_per_token(bert_bare):
    llm = _llm(bert_bare)
    assert llm.llm_engine.pooler.config.pooling_type == "CLS"
    encs = _tokens(bert_bare, TEXTS[:2])
    refs = _hf_hidden(bert_bare, encs)
    for out, ref in zip(llm.embed(TEXTS[:2], use_tqdm=False), refs):
        np.testing.assert_allclose(out.outputs.embedding, ref[0] / np.linalg.norm(ref[0]),
                                   atol=ATOL)
    tokens = llm.encode(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False,
                        pooling_task="token_embed")[0]
    np.testing.assert_allclose(tokens.outputs.data, refs[0], atol=ATOL)


# --- cross-encoders --------------------------------------------------------------------------

def test_bert_cross_encoder_scores_pairs_with_token_types(ce_llm, bert_ce):
    assert ce_llm.llm_engine.supported_tasks == ("classify", "score")
    ids, want = _hf_scores(bert_ce, QUERY, DOCS)
    _, untyped = _hf_scores(bert_ce, QUERY, DOCS, types=False)
    assert np.abs(want - untyped).max() > 1e-3  # the segments change the scores
    outs = ce_llm.score(QUERY, DOCS, use_tqdm=False)  # 1:N
    assert [o.prompt_token_ids for o in outs] == ids
    np.testing.assert_allclose([o.outputs.score for o in outs], want, atol=ATOL)
    pairwise = ce_llm.score([QUERY] * 2, DOCS[:2], use_tqdm=False)  # N:N
    np.testing.assert_allclose([o.outputs.score for o in pairwise], want[:2], atol=ATOL)
    # classify on a text alone: one segment, the head's sigmoid
    import torch
    from transformers import AutoModelForSequenceClassification

    one = ce_llm.classify([DOCS[0]], use_tqdm=False)[0]
    model = AutoModelForSequenceClassification.from_pretrained(bert_ce, dtype=torch.float32)
    with torch.no_grad():
        z = model(torch.tensor([one.prompt_token_ids])).logits[0, 0].item()
    np.testing.assert_allclose(one.outputs.probs, [1 / (1 + np.exp(-z))], atol=ATOL)
    with pytest.raises(ValueError, match="maximum model length of 64"):
        ce_llm.score(QUERY, "the cat " * 40, use_tqdm=False)  # past the 64 positions


def test_xlm_roberta_cross_encoder_and_positions(xlmr_ce):
    llm = _llm(xlmr_ce)
    assert llm.llm_engine.model_config.max_model_len == 64  # 66 positions less the offset 2
    ids, want = _hf_scores(xlmr_ce, QUERY, DOCS)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ids
    np.testing.assert_allclose([o.outputs.score for o in outs], want, atol=ATOL)
    # The encoder's hidden states (transformers' XLMRobertaModel of the same checkpoint): a
    # pad token (1) inside a prompt takes the padding position, as transformers'
    # create_position_ids_from_input_ids gives it.
    prompts = [[0, 40, 41, 2], [0, 40, 1, 41, 42, 2], [0] + list(range(5, 25)) + [2]]
    refs = _hf_hidden(xlmr_ce, [{"input_ids": p} for p in prompts])
    for p, ref in zip(prompts, refs):
        np.testing.assert_allclose(llm.llm_engine.pooler.hidden_states(p), ref, atol=ATOL)
    with pytest.raises(ValueError, match="this model has one"):  # type_vocab_size 1
        llm.classify([prompts[0]], PoolingParams(extra_kwargs={"compressed_token_type_ids": 2}),
                     use_tqdm=False)


def test_roberta_model_checkpoint_loads_without_prefix(tmp_path):
    """A bare RobertaModel checkpoint (names without `roberta.`) builds the same encoder."""
    from jaxllm.engine_config import ModelOptions
    from jaxllm.loader.bert_weights import encoder_weights
    from jaxllm.loader.loader import hf_config
    from jaxllm.models.model_config import ModelConfig

    path = make_encoder(str(tmp_path / "roberta"), "RobertaModel", seed=4)
    cfg = ModelConfig.from_hf(hf_config(path), ModelOptions(dtype="float32"))
    assert cfg.encoder.padding_idx == 1 and cfg.encoder.prefix == "roberta"
    import torch
    from transformers import AutoModel

    sd = AutoModel.from_pretrained(path, dtype=torch.float32).state_dict()
    bare = encoder_weights(cfg, ((k, v.numpy()) for k, v in sd.items()), path)
    prefixed = encoder_weights(cfg, ((f"roberta.{k}", v.numpy()) for k, v in sd.items()), path)
    # old TF-converted checkpoints name the LayerNorm weights gamma / beta
    legacy = encoder_weights(cfg, ((k.replace("LayerNorm.weight", "LayerNorm.gamma")
                                    .replace("LayerNorm.bias", "LayerNorm.beta"), v.numpy())
                                   for k, v in sd.items()), path)
    assert set(bare) == set(prefixed) == set(legacy) and bare["wq"].shape == (2, 32, 32)
    for name in bare:
        np.testing.assert_array_equal(bare[name], prefixed[name])
        np.testing.assert_array_equal(bare[name], legacy[name])
    np.testing.assert_array_equal(bare["wq"][1], sd["encoder.layer.1.attention.self.query"
                                                    ".weight"].numpy().T)
    with pytest.raises(ConfigError, match="lacks"):
        encoder_weights(cfg, ((k, v.numpy()) for k, v in sd.items() if "layer.1." not in k),
                        path)
    with pytest.raises(ConfigError, match="not part of"):
        encoder_weights(cfg, [("encoder.layer.0.extra.weight", np.zeros(2))], path)


# --- run-batch lines: /v1/embeddings, /score, /rerank ---------------------------------------

def _run_batch(path: str, lines: list[dict]) -> list[dict]:
    from serving import run_batch

    args = EngineArgs(model=path, dtype="float32", block_size=4, disable_log_stats=True,
                      use_tqdm_on_load=False)
    results = asyncio.run(run_batch.run_with_engine(args, [json.dumps(x) for x in lines]))
    return [json.loads(r.model_dump_json()) for r in results]


def test_run_batch_score_and_rerank_lines(bert_ce, ce_llm):
    offline = np.asarray([o.outputs.score for o in ce_llm.score(QUERY, DOCS, use_tqdm=False)])
    order = np.argsort(-offline, kind="stable")
    lines = [{"custom_id": "s", "method": "POST", "url": "/v1/score",
              "body": {"text_1": QUERY, "text_2": DOCS}},
             {"custom_id": "r", "method": "POST", "url": "/rerank",
              "body": {"query": QUERY, "documents": DOCS, "top_n": 2}},
             {"custom_id": "g", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hi"}}]
    s, r, g = _run_batch(bert_ce, lines)
    np.testing.assert_allclose([d["score"] for d in s["response"]["body"]["data"]], offline,
                               atol=1e-6)
    ranked = r["response"]["body"]["results"]
    assert [x["index"] for x in ranked] == order[:2].tolist()
    np.testing.assert_allclose([x["relevance_score"] for x in ranked], offline[order[:2]],
                               atol=1e-6)
    assert g["response"] is None and g["error"]["param"] == "url"
    assert "pooling" in g["error"]["message"]


def test_run_batch_embedding_lines(bert_mean):
    lines = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": TEXTS[:2]}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": ""}}]
    e, bad = _run_batch(bert_mean, lines)
    refs = _hf_hidden(bert_mean, _tokens(bert_mean, TEXTS[:2]))
    data = e["response"]["body"]["data"]
    for d, ref in zip(data, refs):
        np.testing.assert_allclose(d["embedding"], ref.mean(0) / np.linalg.norm(ref.mean(0)),
                                   atol=ATOL)
    assert bad["response"] is None and bad["error"]["param"] == "input"


# --- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, flag", [
    ({"runner": "generate"}, "--runner generate"),
    ({"quantization": "fp8"}, "--quantization"),
    ({"attention_backend": "cpu"}, "--attention-backend cpu"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype"),
    ({"max_model_len": 100}, "--max-model-len"),  # past max_position_embeddings
    ({"enable_lora": True}, "--enable-lora"),
    ({"rope_theta": 1e4}, "--rope-theta"),
])
def test_refusals_name_the_flag(bert_bare, kw, flag):
    with pytest.raises(ConfigError, match=flag.replace("-", "\\-")):
        _llm(bert_bare, **kw)


def test_roberta_max_model_len_excludes_the_position_offset(xlmr_ce):
    with pytest.raises(ConfigError, match="greater than XLMRobertaForSequenceClassification's "
                                          "64 position embeddings"):
        _llm(xlmr_ce, max_model_len=65)  # within its 66 max_position_embeddings


def test_refusals_without_an_engine(bert_bare):
    from jaxllm.engine_config import ModelOptions
    from jaxllm.loader.bert_weights import check_encoder_options
    from jaxllm.loader.classifier_head import read_classifier_head
    from jaxllm.loader.loader import hf_config
    from jaxllm.models.model_config import ModelConfig

    cfg = ModelConfig.from_hf(hf_config(bert_bare))
    assert cfg.encoder is not None and cfg.num_kv_layers == 0
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        check_encoder_options(cfg, ModelOptions(), SimpleNamespace(size=2))
    with pytest.raises(ConfigError, match="score.weight"):  # --convert classify, no head
        read_classifier_head(bert_bare)
    with pytest.raises(ValueError, match="extra_kwargs"):
        PoolingParams(extra_kwargs={"token_type_ids": [0, 1]})
    with pytest.raises(ValueError, match="non-negative"):
        PoolingParams(extra_kwargs={"compressed_token_type_ids": -1})


def test_decoder_refuses_token_types(tiny_llama):
    from jaxllm.entrypoints.score_utils import compress_token_type_ids

    assert compress_token_type_ids([0, 0, 1, 1]) == 2
    assert compress_token_type_ids([0, 0]) is None and compress_token_type_ids(None) is None
    with pytest.raises(ValueError, match="zeros followed by ones"):
        compress_token_type_ids([0, 1, 0])
    llm = LLM(tiny_llama, dtype="float32", block_size=4, runner="pooling", max_model_len=64,
              use_tqdm_on_load=False, disable_log_stats=True)
    with pytest.raises(ValueError, match="only taken by encoder-only.*none \\(a decoder\\)"):
        llm.embed([[5, 6, 7]], PoolingParams(extra_kwargs={"compressed_token_type_ids": 1}),
                  use_tqdm=False)


def test_sleep_and_new_weights(bert_bare, bert_mean):
    """Level-2 sleep reads the checkpoint again; update_weights takes another checkpoint's
    tensors (a bare BertModel's names, its unused pooler skipped)."""
    import torch
    from transformers import AutoModel

    llm = _llm(bert_bare, enable_sleep_mode=True)
    before = llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding
    llm.sleep(level=2)
    llm.wake_up()
    np.testing.assert_array_equal(llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding,
                                  before)
    other = AutoModel.from_pretrained(bert_mean, dtype=torch.float32)
    llm.update_weights(other.state_dict().items())
    ref = _hf_hidden(bert_mean, _tokens(bert_bare, TEXTS[:1]))[0][0]
    np.testing.assert_allclose(llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding,
                               ref / np.linalg.norm(ref), atol=ATOL)


@pytest.mark.slow  # a server process (~20 s); run-batch's lines cover the same routes
def test_server_embeddings_score_and_rerank(bert_ce, ce_llm, bert_mean):
    import httpx

    from server_process import ServerProcess

    flags = ("--dtype", "float32", "--block-size", "4", "--disable-log-stats")
    http = httpx.Client(timeout=120)  # a bucket's first request compiles its program
    offline = np.asarray([o.outputs.score for o in ce_llm.score(QUERY, DOCS, use_tqdm=False)])
    srv = ServerProcess(bert_ce, *flags, "--served-model-name", "ce")
    try:
        r = http.post(srv.url + "/v1/score", json={"model": "ce", "text_1": QUERY,
                                                    "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in r["data"]], offline, atol=1e-6)
        rr = http.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                                       "top_n": 3}).json()
        order = np.argsort(-offline, kind="stable")[:3]
        assert [x["index"] for x in rr["results"]] == order.tolist()
        assert [x["document"]["text"] for x in rr["results"]] == [DOCS[i] for i in order]
    finally:
        srv.stop()
    srv = ServerProcess(bert_mean, *flags)
    try:
        r = http.post(srv.url + "/v1/embeddings", json={"input": TEXTS}).json()
        refs = _hf_hidden(bert_mean, _tokens(bert_mean, TEXTS))
        for d, ref in zip(r["data"], refs):
            np.testing.assert_allclose(d["embedding"],
                                       ref.mean(0) / np.linalg.norm(ref.mean(0)), atol=ATOL)
        assert r["usage"]["prompt_tokens"] == sum(len(x["input_ids"])
                                                  for x in _tokens(bert_mean, TEXTS))
    finally:
        srv.stop()
