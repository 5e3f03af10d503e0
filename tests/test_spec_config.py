"""`--speculative-config` parsing (jaxllm/spec_decode/config.py): every accepted field, vLLM's
method inference and n-gram defaults, and a ValueError naming each refused field."""

import json

import pytest

from jaxllm.spec_decode.config import SpeculativeConfig

parse = SpeculativeConfig.parse


def test_ngram_fields_and_json():
    c = parse(json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                          "prompt_lookup_max": 3, "prompt_lookup_min": 2,
                          "disable_by_batch_size": 8, "max_model_len": 1024}))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min,
            c.disable_by_batch_size, c.max_model_len, c.model) == ("ngram", 4, 3, 2, 8, 1024, None)


@pytest.mark.parametrize("given,lo,hi", [({}, 5, 5), ({"prompt_lookup_min": 2}, 2, 2),
                                         ({"prompt_lookup_max": 3}, 3, 3)])
def test_ngram_window_defaults_as_vllm(given, lo, hi):
    c = parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (lo, hi)


def test_method_inferred_from_model():
    assert parse({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    assert parse({"model": "[ngram]", "num_speculative_tokens": 2}).model is None
    c = parse({"model": "/models/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model) == ("draft_model", "/models/draft")
    assert parse({"method": "draft_model", "model": "d", "num_speculative_tokens": 1}).model == "d"


@pytest.mark.parametrize("value", [None, {}, "{}"])
def test_absent_or_empty_means_off(value):
    assert parse(value) is None


@pytest.mark.parametrize("value,word", [
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "'bogus'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "enforce_eager": True}, "'enforce_eager'"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "'draft_tensor_parallel_size'"),
    ({"model": "d", "num_speculative_tokens": 2, "quantization": "fp8"}, "'quantization'"),
    ({"model": "d", "num_speculative_tokens": 2, "revision": "main"}, "'revision'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "[]"},
     "'speculative_token_tree'"),
    ({"method": "eagle", "model": "d", "num_speculative_tokens": 2}, "'eagle'"),
    ({"method": "magic", "num_speculative_tokens": 2}, "'method'"),
    ({"method": "ngram"}, "'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": True}, "'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "'prompt_lookup_min'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "'prompt_lookup_min'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
     "'disable_by_batch_size'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'model'"),
    ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "'prompt_lookup_max'"),
    ({"num_speculative_tokens": 2}, "'method'"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
])
def test_refused_with_the_field_named(value, word):
    with pytest.raises(ValueError, match=word.replace("[", r"\[")):
        parse(value)
