"""Llama 4 text (Llama4ForCausalLM, and the text part of Llama4ForConditionalGeneration)
against transformers.

Parity as tests/test_models.py: float32, prompts of 5, 17, 30 and 2 tokens prefilled in one
ragged batch through the paged cache (block size 4), then 32 greedy decode steps together;
every step's logits within ATOL = 1e-4 of transformers and the 32 tokens identical. The tiny
config has every Llama 4 mechanism inside one scan: 4 layers, two dense (intermediate_size_mlp)
then two MoE (4 experts, top-1 sigmoid routing that scales the expert's input, a shared expert),
each pair one RoPE layer (chunked attention over chunks of 8 positions, so prompts and decode
cross several chunk boundaries; q/k L2 norm) and one NoPE layer (full attention, temperature
tuning with floor_scale 4 so the scale changes every 4 positions).
"""

import json

import numpy as np
import pytest
import torch

from jaxllm.config import ConfigError
from test_models import _prompts, assert_greedy_matches_transformers

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=1, moe_layers=[2, 3],
            no_rope_layers=[1, 0, 1, 0], attention_chunk_size=8, floor_scale=4,
            attn_scale=0.5, attn_temperature_tuning=True, use_qk_norm=True,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
PROMPT_LENS = (5, 17, 30, 2)


@pytest.fixture(scope="session")
def make_llama4(make_tiny_checkpoint, tmp_path_factory):
    """make_llama4(multimodal=False, **text config) -> a float32 checkpoint folder (weights as
    conftest's `_randomize`) with the tests' tokenizer; multimodal: a
    Llama4ForConditionalGeneration checkpoint with a tiny vision model."""
    import transformers as tr
    from conftest import _randomize
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    cache = {}

    def make(multimodal=False, **kw) -> str:
        key = json.dumps([multimodal, kw], sort_keys=True)
        if key in cache:
            return cache[key]
        ids = dict(bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id)
        text = tr.Llama4TextConfig(**kw, **ids)
        torch.manual_seed(0)
        if multimodal:
            vision = tr.Llama4VisionConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, vision_output_dim=32, image_size=28, patch_size=14,
                projector_input_dim=32, projector_output_dim=32)
            cfg = tr.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                  **ids)
            cfg.architectures = ["Llama4ForConditionalGeneration"]
            model = tr.Llama4ForConditionalGeneration(cfg)
        else:
            text.architectures = ["Llama4ForCausalLM"]
            model = tr.Llama4ForCausalLM(text)
        _randomize(model, False, seed=len(cache))
        path = str(tmp_path_factory.mktemp("tiny_llama4"))
        model.save_pretrained(path)
        tok.save_pretrained(path)
        cache[key] = path
        return path

    return make


def test_llama4_matches_transformers(make_llama4, load, greedy):
    from jaxllm.models.decoder import layer_groups

    path = make_llama4(**TEXT)
    model, cfg, _ = load(path)
    assert [g.kind for g in layer_groups(cfg)] == ["dense", "moe"]
    assert cfg.nope_layers == (False, True, False, True)
    assert cfg.attention_chunk == (8, 0, 8, 0)  # the RoPE layers are the chunked ones
    assert cfg.intermediate_size == 96 and cfg.moe_intermediate_size == 32
    assert_greedy_matches_transformers(path, model, _prompts(PROMPT_LENS), greedy)


def _hf_prefill(path, prompts, cls):
    with torch.no_grad():
        hf = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        # (transformers 5.24's Llama4ForConditionalGeneration.forward fails on text alone,
        # reading outputs.image_outputs of its language model's output: its language model
        # runs the text, as that forward would)
        hf = getattr(hf, "language_model", hf)
        return [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]


@pytest.mark.parametrize("kw", [
    pytest.param(dict(attn_temperature_tuning=False, use_qk_norm=False,
                      interleave_moe_layer_step=2, moe_layers=None), id="no-tuning-no-norm"),
    pytest.param(dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16}),
                 id="llama3-rope"),
])
def test_llama4_variants_prefill(kw, make_llama4, load, greedy):
    """Without temperature tuning and q/k norm, MoE layers from interleave_moe_layer_step
    (layers 1 and 3: dense and MoE alternate), and Scout's llama3 RoPE scaling: the ragged
    prefill's logits as transformers'."""
    from transformers import Llama4ForCausalLM

    path = make_llama4(**dict(TEXT, **kw))
    model, cfg, _ = load(path)
    if "moe_layers" in kw:
        assert cfg.moe_layers == (False, True, False, True)
        assert cfg.attn_temperature is None and not cfg.qk_l2_norm
    prompts = _prompts(PROMPT_LENS)
    prefill, _, _ = greedy(model, prompts, 1, block_size=4)
    for ours, want in zip(prefill, _hf_prefill(path, prompts, Llama4ForCausalLM)):
        np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)


def test_llama4_multimodal_checkpoint_text_only(make_llama4, load, greedy):
    """A Llama4ForConditionalGeneration checkpoint loads its language model (the vision model
    and projector skipped), with the logits of transformers' model on text."""
    from transformers import Llama4ForConditionalGeneration

    path = make_llama4(multimodal=True, **TEXT)
    model, cfg, _ = load(path)
    assert cfg.architecture == "Llama4ForConditionalGeneration"
    prompts = _prompts((9, 20))
    prefill, _, _ = greedy(model, prompts, 1, block_size=4)
    for ours, want in zip(prefill, _hf_prefill(path, prompts, Llama4ForConditionalGeneration)):
        np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)


def test_llama4_refusals(make_llama4, load):
    from transformers import Llama4TextConfig

    from jaxllm.models.model_config import ModelConfig

    def config(**kw):
        c = Llama4TextConfig(**dict(TEXT, **kw))
        c.architectures = ["Llama4ForCausalLM"]
        return c

    with pytest.raises(ConfigError, match="num_experts_per_tok=2"):
        ModelConfig.from_hf(config(num_experts_per_tok=2))
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf(config(layer_types=["sliding_attention"] * 4))
    cfg = ModelConfig.from_hf(config(attention_chunk_size=None))
    assert cfg.attention_chunk == (0, 0, 0, 0)  # no chunk size: every layer full attention
    with pytest.raises(ConfigError, match="enable-lora"):
        load(make_llama4(**TEXT), enable_lora=True)


@pytest.mark.slow  # ~60 s: the engine's programs
def test_llama4_engine_equals_transformers_and_one_by_one(make_llama4, monkeypatch):
    """Through the engine: continuous batching with chunked prefill (16-token steps, so a
    prompt's chunks and its attention chunks of 8 fall differently), prefix caching and
    preemption (a cache of 48 blocks of 4 tokens for 13 prompts of up to 88 + 12 tokens) give
    transformers' greedy tokens, and the same tokens as one request at a time."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids

    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")
    path = make_llama4(**TEXT)
    prompts = mixed_prompts(10, seed=5, hi=48)
    prompts += [prompts[0] + p for p in mixed_prompts(3, seed=6)]  # shared prefixes
    expected = hf_greedy(path, prompts, NEW)
    # 48 blocks: 4 layers x 4 tokens x 2 KV heads x 16 values x K and V, float32.
    llm = small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=True,
                    max_model_len=128, kv_cache_memory_bytes=48 * 4 * 4 * 2 * 16 * 2 * 4)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == expected
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in prompts[:2]]
    assert singles == expected[:2]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.slow  # the XLA reference and the Pallas GPU kernel (interpreted) are slow on CPU
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_llama4_other_backends(backend, make_llama4, load, greedy):
    path = make_llama4(**TEXT)
    model, _, _ = load(path, attention_backend=backend)
    assert model.backend.name == backend
    assert_greedy_matches_transformers(path, model, _prompts(PROMPT_LENS), greedy)


@pytest.mark.slow  # a subprocess on 2 virtual devices, 2 loads
def test_llama4_tensor_parallel_matches_one_device(make_llama4):
    """tp=2 (heads, the dense FFNs and every expert's FFN split over `model`) gives one
    device's logits (atol 1e-4) and greedy tokens."""
    from conftest import run_with_host_devices

    proc = run_with_host_devices(2, [__file__, make_llama4(**TEXT)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    base, tp2 = runs["tp1"], runs["tp2"]
    assert not base["sharded"] and any("experts" in p for p in tp2["sharded"])
    for key in ("prefill", "steps"):
        np.testing.assert_allclose(np.array(tp2[key]), np.array(base[key]), atol=1e-4, rtol=0,
                                   err_msg=key)
    assert tp2["tokens"] == base["tokens"]


@pytest.mark.slow  # a subprocess on 2 virtual devices, two engines
def test_llama4_pipeline_stages_match_one_device(make_llama4, monkeypatch):
    """Pipeline parallel 2 with the stages split inside the dense group (layers [0], [1, 3]):
    each stage's NoPE flags and attention chunks are its own layers' (test_pipeline_parallel's
    engine child: chunked prefill, prompts crossing chunks of 8), same tokens as one device."""
    import os

    from conftest import run_with_host_devices

    monkeypatch.setenv("JAXLLM_PP_LAYER_PARTITION", "1,3")
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_pipeline_parallel.py")
    proc = run_with_host_devices(2, [child, make_llama4(**TEXT), "moe"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["layers"] == [1, 3]
    assert report["pp2"] == report["base"] and len(report["base"]) == 3


@pytest.mark.parametrize("platform", [pytest.param("tpu", marks=pytest.mark.slow), "cuda"])
def test_llama4_step_exports_with_chunked_attention(platform):
    """The whole step of a Llama 4 model exports for TPU and CUDA on a 2-way mesh (test_export's
    step): the platform's attention kernel, no CPU-only call, and the per-layer attention
    chunks (8 on the RoPE layer, 0 on the NoPE one of each group) reach the program."""
    import re

    from transformers import Llama4TextConfig

    from jaxllm.config import EngineArgs
    from jaxllm.models.model_config import ModelConfig
    from test_export import CPU_ONLY, KERNEL, exported_step

    hf = Llama4TextConfig(**dict(TEXT, hidden_size=128, head_dim=32))
    hf.architectures = ["Llama4ForCausalLM"]
    cfg = ModelConfig.from_hf(hf, EngineArgs(model="tiny", dtype="bfloat16")
                              .create_engine_config().model)
    text = exported_step(platform, 2, cfg).mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    assert not [name for name in CPU_ONLY if name in text]
    assert "dense<[8, 0]> : tensor<2xi32>" in text


@pytest.mark.slow  # ~11 s: a bf16 program and two transformers models
def test_llama4_bfloat16_error_is_transformers_bfloat16_error(make_llama4, load, greedy):
    """bfloat16 (vLLM's default for float32 checkpoints) strays from float32 transformers no
    more than transformers' own bfloat16 model does."""
    from test_models import ATOL, bf16_and_transformers_errors

    path = make_llama4(**TEXT)
    model, cfg, _ = load(path, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    prompts = _prompts((9, 20))
    prefill, _, _ = greedy(model, prompts, 1)
    for err, their_err in bf16_and_transformers_errors(path, prefill, prompts):
        assert their_err.max() > ATOL and err.max() <= 1.5 * their_err.max() + 0.02


if __name__ == "__main__":  # the TP child of run_with_host_devices
    import sys

    from conftest import tp_greedy_report
    print(json.dumps(tp_greedy_report(sys.argv[1])))


@pytest.mark.parametrize("parser,output", [
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius"), '
     'get_time(zone="CET")]<|python_end|>'),
    ("llama4_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'),
])
def test_llama4_tool_parsers(parser, output):
    """vLLM's two Llama 4 tool-call formats, whole and streamed token by token."""
    from jaxllm.entrypoints.openai_parsers.tool_parsers import get_tool_parser

    want = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    got = get_tool_parser(parser)().extract(output)
    assert not got.content and [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == want
    p, calls, text = get_tool_parser(parser)(), {}, ""
    for i in range(0, len(output), 3):
        new = output[:i + 3]
        for d in [p.extract_delta(text, new, new[len(text):])] + ([p.flush(new)]
                                                                   if len(new) == len(output)
                                                                   else []):
            assert not (d or {}).get("content")
            for tc in (d or {}).get("tool_calls", []):
                c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                c["name"] += tc.get("function", {}).get("name") or ""
                c["arguments"] += tc.get("function", {}).get("arguments") or ""
        text = new
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want
