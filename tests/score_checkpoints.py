"""Tiny `*ForSequenceClassification` checkpoints (a decoder plus a `score` head) for the
classify/score/rerank tests, built with transformers from the suite's tiny configs."""

from __future__ import annotations

from conftest import _hf_config, _randomize

# The suite's config names -> transformers' sequence-classification classes.
CLASSIFIERS = {"llama": "LlamaForSequenceClassification",
               "qwen2": "Qwen2ForSequenceClassification",
               "qwen3": "Qwen3ForSequenceClassification"}


def make_classifier(path: str, arch: str, num_labels: int, tokenizer_dir: str, seed: int = 0,
                    **config) -> str:
    """A random float32 classifier at `path` with `num_labels` labels named L0, L1, ... and
    the tokenizer of `tokenizer_dir` (config: extra config fields, e.g. problem_type)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = _hf_config(arch, {})
    cfg.bos_token_id = cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    cfg.num_labels = num_labels
    cfg.id2label = {i: f"L{i}" for i in range(num_labels)}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    for key, value in config.items():
        setattr(cfg, key, value)
    cfg.architectures = [CLASSIFIERS[arch]]
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSIFIERS[arch])(cfg).to(torch.float32)
    _randomize(model, False, seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
