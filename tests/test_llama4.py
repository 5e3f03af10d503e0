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


def test_llama4_refusals():
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
