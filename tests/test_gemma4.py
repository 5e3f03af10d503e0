"""Gemma 4 text (Gemma4ForCausalLM) against transformers 5.24.

Parity as tests/test_models.py: float32, prompts of 5, 17, 30 and 2 tokens prefilled in one
ragged batch through the paged cache (block size 4), then 32 greedy decode steps together;
every step's logits within ATOL = 1e-4 of transformers (eager attention) and the 32 tokens
identical. The tiny config (tests/gemma4_checkpoints.py) has sliding layers (window 8, which
the prompts and decode cross) and full ones of another head dim and KV-head count, K = V,
per-layer inputs and layer scalars.
"""

import json

import numpy as np
import pytest

from gemma4_checkpoints import TEXT, build
from test_models import _prompts, assert_greedy_matches_transformers

PROMPT_LENS = (5, 17, 30, 2)
SHARED = dict(num_kv_shared_layers=2, use_double_wide_mlp=True)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)


@pytest.fixture(scope="session")
def make_gemma4(make_tiny_checkpoint, tmp_path_factory):
    """make_gemma4(**text config overrides) -> a float32 checkpoint folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    cache = {}

    def make(**kw) -> str:
        key = json.dumps(kw, sort_keys=True)
        if key not in cache:
            cache[key] = build(str(tmp_path_factory.mktemp("tiny_gemma4")), tok, **kw)
        return cache[key]

    return make


@pytest.mark.slow  # test_gemma4_moe_matches_transformers runs these layers too, by default
def test_gemma4_matches_transformers(make_gemma4, load, greedy):
    from jaxllm.models.decoder import layer_groups

    path = make_gemma4()
    model, cfg, _ = load(path)
    assert [g.kind for g in layer_groups(cfg)] == ["gemma4_sliding", "gemma4_full"] * 2
    assert cfg.sliding_window == (8, 8, 0) * 2 and cfg.head_dim == 16
    assert cfg.gemma4.global_head_dim == 32 and cfg.gemma4.global_kv_heads == 1
    assert [r.rope_type for r in cfg.rope[:3]] == ["default", "default", "proportional"]
    # the full layers' cache: 1 KV head of 32; the sliding layers': 2 of 16
    shapes = model.kv_cache_shapes(10, 4)
    assert shapes[0] == (2, 10, 2, 4, 16) and shapes[1] == (1, 10, 1, 4, 32)
    assert_greedy_matches_transformers(path, model, _prompts(PROMPT_LENS), greedy)


def test_gemma4_refusals():
    from transformers import Gemma4TextConfig

    from jaxllm.config import ConfigError
    from jaxllm.engine_config import ModelOptions
    from jaxllm.models.decoder import abstract_decoder, layer_groups
    from jaxllm.models.model_config import ModelConfig

    for kw, name in [(dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
                     (dict(attention_bias=True), "attention_bias"),
                     (dict(num_kv_shared_layers=4), "num_kv_shared_layers"),
                     (dict(vocab_size_per_layer_input=256), "vocab_size_per_layer_input")]:
        c = Gemma4TextConfig(**dict(TEXT, **kw))
        c.architectures = ["Gemma4ForCausalLM"]
        with pytest.raises(ConfigError, match=name):
            ModelConfig.from_hf(c)
    # --disable-sliding-window: every layer attends fully, each keeps its type's geometry
    c = Gemma4TextConfig(**TEXT)
    c.architectures = ["Gemma4ForCausalLM"]
    cfg = ModelConfig.from_hf(c, ModelOptions(disable_sliding_window=True))
    assert cfg.sliding_window == (0,) * 6 and cfg.max_model_len == 8
    assert [g.kind for g in layer_groups(cfg)] == ["gemma4_sliding", "gemma4_full"] * 2
    assert cfg.kv_values_all_layers == 4 * 2 * 2 * 16 + 2 * 2 * 1 * 32
    # the MoE variant's experts are not built for expert parallelism
    c = Gemma4TextConfig(**dict(TEXT, **MOE))
    c.architectures = ["Gemma4ForCausalLM"]
    cfg = ModelConfig.from_hf(c, ModelOptions(enable_expert_parallel=True))
    with pytest.raises(ConfigError, match="--enable-expert-parallel"):
        abstract_decoder(cfg)


def test_gemma4_moe_matches_transformers(make_gemma4, load, greedy):
    """Every mechanism at once (the default suite's Gemma 4 parity test): enable_moe_block
    (every layer's experts, 4, top 2, beside its dense MLP) with KV sharing (the last two
    layers read the caches of layers 3 and 2 and have double-wide MLPs)."""
    path = make_gemma4(**SHARED, **MOE)
    model, cfg, _ = load(path)
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.gemma4.kv_producer == (-1, -1, -1, -1, 3, 2)
    assert [s[0] for s in model.kv_cache_shapes(10, 4)] == [2, 1, 1, 0, 0]
    assert_greedy_matches_transformers(path, model, _prompts(PROMPT_LENS), greedy)


@pytest.mark.slow  # as test_gemma4_moe_matches_transformers, without the experts
def test_gemma4_kv_sharing_matches_transformers(make_gemma4, load, greedy):
    """num_kv_shared_layers=2: layers 4 (sliding) and 5 (full) read the caches of layers 3 and
    2, own no cache (no KV values per token counted for them), and have double-wide MLPs."""
    from jaxllm.models.decoder import layer_groups

    path = make_gemma4(**SHARED)
    model, cfg, _ = load(path)
    assert cfg.gemma4.kv_producer == (-1, -1, -1, -1, 3, 2)
    assert [g.kind for g in layer_groups(cfg)] == [
        "gemma4_sliding", "gemma4_full", "gemma4_sliding", "gemma4_sliding_shared",
        "gemma4_full_shared"]
    shapes = model.kv_cache_shapes(10, 4)
    assert [s[0] for s in shapes] == [2, 1, 1, 0, 0]  # the shared groups: no layers
    assert cfg.num_kv_layers == 4
    # 3 sliding layers x K and V x 2 heads x 16, 1 full layer x 2 x 1 head x 32
    assert cfg.kv_values_all_layers == 3 * 2 * 2 * 16 + 2 * 32
    assert model.layers[3].cfg.intermediate_size == 2 * cfg.intermediate_size
    assert_greedy_matches_transformers(path, model, _prompts(PROMPT_LENS), greedy)


@pytest.mark.slow  # a second checkpoint and model: ~20 s
def test_gemma4_multimodal_checkpoint_text_only(make_gemma4, load, greedy, tiny_llama):
    """A Gemma4ForConditionalGeneration checkpoint (vision and audio towers) loads its
    language model, the towers skipped, with the logits of transformers' model on text;
    a prompt with images is refused."""
    import torch
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

    from jaxllm.engine.input_processor import InputProcessor

    import glob

    from safetensors import safe_open

    path = make_gemma4(multimodal=True)
    names = [n for f in glob.glob(f"{path}/*.safetensors")
             for n in safe_open(f, "np").keys()]
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert any(n.startswith("model.audio_tower.") for n in names)
    model, cfg, _ = load(path)
    assert cfg.architecture == "Gemma4ForConditionalGeneration" and cfg.vision is None
    prompts = _prompts((9, 20))
    prefill, _, _ = greedy(model, prompts, 1, block_size=4)
    hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    for ours, prompt in zip(prefill, prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
    inputs = InputProcessor(AutoTokenizer.from_pretrained(tiny_llama), cfg, max_logprobs=0,
                            eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="multi_modal_data"):
        inputs.process_prompt({"prompt_token_ids": [5, 6],
                               "multi_modal_data": {"image": object()}})


@pytest.mark.slow  # ~60 s: the engine's programs
def test_gemma4_engine_equals_transformers_and_one_by_one(make_gemma4, monkeypatch):
    """Through the engine, KV sharing on: continuous batching with chunked prefill (16-token
    steps), prefix caching and preemption (48 blocks of 4 tokens for 13 prompts of up to
    88 + 12 tokens) give transformers' greedy tokens, and the same tokens as one request at a
    time. The budget buys exactly 48 blocks because the KV-shared layers own no cache."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids

    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")
    path = make_gemma4(**SHARED)
    prompts = mixed_prompts(10, seed=5, hi=48)
    prompts += [prompts[0] + p for p in mixed_prompts(3, seed=6)]  # shared prefixes
    expected = hf_greedy(path, prompts, NEW)
    # per token: 3 sliding layers x K and V x 2 heads x 16 + 1 full layer x 2 x 1 x 32, f32
    per_token = (3 * 2 * 2 * 16 + 2 * 32) * 4
    llm = small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=True,
                    max_model_len=128, kv_cache_memory_bytes=48 * 4 * per_token)
    assert llm.llm_engine.kv_cache_manager.num_blocks == 48
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == expected
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in prompts[:2]]
    assert singles == expected[:2]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.slow  # two engines
def test_gemma4_spec_decode_and_kv_offload(make_gemma4):
    """KV sharing with the engine's other cache users: n-gram speculative decoding (verify
    steps of several tokens a sequence) gives transformers' greedy tokens, and a prompt's
    blocks saved to host memory and loaded back (every group's cache, the KV-shared groups'
    empty ones too) give its first run's tokens and logprobs."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids
    from test_kv_offload import ENGINE, _host_round_trip
    from test_spec_engine import NGRAM

    from jaxllm import LLM

    path = make_gemma4(**SHARED, **MOE)
    prompts = mixed_prompts(4, seed=7, hi=30)
    prompts = [p + p[:6] for p in prompts]  # repeats for the n-gram lookup to draft from
    llm = small_llm(path, speculative_config=NGRAM, max_model_len=128)
    assert token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                  use_tqdm=False)) == hf_greedy(path, prompts, NEW)
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0
    _host_round_trip(LLM(path, **ENGINE))


@pytest.mark.slow  # the XLA reference and the Pallas GPU kernel (interpreted) are slow on CPU
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_gemma4_other_backends(backend, make_gemma4, load, greedy):
    """The other attention backends with KV sharing and MoE on: the shared layers' no-op
    rewrite of their producer's K/V and the two head dims go through each backend's
    attention."""
    path = make_gemma4(**SHARED, **MOE)
    model, _, _ = load(path, attention_backend=backend)
    assert model.backend.name == backend
    assert_greedy_matches_transformers(path, model, _prompts(PROMPT_LENS), greedy)


@pytest.mark.slow  # two step programs exported
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_gemma4_step_exports(platform):
    """The whole step of a Gemma 4 model (KV sharing and MoE on) exports for TPU and CUDA on
    a 2-way mesh (test_export's step): only the platform's attention kernel, no CPU-only
    call (the full layers' single KV head, replicated, attends under shard_map too), and
    both head dims' caches in the program."""
    import re

    from transformers import Gemma4TextConfig

    from jaxllm.config import EngineArgs
    from jaxllm.models.model_config import ModelConfig
    from test_export import CPU_ONLY, KERNEL, exported_step

    hf = Gemma4TextConfig(**dict(TEXT, **SHARED, **MOE, hidden_size=128, head_dim=32,
                                 global_head_dim=64))
    hf.architectures = ["Gemma4ForCausalLM"]
    cfg = ModelConfig.from_hf(hf, EngineArgs(model="tiny", dtype="bfloat16")
                              .create_engine_config().model)
    text = exported_step(platform, 2, cfg).mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    assert not [name for name in CPU_ONLY if name in text]
    # each layer type's cache pages (2 KV heads of 32, 1 of 64; blocks of 16), and the KV-shared
    # groups' caches without layers
    assert "x2x16x32xbf16>" in text and "x1x16x64xbf16>" in text
    assert re.search(r"tensor<0x\d+x2x16x32xbf16>", text)
    assert re.search(r"tensor<0x\d+x1x16x64xbf16>", text)


@pytest.mark.slow  # a bf16 program and two transformers models
def test_gemma4_bfloat16_error_is_transformers_bfloat16_error(make_gemma4, load, greedy):
    """bfloat16 strays from float32 transformers no more than transformers' own bfloat16
    model does (KV sharing and MoE on)."""
    from test_models import ATOL, bf16_and_transformers_errors

    path = make_gemma4(**SHARED, **MOE)
    model, cfg, _ = load(path, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    prompts = _prompts((9, 20))
    prefill, _, _ = greedy(model, prompts, 1)
    for err, their_err in bf16_and_transformers_errors(path, prefill, prompts):
        assert their_err.max() > ATOL and err.max() <= 1.5 * their_err.max() + 0.02


@pytest.mark.slow  # a subprocess on 2 virtual devices, 2 loads
def test_gemma4_tensor_parallel_matches_one_device(make_gemma4):
    """tp=2 (sliding layers' 2 KV heads split, the FFNs and experts' FFNs split; KV sharing
    and MoE on) gives one device's greedy tokens and logits within 5e-4 (every layer adds its
    dense MLP's, experts' and attention's partial sums over the devices in another order,
    through more norms than the dense models of the other TP tests; logits up to the soft
    cap, 30)."""
    from conftest import run_with_host_devices

    proc = run_with_host_devices(2, [__file__, make_gemma4(**SHARED, **MOE)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    base, tp2 = runs["tp1"], runs["tp2"]
    assert not base["sharded"] and any("experts_gate_up" in p for p in tp2["sharded"])
    for key in ("prefill", "steps"):
        np.testing.assert_allclose(np.array(tp2[key]), np.array(base[key]), atol=5e-4, rtol=0,
                                   err_msg=key)
    assert tp2["tokens"] == base["tokens"]


if __name__ == "__main__":  # the TP child of run_with_host_devices
    import sys

    from conftest import tp_greedy_report
    print(json.dumps(tp_greedy_report(sys.argv[1])))
