"""Tiny random Qwen2.5-VL checkpoints (float32) with their tokenizer, chat template and PIL
image processor, built offline; and transformers' answers for them (the oracle)."""

from __future__ import annotations

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
# The chat template of Qwen2.5-VL, reduced: an image part is its placeholder between the
# vision markers.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Describe the image. What is in the picture? A cat sits on a red mat by the door.",
          "Two photos: a dog in the park and a boat on the lake. Which one is larger?"]
VOCAB = 320
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>\n"


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    # 4 to 64 merged tokens an image: small images stay small
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64,
                                    patch_size=14, merge_size=2, temporal_patch_size=2)


def config(tok, text_overrides=None, **vision):
    import transformers as tr

    text = {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]},
                bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False),
            **(text_overrides or {})}
    vis = {**dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  out_hidden_size=64, fullatt_block_indexes=[1], hidden_act="silu"), **vision}
    cfg = tr.Qwen2_5_VLConfig(
        text_config=text, vision_config=vis, tie_word_embeddings=False,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def build(path: str, seed: int = 0):
    """Save a tiny random Qwen2.5-VL at `path`; returns the transformers model (eval, f32)."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    torch.set_num_threads(1)
    tok = tokenizer()
    cfg = config(tok)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / np.prod(p.shape[1:]) ** 0.5)
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id,
                                               eos_token_id=cfg.eos_token_id,
                                               pad_token_id=cfg.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    image_processor().save_pretrained(path)
    return model


def image(seed: int, height: int, width: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (height, width, 3), dtype=np.uint8))


def expand(ids: list[int], grids, image_token_id: int, merge: int = 2) -> list[int]:
    """Each image placeholder repeated to its image's token count."""
    out, images = [], iter(grids)
    for i in ids:
        if i == image_token_id:
            t, h, w = (int(x) for x in next(images))
            out += [i] * (t * h * w // merge ** 2)
        else:
            out.append(i)
    return out


def hf_generate(model, ids: list[int], pixel_values, grids, new_tokens: int):
    """transformers' greedy tokens and per-step logits for one expanded prompt."""
    import torch

    input_ids = torch.tensor([ids])
    kw = {}
    if pixel_values is not None:
        kw = dict(pixel_values=torch.as_tensor(pixel_values),
                  image_grid_thw=torch.as_tensor(np.asarray(grids)),
                  mm_token_type_ids=(input_ids == model.config.image_token_id).int())
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **kw)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0].numpy()
