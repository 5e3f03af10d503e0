"""Tiny random Qwen3-VL checkpoints (float32) with the Qwen2.5-VL tests' tokenizer and chat
template (tests/vlm_checkpoints.py: the same special tokens) and a PIL image processor of
patch size 16, built offline; transformers is the oracle."""

from __future__ import annotations

import numpy as np

import vlm_checkpoints as vc

DEEPSTACK = [0, 1]  # blocks of the 3-block tower whose features enter decoder layers 0 and 1
# Qwen3-VL-MoE's text model: 4 experts, top 2, layer 1 dense (mlp_only_layers); expert width
# 24 so that the [in, out] and [out, in] stacked layouts differ in shape
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
           mlp_only_layers=[1])


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    # 4 to 64 merged tokens an image, as the Qwen2.5-VL tests' (patches of 16, not 14)
    return Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64,
                                    patch_size=16, merge_size=2, temporal_patch_size=2,
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3)


def config(tok, text_overrides=None, moe: bool = False, **vision):
    import transformers as tr

    # mrope_section [4, 2, 2] of head_dim // 2 = 8: interleaved, frequencies 6 and 7 are past
    # the height and width turns and stay temporal (as the real [24, 20, 20] of 64 does)
    text = {**dict(vocab_size=vc.VOCAB, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                   bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, tie_word_embeddings=False),
            **(MOE if moe else {}), **(text_overrides or {})}
    vis = {**dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=DEEPSTACK,
                  hidden_act="gelu_pytorch_tanh"), **vision}
    cfg = (tr.Qwen3VLMoeConfig if moe else tr.Qwen3VLConfig)(
        text_config=text, vision_config=vis, tie_word_embeddings=False,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    cfg.architectures = ["Qwen3VLMoeForConditionalGeneration" if moe
                         else "Qwen3VLForConditionalGeneration"]
    return cfg


def build(path: str, seed: int = 0, moe: bool = False, **vision):
    """Save a tiny random Qwen3-VL (-MoE) at `path`; returns the transformers model (eval,
    f32). transformers saves the MoE experts as it holds them, [out, in]."""
    import torch
    import transformers as tr

    torch.set_num_threads(1)
    tok = vc.tokenizer()
    cfg = config(tok, moe=moe, **vision)
    torch.manual_seed(seed)
    cls = (tr.Qwen3VLMoeForConditionalGeneration if moe
           else tr.Qwen3VLForConditionalGeneration)
    model = cls(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name or "pos_embed" in name:
                p.copy_(noise)
            else:
                fan_in = p.shape[-1] if p.ndim == 3 else np.prod(p.shape[1:])  # experts
                p.copy_(noise * 1.5 / fan_in ** 0.5)
    model.generation_config = tr.GenerationConfig(bos_token_id=tok.pad_token_id,
                                                  eos_token_id=tok.eos_token_id,
                                                  pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    image_processor().save_pretrained(path)
    return model


def pixels(images):
    return image_processor()(images=images, return_tensors="np")


def reference(hf, text: str, images: list, new_tokens: int):
    """(expanded prompt ids, transformers' greedy tokens, their per-step logits)."""
    px = pixels(images) if images else None
    grids = px["image_grid_thw"] if px else []
    ids = vc.expand(vc.tokenizer().encode(text), grids, hf.config.image_token_id)
    tokens, logits = vc.hf_generate(hf, ids, px and px["pixel_values"], px and grids,
                                    new_tokens)
    return ids, tokens, logits
