"""Qwen3-Next (gated DeltaNet linear attention beside gated full attention, per-sequence state
slots) against transformers 5: float32 tiny random configs, `layer_types` mixing both kinds.

Model level (tests/qwen3_next_checkpoints.py's StateRunner): prompts prefilled in one ragged
batch, then 32 greedy decode steps together; every step's logits within ATOL of transformers
and the tokens identical (ATOL: see its comment)."""

import numpy as np
import pytest
import torch

from qwen3_next_checkpoints import StateRunner, make_qwen3_next

# The chunked delta rule's triangular solves amplify float32 rounding: on these weights
# transformers' own float32 logits stray up to ~3e-4 from its float64 ones, and ours as far.
ATOL = 1e-3
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def qwen3_next(make_tiny_checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    cache = {}
    return lambda **kw: make_qwen3_next(tmp_path_factory, tok, cache, **kw)


def _prompts(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in lens]


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _hf_greedy(hf, prompt, n):
    """transformers' prefill logits, then n greedy steps with its cache: (prefill, steps,
    tokens)."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        prefill, cache = out.logits[0].numpy(), out.past_key_values
        steps, tokens = [], []
        tok = int(prefill[-1].argmax())
        for _ in range(n):
            tokens.append(tok)
            out = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1].numpy())
            tok = int(steps[-1].argmax())
    return prefill, np.stack(steps), tokens


def test_ragged_prefill_and_decode_match_transformers(qwen3_next, load):
    """Prompt lengths across the 64-token chunk boundary, a length-1 prompt, two chunks."""
    path = qwen3_next()
    model, cfg, _ = load(path)
    assert cfg.linear_layers == (True, False, True, True)
    prompts = _prompts((5, 1, 64, 130, 17))
    runner = StateRunner(model, 4, len(prompts), 200, 256)
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
    hf = _hf(path)
    for i, prompt in enumerate(prompts):
        want_prefill, want_steps, want_tokens = _hf_greedy(hf, prompt, NEW_TOKENS)
        np.testing.assert_allclose(prefill[i], want_prefill, atol=ATOL, rtol=0,
                                   err_msg=f"prefill of prompt {i}")
        np.testing.assert_allclose(np.stack(steps[i]), want_steps, atol=ATOL, rtol=0,
                                   err_msg=f"decode steps of prompt {i}")
        assert tokens[i] == want_tokens, f"greedy tokens of prompt {i}"
