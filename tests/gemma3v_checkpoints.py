"""Tiny random Gemma 3 vision-language checkpoints (float32: SigLIP tower, projector, Gemma 3
text model) with their tokenizer, chat template and PIL image processor, built offline; and
transformers' answers for them (the oracle)."""

from __future__ import annotations

import numpy as np

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]
# Gemma 3's chat template, reduced: an image part is <start_of_image>, which the processor
# expands to "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CORPUS = ["Describe the image.\n\nWhat is in the picture?\n\n\nA cat sits on a red mat.\n",
          "Two photos:\n\n a dog in the park\n\n\n\nand a boat on the lake. Which is larger?\n"]
VOCAB = 300
TOKENS = 4  # mm_tokens_per_image
PROMPT = "<bos><start_of_turn>user\n<start_of_image>Describe the image.<end_of_turn>\n"


def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # newline runs are tokens of their own, as in Gemma's vocabulary
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def image_processor():
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


def processor():
    from transformers import Gemma3Processor

    return Gemma3Processor(image_processor(), tokenizer(), image_seq_length=TOKENS,
                           chat_template=CHAT_TEMPLATE)


def config(tok):
    import transformers as tr

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vis = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
               image_size=56, patch_size=14, layer_norm_eps=1e-6)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in (
        ("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>"),
        ("image_token_index", "<image_soft_token>"))}
    cfg = tr.Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=TOKENS,
                          **ids)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    return cfg


def build(path: str, seed: int = 0):
    """Save a tiny random Gemma 3 VLM at `path`; returns the transformers model (eval, f32)."""
    import torch
    from transformers import Gemma3ForConditionalGeneration, GenerationConfig

    torch.set_num_threads(1)
    tok = tokenizer()
    cfg = config(tok)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and "vision_tower" not in name:
                p.copy_(0.1 * noise)  # Gemma's RMSNorms scale by 1 + w
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name or "position_embedding" in name:
                p.copy_(noise * 0.5)
            else:
                p.copy_(noise * 1.5 / np.prod(p.shape[1:]) ** 0.5)
    model.generation_config = GenerationConfig(bos_token_id=cfg.text_config.bos_token_id,
                                               eos_token_id=cfg.text_config.eos_token_id,
                                               pad_token_id=cfg.text_config.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    image_processor().save_pretrained(path)
    return model


def image(seed: int, height: int, width: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (height, width, 3), dtype=np.uint8))


def inputs(text: str, images: list) -> dict:
    """The processor's input_ids, token_type_ids and pixel_values of one prompt."""
    out = processor()(text=text, images=[images] if images else None, return_tensors="np",
                      add_special_tokens=False)
    return {k: np.asarray(v) for k, v in out.items()}


def hf_generate(model, inp: dict, new_tokens: int):
    """transformers' greedy tokens and per-step logits for one processed prompt."""
    import torch

    input_ids = torch.as_tensor(inp["input_ids"])
    kw = {}
    if "pixel_values" in inp:
        kw = dict(pixel_values=torch.as_tensor(inp["pixel_values"]),
                  token_type_ids=torch.as_tensor(inp["token_type_ids"]))
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **kw)
    return (out.sequences[0, input_ids.shape[1]:].tolist(),
            torch.stack(out.logits)[:, 0].numpy())
