"""Tiny encoder-only checkpoints (BERT, RoBERTa, XLM-RoBERTa) for tests/test_bert.py, built
with transformers from random float32 weights, with a tokenizer made here (no download): a
WordPiece vocabulary for BERT, a byte-level BPE one (every byte a token) for RoBERTa."""

from __future__ import annotations

import json
import os

WORDS = ("the cat sat on mat a dog hello world is red blue what where who which how why "
         "fish bird runs eats sleeps big small").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'"


def _bert_tokenizer(path: str):
    from transformers import BertTokenizerFast

    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list(LETTERS)
             + [f"##{c}" for c in LETTERS])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast(os.path.join(path, "vocab.txt"), do_lower_case=True)


def _roberta_tokenizer(path: str):
    """RoBERTa's specials at its ids (<s> 0, <pad> 1, </s> 2, <unk> 3), then one token per
    byte (the byte-level alphabet), no merges."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import RobertaTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab["<mask>"] = len(vocab)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return RobertaTokenizerFast(os.path.join(path, "vocab.json"),
                                os.path.join(path, "merges.txt"))


def _randomize(model, seed: int) -> None:
    """Weights wide enough that the layers matter; LayerNorm scales near 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embeddings" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / p.shape[-1] ** 0.5)


def make_encoder(path: str, arch: str = "BertModel", seed: int = 0, num_labels: int = 1,
                 pooling: str | None = None, normalize: bool = False, **config) -> str:
    """A random float32 `arch` checkpoint at `path` (2 layers, hidden 32, 4 heads) with its
    tokenizer. pooling ("cls" / "mean"): a sentence-transformers folder pooling that way
    (modules.json, 1_Pooling/config.json; a Normalize module with `normalize`)."""
    import torch
    import transformers

    roberta = "Roberta" in arch
    tok = (_roberta_tokenizer if roberta else _bert_tokenizer)(path)
    kind = "XLMRobertaConfig" if arch.startswith("XLM") else (
        "RobertaConfig" if roberta else "BertConfig")
    fields = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, type_vocab_size=1 if roberta
                  else 2, max_position_embeddings=66 if roberta else 64,
                  pad_token_id=tok.pad_token_id, num_labels=num_labels,
                  id2label={i: f"L{i}" for i in range(num_labels)},
                  label2id={f"L{i}": i for i in range(num_labels)})
    if roberta:
        fields.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    fields.update(config)
    cfg = getattr(transformers, kind)(**fields)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 32,
                       "pooling_mode_cls_token": pooling == "cls",
                       "pooling_mode_mean_tokens": pooling == "mean"}, f)
    return path
