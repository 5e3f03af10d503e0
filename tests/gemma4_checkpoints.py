"""Tiny random Gemma 4 checkpoints built with transformers (float32) for tests/test_gemma4*.py.

TEXT: 6 layers (sliding, sliding, full, sliding, sliding, full) with every dense Gemma 4
mechanism: sliding layers of head dim 16 and 2 KV heads (window 8, so prompts and decode
cross it), full layers of head dim 32 and 1 KV head (`attention_k_eq_v`) with `proportional`
RoPE, per-layer inputs of width 8, final logit soft-capping. Weights as conftest's
`_randomize` (norms near one: Gemma 4's norms scale by w), and every layer_scalar buffer a
random value in [0.5, 1.5] (transformers leaves them at one).
"""

from __future__ import annotations

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
            final_logit_softcapping=30.0, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=True)


def build(path: str, tokenizer, seed: int = 0, multimodal: bool = False, **kw) -> str:
    """A Gemma4ForCausalLM checkpoint of TEXT updated by kw, saved with `tokenizer` at path;
    multimodal: a Gemma4ForConditionalGeneration one with a tiny vision and audio tower."""
    import torch
    import transformers as tr
    from conftest import _randomize

    ids = dict(bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    cfg = tr.Gemma4TextConfig(**dict(TEXT, **kw), **ids)
    torch.manual_seed(seed)
    if multimodal:
        cfg = tr.Gemma4Config(
            text_config=cfg.to_dict(),
            vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64),
            audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              output_proj_dims=32, subsampling_conv_channels=[8, 8]), **ids)
        cfg.architectures = ["Gemma4ForConditionalGeneration"]
        model = tr.Gemma4ForConditionalGeneration(cfg).to(torch.float32)
        text = model.model.language_model
    else:
        cfg.architectures = ["Gemma4ForCausalLM"]
        model = tr.Gemma4ForCausalLM(cfg).to(torch.float32)
        text = model.model
    _randomize(model, False, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in text.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
