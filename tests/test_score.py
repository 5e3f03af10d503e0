"""Classification, scoring and reranking (LLM.classify, LLM.score, /classify, /score,
/rerank) against transformers' `*ForSequenceClassification` and `AutoModel`.

Tiny random float32 checkpoints: a 3-label Llama classifier (softmax), a 1-label Qwen3
cross-encoder (sigmoid), and the suite's tiny Llama as an embedding model (cosine). The
oracle for a classifier is transformers' logits on the same token ids (a cross-encoder's on
`tokenizer(text_1, text_2)`), for an embedding model the cosine of `AutoModel`'s last-token
hidden states; float32 throughout, so they agree to 1e-5. The server is one process on the
cross-encoder; its scores must equal the offline ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxllm import LLM, PoolingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.loader.classifier_head import ClassifierHead
from score_checkpoints import make_classifier

ATOL = 1e-5
QUERY = "the cat sat on the mat"
DOCS = ["a cat on a mat", "hello world", "the dog sat", "mat"]


def _id_prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in (1, 5, 17, 40)]


def _hf_logits(path: str, batch: list[dict]) -> list[np.ndarray]:
    """transformers' classifier logits, one input (input_ids [, attention_mask]) at a time."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**{k: torch.tensor([v]) for k, v in enc.items()}).logits[0].numpy()
                for enc in batch]


def _hf_pairs(path: str, query: str, docs: list[str]) -> tuple[list[list[int]], np.ndarray]:
    """(each pair's tokens, transformers' sigmoid relevance) of query against each doc."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    encs = [dict(tok(query, d)) for d in docs]
    logits = _hf_logits(path, encs)
    return [e["input_ids"] for e in encs], np.array([1 / (1 + np.exp(-z[0])) for z in logits])


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", block_size=4, max_model_len=128,
               use_tqdm_on_load=False, disable_log_stats=True, **kw)


@pytest.fixture(scope="module")
def classifier(tiny_llama, tmp_path_factory):
    return make_classifier(str(tmp_path_factory.mktemp("cls3")), "llama", 3, tiny_llama)


@pytest.fixture(scope="module")
def cross_encoder(tiny_llama, tmp_path_factory):
    return make_classifier(str(tmp_path_factory.mktemp("ce")), "qwen3", 1, tiny_llama, seed=1)


@pytest.fixture(scope="module")
def ce_llm(cross_encoder):
    return _llm(cross_encoder)


# --- classification ------------------------------------------------------------------------------

def test_classify_matches_transformers_softmax(classifier):
    llm = _llm(classifier)  # --runner auto: pooling, --convert classify (the architecture)
    assert llm.llm_engine.supported_tasks == ("classify",)
    prompts = _id_prompts()
    want = _hf_logits(classifier, [{"input_ids": p} for p in prompts])
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for out, ids, z in zip(outs, prompts, want):
        e = np.exp(z - z.max())
        assert out.prompt_token_ids == ids and out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, e / e.sum(), atol=ATOL)
    raw = llm.classify({"prompt_token_ids": prompts[2]}, PoolingParams(use_activation=False),
                       use_tqdm=False)
    np.testing.assert_allclose(raw[0].outputs.probs, want[2], atol=1e-4)
    assert llm.llm_engine.classifier.label(np.asarray(outs[2].outputs.probs)) == \
        f"L{int(np.argmax(want[2]))}"
    # A classifier with 3 labels scores nothing; it embeds nothing and generates nothing.
    with pytest.raises(ValueError, match="num_labels == 1"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="task 'embed' is not supported"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="--runner generate"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.reward is not supported"):
        llm.reward("hello")


def test_classifier_head_activations():
    """vLLM's activation by problem_type: softmax over several labels, sigmoid for one or
    for multi-label, none for regression; use_activation=False: the logits."""
    rng = np.random.default_rng(0)
    w, h = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    z = w @ h
    head = ClassifierHead(w, None, {0: "a", 1: "b", 2: "c"})
    np.testing.assert_allclose(head.probs(h), np.exp(z) / np.exp(z).sum(), rtol=1e-5)
    np.testing.assert_allclose(head.probs(h, use_activation=False), z, rtol=1e-5)
    sig = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(ClassifierHead(w, None, {}, "multi_label_classification")
                               .probs(h), sig, rtol=1e-5)
    np.testing.assert_allclose(ClassifierHead(w, None, {}, "regression").probs(h), z, rtol=1e-5)
    one = ClassifierHead(w[:1], np.float32([0.5]), {})
    np.testing.assert_allclose(one.probs(h), 1 / (1 + np.exp(-(z[:1] + 0.5))), rtol=1e-5)
    assert head.label(head.probs(h)) == "abc"[int(np.argmax(z))]
    assert ClassifierHead(w, None, {}).label(z) is None


def test_convert_and_runner_refusals(tiny_llama, classifier):
    with pytest.raises(ConfigError, match="--convert classify: .* no classification head"):
        _llm(tiny_llama, convert="classify")  # a causal LM: no score.weight
    with pytest.raises(ConfigError, match="--pooler-config: pooling_type ALL"):
        _llm(classifier, pooler_config='{"pooling_type": "ALL"}')
    with pytest.raises(ConfigError, match="--runner generate: LlamaForSequenceClassification"):
        _llm(classifier, runner="generate")
    with pytest.raises(ConfigError, match="--convert"):
        EngineArgs(runner="generate", convert="classify")
    args = EngineArgs(task="score")  # vLLM's deprecated spelling
    assert (args.runner, args.convert) == ("pooling", "classify")


def test_qwen2_classifier_matches_transformers(tiny_llama, tmp_path):
    """Qwen2's q/k/v biases and tied embeddings under a 2-label head."""
    path = make_classifier(str(tmp_path), "qwen2", 2, tiny_llama, seed=2)
    prompts = _id_prompts(1)
    want = _hf_logits(path, [{"input_ids": p} for p in prompts])
    outs = _llm(path, convert="classify").classify(
        [{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for out, z in zip(outs, want):
        np.testing.assert_allclose(out.outputs.probs, np.exp(z) / np.exp(z).sum(), atol=ATOL)


# --- scoring ---------------------------------------------------------------------------------

def test_cross_encoder_classify_and_score_match_transformers(ce_llm, cross_encoder):
    assert ce_llm.llm_engine.supported_tasks == ("classify", "score")
    ids, want = _hf_pairs(cross_encoder, QUERY, DOCS)
    one_to_n = ce_llm.score(QUERY, DOCS, use_tqdm=False)
    assert [o.prompt_token_ids for o in one_to_n] == ids
    np.testing.assert_allclose([o.outputs.score for o in one_to_n], want, atol=ATOL)
    # N:N pairs each text_1 with its text_2; a list of one is 1:N.
    pairwise = ce_llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    _, want_b = _hf_pairs(cross_encoder, DOCS[0], [DOCS[2]])
    np.testing.assert_allclose([o.outputs.score for o in pairwise], [want[1], want_b[0]],
                               atol=ATOL)
    raw = ce_llm.score(QUERY, DOCS[:1], use_tqdm=False,
                       pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose(raw[0].outputs.score, np.log(want[0] / (1 - want[0])),
                               atol=1e-4)
    listed = ce_llm.score([QUERY], DOCS[:2], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in listed], want[:2], atol=ATOL)
    # classify on the pair's tokens is the same sigmoid.
    cls = ce_llm.classify({"prompt_token_ids": ids[0]}, use_tqdm=False)
    np.testing.assert_allclose(cls[0].outputs.probs, want[:1], atol=ATOL)
    for bad in (([QUERY, QUERY], DOCS), ([], DOCS), (QUERY, [])):
        with pytest.raises(ValueError, match="text_"):
            ce_llm.score(*bad, use_tqdm=False)


def test_embedding_model_scores_cosine(tiny_llama):
    import torch
    from transformers import AutoModel, AutoTokenizer

    llm = _llm(tiny_llama, runner="pooling")
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def last(text):
        with torch.no_grad():
            return model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1].numpy()

    q = last(QUERY)
    want = [q @ last(d) / np.linalg.norm(q) / np.linalg.norm(last(d)) for d in DOCS]
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in outs], want, atol=ATOL)
    assert outs[1].prompt_token_ids == tok.encode(QUERY) + [tok.pad_token_id] + \
        tok.encode(DOCS[1])
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        llm.classify("hello", use_tqdm=False)


# --- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ce_server(cross_encoder):
    from server_process import ENGINE_FLAGS, ServerProcess
    srv = ServerProcess(cross_encoder, *ENGINE_FLAGS, "--block-size", "4",
                        "--served-model-name", "ce")
    yield srv
    srv.stop()


def test_score_and_rerank_endpoints_match_offline(ce_server, ce_llm, cross_encoder):
    import httpx

    offline = [o.outputs.score for o in ce_llm.score(QUERY, DOCS, use_tqdm=False)]
    ids, want = _hf_pairs(cross_encoder, QUERY, DOCS)
    tokens = sum(len(i) for i in ids)
    for route in ("/score", "/v1/score"):
        r = httpx.post(ce_server.url + route, json={"model": "ce", "text_1": QUERY,
                                                      "text_2": DOCS}).json()
        assert r["object"] == "list" and r["model"] == "ce" and r["id"].startswith("score-")
        assert [d["index"] for d in r["data"]] == list(range(len(DOCS)))
        assert all(d["object"] == "score" for d in r["data"])
        np.testing.assert_allclose([d["score"] for d in r["data"]], offline, atol=1e-6)
        np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=ATOL)
        assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] == tokens
    order = np.argsort(-np.asarray(offline), kind="stable")
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(ce_server.url + route, json={"query": QUERY, "documents": DOCS,
                                                      "top_n": 3}).json()
        assert r["id"].startswith("rerank-") and r["usage"]["total_tokens"] == tokens
        assert [x["index"] for x in r["results"]] == order[:3].tolist()
        assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in order[:3]]
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                                   np.asarray(offline)[order[:3]], atol=1e-6)
    everything = httpx.post(ce_server.url + "/rerank",
                            json={"query": QUERY, "documents": DOCS}).json()
    assert len(everything["results"]) == len(DOCS)


def test_classify_endpoint_matches_offline(ce_server, ce_llm):
    import httpx

    texts = ["hello world", DOCS[0]]
    offline = ce_llm.classify(texts, use_tqdm=False)
    r = httpx.post(ce_server.url + "/classify", json={"input": texts}).json()
    assert r["object"] == "list" and r["id"].startswith("classify-")
    for d, o in zip(r["data"], offline):
        assert d["num_classes"] == 1 and d["label"] == "L0"
        np.testing.assert_allclose(d["probs"], o.outputs.probs, atol=1e-6)
    assert r["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
    raw = httpx.post(ce_server.url + "/classify",
                     json={"input": texts[0], "use_activation": False}).json()
    p = offline[0].outputs.probs[0]
    np.testing.assert_allclose(raw["data"][0]["probs"], [np.log(p / (1 - p))], atol=1e-4)


@pytest.mark.parametrize("route, body, param", [
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": "x", "truncate_prompt_tokens": 3},
     "truncate_prompt_tokens"),
    ("/score", {"text_2": "x"}, "text_1"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["x" * 10**5]}, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/classify", {"input": ""}, "input"),
    ("/classify", {"input": [10**9]}, "input"),
])
def test_scoring_refusals(ce_server, route, body, param):
    import httpx
    r = httpx.post(ce_server.url + route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.slow  # a second server: the offline cosine test covers the math
def test_score_endpoint_on_an_embedding_model(tiny_llama):
    import httpx

    from server_process import ENGINE_FLAGS, ServerProcess

    offline = [o.outputs.score for o in _llm(tiny_llama, runner="pooling")
               .score(QUERY, DOCS, use_tqdm=False)]
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--runner", "pooling", "--block-size", "4")
    try:
        r = httpx.post(srv.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in r["data"]], offline, atol=1e-6)
        rr = httpx.post(srv.url + "/rerank", json={"query": QUERY, "documents": DOCS}).json()
        assert [x["index"] for x in rr["results"]] == \
            np.argsort(-np.asarray(offline), kind="stable").tolist()
        c = httpx.post(srv.url + "/classify", json={"input": "hi"})
        assert c.status_code == 400 and "Classification API" in c.json()["error"]["message"]
    finally:
        srv.stop()


@pytest.mark.parametrize("route, body, message", [
    ("/classify", {"input": "hi"}, "The model does not support Classification API"),
    ("/score", {"text_1": "a", "text_2": "b"}, "The model does not support Score API"),
    ("/v1/rerank", {"query": "a", "documents": ["b"]},
     "The model does not support Rerank (Score) API"),
])
def test_generate_model_answers_vllms_error(route, body, message, monkeypatch):
    """A generate model (or a classifier with several labels, for /score) answers vLLM's
    400; the app is built on a stand-in engine (no model needed)."""
    from starlette.testclient import TestClient

    from serving.api_server import build_app
    from serving.cli.serve import parse_args

    monkeypatch.delenv("JAXLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    state = SimpleNamespace(served_model_names=["m"], model_path="/m", max_model_len=8,
                            engine=SimpleNamespace(supported_tasks=("generate",),
                                                   classifier=None))
    r = TestClient(build_app(state, parse_args([]))).post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == message
