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


# Qwen3-Next's MoE mix: routed experts with a gated shared expert in layers 0, 1 and 3, layer 2
# (linear attention) dense.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[2])


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="dense"),
    pytest.param(MOE, id="moe-mix", marks=pytest.mark.slow),  # its own compiles (~25 s)
    # Qwen3.5's text model: the same layers, in_proj split into q/k/v, z, b and a tensors
    pytest.param(dict(arch="Qwen3_5ForCausalLM"), id="qwen3_5", marks=pytest.mark.slow),
])
def test_ragged_prefill_and_decode_match_transformers(qwen3_next, load, kw):
    """Prompt lengths across the 64-token chunk boundary, a length-1 prompt, two chunks."""
    path = qwen3_next(**kw)
    model, cfg, _ = load(path)
    assert cfg.linear_layers == (True, False, True, True)
    assert [g.kind for g in model.groups] == (
        ["gdn_moe", "gated_attn_moe", "gdn", "gdn_moe"] if "num_experts" in kw
        else ["gdn", "gated_attn", "gdn"])
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


# --- through the engine ---------------------------------------------------------------------

@pytest.fixture
def _fail_on_recompile(monkeypatch):
    """The step programs warm-up compiled serve every step (state_slots included)."""
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


def _engine_prompts():
    from test_engine import mixed_prompts
    # 10 prompts, one of 150 tokens: with a 16-token step budget every prompt but the
    # shortest is split over steps (chunked prefill, at points set by what else runs) beside
    # the other sequence's decoding row.
    return mixed_prompts(9, seed=5, hi=70) + [mixed_prompts(1, seed=6, lo=150, hi=151)[0]]


@pytest.fixture(scope="module")
def engine_case(qwen3_next):
    from test_engine import NEW, hf_greedy
    path = qwen3_next()
    prompts = _engine_prompts()
    return path, prompts, hf_greedy(path, prompts, NEW)


def _llm(path, **kw):
    """Few programs (token bucket 16, decode buckets 1 and 2): compiles dominate the cost."""
    from test_engine import small_llm
    return small_llm(path, **{"max_num_seqs": 2, "max_num_batched_tokens": 16,
                              "max_model_len": 256, **kw})


def test_engine_continuous_batching_equals_transformers_and_one_by_one(engine_case, caplog,
                                                                       _fail_on_recompile):
    """Sequences join and leave 2 state slots (reused), prompts split by chunked prefill with
    decodes in the same steps: transformers' greedy tokens; one request at a time the same.
    Prefix caching is off for the model, with a start-up message saying why."""
    from test_engine import GREEDY, token_ids
    path, prompts, expected = engine_case
    with caplog.at_level("WARNING", logger="jaxllm"):
        llm = _llm(path)
    assert "Prefix caching is disabled for Qwen3NextForCausalLM" in caplog.text
    eng = llm.llm_engine
    assert not eng.kv_cache_manager.enable_prefix_caching
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == expected
    assert eng.kv_cache_manager.state_slots.num_free == 2  # every slot given back
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in (prompts[-1], prompts[0])]
    assert singles == [expected[-1], expected[0]]


@pytest.mark.slow  # its own engine and programs (~90 s on a busy machine)
def test_engine_preemption_recomputes_the_state(engine_case, _fail_on_recompile):
    """Too few KV blocks for 4 running sequences: preempted sequences give their state slot
    back and are recomputed from their first token; still transformers' tokens."""
    from test_engine import GREEDY, token_ids
    path, prompts, expected = engine_case
    llm = _llm(path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=168,
               num_gpu_blocks_override=48)  # the 150-token prompt alone needs 41 blocks
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert batch == expected


@pytest.mark.parametrize("kw,flag", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "prompt_lookup_max": 3}), "--speculative-config"),
    (dict(kv_offloading_size=0.01), "--kv-offloading-size"),
    (dict(enable_lora=True), "Qwen3NextForCausalLM: LoRA adapters are not supported"),
    (dict(runner="pooling"), "--runner pooling: Qwen3NextForCausalLM"),
])
def test_unbuilt_features_are_refused_by_name(qwen3_next, kw, flag):
    from jaxllm.config import ConfigError
    with pytest.raises(ConfigError, match=flag):
        _llm(qwen3_next(), **kw)


def test_pipeline_parallel_is_refused_by_name(qwen3_next):
    """(On the start-up rule itself: one CPU device cannot make a two-stage engine.)"""
    import dataclasses

    from jaxllm.config import ConfigError, EngineArgs
    from jaxllm.engine.hybrid import hybrid_engine_config
    from jaxllm.models.model_config import ModelConfig
    from transformers import AutoConfig

    path = qwen3_next()
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    config = EngineArgs(model=path).create_engine_config()
    pp = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="--pipeline-parallel-size=2: Qwen3NextForCausalLM"):
        hybrid_engine_config(pp, mc)
    assert hybrid_engine_config(config, mc).cache.enable_prefix_caching is False


@pytest.mark.slow  # two more engines (~60 s)
@pytest.mark.parametrize("kw", [dict(num_scheduler_steps=4), dict(async_scheduling=True)],
                         ids=["multi-step", "async"])
def test_engine_step_policies_keep_the_state(engine_case, kw, _fail_on_recompile):
    """Bursts of decode steps in one program, and steps taking their input tokens from the
    device: the state slots ride along; transformers' tokens."""
    from test_engine import GREEDY, token_ids
    path, prompts, expected = engine_case
    llm = _llm(path, **kw)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts[:5]], GREEDY,
                                   use_tqdm=False))
    assert batch == expected[:5]
