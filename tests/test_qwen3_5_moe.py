"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`: Qwen3.5's gated DeltaNet and gated attention layers,
every MLP routed experts plus a gated shared expert) against transformers 5: a float32 tiny
random config, ragged prefill then 32 greedy steps, logits within test_qwen3_next's ATOL and the
tokens identical. The multimodal checkpoints (`Qwen3_5MoeForConditionalGeneration`,
`Qwen3_5ForConditionalGeneration`) load their language model (vision tower skipped) and match
transformers' multimodal model on text; images are refused."""

import numpy as np
import pytest

from qwen3_next_checkpoints import DENSE, StateRunner, make_qwen3_next
from test_qwen3_next import ATOL, NEW_TOKENS, _hf, _hf_greedy, _prompts

MOE = dict(arch="Qwen3_5MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=24)


@pytest.fixture(scope="module")
def make(make_tiny_checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    cache = {}
    return lambda **kw: make_qwen3_next(tmp_path_factory, tok, cache, **kw)


@pytest.fixture(scope="module")
def checkpoint(make):
    return make(**MOE)


def _hf_multimodal(path):
    import torch
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                       attn_implementation="eager").eval()


@pytest.mark.slow  # load, compiles and transformers' 32 steps (~50 s)
def test_ragged_prefill_and_decode_match_transformers(checkpoint, load):
    """Prompt lengths across the 64-token chunk boundary and a length-1 prompt."""
    model, cfg, _ = load(checkpoint)
    assert cfg.linear_layers == (True, False, True, True)
    assert cfg.moe_layers == (True,) * 4 and cfg.norm_topk_prob
    assert cfg.intermediate_size == 0  # its config has none: no dense MLP
    assert [(g.kind, g.count) for g in model.groups] == [
        ("gdn_moe", 1), ("gated_attn_moe", 1), ("gdn_moe", 2)]
    match_transformers(model, checkpoint, _hf(checkpoint), NEW_TOKENS)


@pytest.mark.slow  # two checkpoints' loads and compiles (~50 s)
@pytest.mark.parametrize("arch,kw", [
    ("Qwen3_5MoeForConditionalGeneration", {k: v for k, v in MOE.items() if k != "arch"}),
    ("Qwen3_5ForConditionalGeneration", {})])
def test_multimodal_checkpoint_runs_its_language_model(make, load, arch, kw):
    """The vision tower's tensors are in the checkpoint and skipped; text prompts give the
    multimodal model's logits and tokens (8 greedy steps)."""
    import glob

    from safetensors import safe_open

    path = make(arch=arch, **kw)
    with safe_open(glob.glob(f"{path}/*.safetensors")[0], "np") as f:
        names = list(f.keys())
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    model, cfg, _ = load(path)
    assert cfg.architecture == arch and cfg.vision is None
    assert any(cfg.moe_layers) == bool(kw)
    match_transformers(model, path, _hf_multimodal(path), 8)


def test_images_are_refused_by_name(make):
    """Served text-only: a prompt with images is refused naming multi_modal_data and the
    architecture (the engine builds no image processor: the config has no vision spec)."""
    from transformers import AutoConfig, AutoTokenizer

    from jaxllm.config import EngineArgs
    from jaxllm.engine.input_processor import InputProcessor
    from jaxllm.engine.multimodal import image_processor
    from jaxllm.models.model_config import ModelConfig

    path = make(arch="Qwen3_5ForConditionalGeneration")
    config = EngineArgs(model=path, max_model_len=64).create_engine_config()
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(path), config.model)
    assert mc.architecture == "Qwen3_5ForConditionalGeneration"
    assert image_processor(config, mc) is None
    proc = InputProcessor(AutoTokenizer.from_pretrained(path), mc, max_logprobs=0,
                          eos_token_ids=frozenset())
    assert proc.process_prompt({"prompt_token_ids": [5, 6]})[1] == [5, 6]
    with pytest.raises(ValueError, match=r"multi_modal_data.*Qwen3_5ForConditionalGeneration"):
        proc.process_prompt({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": []}})


def match_transformers(model, path, hf, new_tokens):
    prompts = _prompts((5, 1, 70, 17), seed=1)
    runner = StateRunner(model, 4, len(prompts), 128, 128)
    seqs = list(range(len(prompts)))
    prefill = runner.step(seqs, prompts)
    last = [int(p[-1].argmax()) for p in prefill]
    steps, tokens = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(new_tokens):
        for i, t in enumerate(last):
            tokens[i].append(t)
        out = runner.step(seqs, [[t] for t in last])
        for i, o in enumerate(out):
            steps[i].append(o[0])
        last = [int(o[0].argmax()) for o in out]
    for i, prompt in enumerate(prompts):
        want_prefill, want_steps, want_tokens = _hf_greedy(hf, prompt, new_tokens)
        np.testing.assert_allclose(prefill[i], want_prefill, atol=ATOL, rtol=0,
                                   err_msg=f"prefill of prompt {i}")
        np.testing.assert_allclose(np.stack(steps[i]), want_steps, atol=ATOL, rtol=0,
                                   err_msg=f"decode steps of prompt {i}")
        assert tokens[i] == want_tokens, f"greedy tokens of prompt {i}"


def test_linear_layers_only_is_refused_by_name():
    """layer_types without a full-attention layer: a ConfigError naming layer_types (the KV
    cache is sized over full-attention layers), not a crash at start-up."""
    from transformers import Qwen3NextConfig

    from jaxllm.config import ConfigError, EngineArgs
    from jaxllm.models.model_config import ModelConfig

    hf = Qwen3NextConfig(**{**DENSE, "layer_types": ["linear_attention"] * 4})
    hf.architectures = ["Qwen3NextForCausalLM"]
    options = EngineArgs(model="tiny").create_engine_config().model
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf(hf, options)
    hf.layer_types = DENSE["layer_types"]
    assert ModelConfig.from_hf(hf, options).linear_layers == (True, False, True, True)
