"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`: Qwen3.5's gated DeltaNet and gated attention layers,
every MLP routed experts plus a gated shared expert) against transformers 5: a float32 tiny
random config, ragged prefill then 32 greedy steps, logits within test_qwen3_next's ATOL and the
tokens identical."""

import numpy as np
import pytest

from qwen3_next_checkpoints import StateRunner, make_qwen3_next
from test_qwen3_next import ATOL, NEW_TOKENS, _hf, _hf_greedy, _prompts

MOE = dict(arch="Qwen3_5MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=24)


@pytest.fixture(scope="module")
def checkpoint(make_tiny_checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    return make_qwen3_next(tmp_path_factory, tok, {}, **MOE)


@pytest.mark.slow  # load, compiles and transformers' 32 steps (~50 s)
def test_ragged_prefill_and_decode_match_transformers(checkpoint, load):
    """Prompt lengths across the 64-token chunk boundary and a length-1 prompt."""
    model, cfg, _ = load(checkpoint)
    assert cfg.linear_layers == (True, False, True, True)
    assert cfg.moe_layers == (True,) * 4 and cfg.norm_topk_prob
    assert [(g.kind, g.count) for g in model.groups] == [
        ("gdn_moe", 1), ("gated_attn_moe", 1), ("gdn_moe", 2)]
    prompts = _prompts((5, 1, 70, 17), seed=1)
    runner = StateRunner(model, 4, len(prompts), 128, 128)
    seqs = list(range(len(prompts)))
    prefill = runner.step(seqs, prompts)
    last = [int(p[-1].argmax()) for p in prefill]
    steps, tokens = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        for i, t in enumerate(last):
            tokens[i].append(t)
        out = runner.step(seqs, [[t] for t in last])
        for i, o in enumerate(out):
            steps[i].append(o[0])
        last = [int(o[0].argmax()) for o in out]
    hf = _hf(checkpoint)
    for i, prompt in enumerate(prompts):
        want_prefill, want_steps, want_tokens = _hf_greedy(hf, prompt, NEW_TOKENS)
        np.testing.assert_allclose(prefill[i], want_prefill, atol=ATOL, rtol=0,
                                   err_msg=f"prefill of prompt {i}")
        np.testing.assert_allclose(np.stack(steps[i]), want_steps, atol=ATOL, rtol=0,
                                   err_msg=f"decode steps of prompt {i}")
        assert tokens[i] == want_tokens, f"greedy tokens of prompt {i}"
