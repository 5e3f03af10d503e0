"""LM-head rerankers (issue 51): a causal LM that ranks by two tokens' logits, as the official
Qwen3-Reranker does, served with vLLM's recipe --hf-overrides '{"architectures":
["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}' (jaxllm/loader/classifier_head.py `_token_head`).

The oracle is the model card's own computation on transformers' Qwen3ForCausalLM: the softmax
of the two tokens' logits at the pair's last position, taken for the second token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxllm import LLM
from jaxllm.config import ConfigError

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "france is in europe",
        "capital letters"]


@pytest.fixture(scope="module")
def reranker(make_tiny_checkpoint):
    return make_tiny_checkpoint("qwen3", seed=3)


@pytest.fixture(scope="module")
def tokens(reranker):
    """Two tokens of the tiny tokenizer standing in for Qwen3-Reranker's "no" and "yes"."""
    from transformers import AutoTokenizer
    vocab = sorted(AutoTokenizer.from_pretrained(reranker).get_vocab())
    return [vocab[40], vocab[41]]


def overrides(tokens, **extra) -> dict:
    return {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": tokens, "is_original_qwen3_reranker": True, **extra}


def hf_relevance(path: str, tokens: list[str], query: str, docs: list[str]) -> np.ndarray:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    no, yes = tok.convert_tokens_to_ids(tokens)
    out = []
    for d in docs:
        with torch.no_grad():
            logits = model(torch.tensor([tok(query, d)["input_ids"]])).logits[0, -1]
        out.append(torch.softmax(logits[[no, yes]], -1)[1].item())
    return np.array(out)


def test_scores_equal_the_two_token_softmax(reranker, tokens):
    want = hf_relevance(reranker, tokens, QUERY, DOCS)
    assert want.std() > 1e-3  # the documents score differently: the comparison can fail
    # --runner auto takes the overridden architecture: a classifier, so the pooling runner.
    llm = LLM(reranker, hf_overrides=overrides(tokens), dtype="float32", max_model_len=64,
              block_size=4)
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert llm.llm_engine.supported_tasks == ("classify", "score")


@pytest.mark.parametrize("extra, match", [
    ({"classifier_from_token": ["a"]}, "two tokens"),
    ({"method": "no_post_processing"}, "method"),
    ({"classifier_from_token": ["not-a-token-here", "alsonot"]}, "not tokens"),
])
def test_refusals_name_the_override(reranker, tokens, extra, match):
    with pytest.raises(ConfigError, match=match):
        LLM(reranker, runner="pooling", hf_overrides=overrides(tokens, **extra),
            dtype="float32", max_model_len=64)
