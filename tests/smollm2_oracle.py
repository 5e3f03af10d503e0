"""transformers' own reading of the default model's GGUF (SmolLM2-135M-Instruct, Q4_1), the
oracle of several test modules, made once per test session: transformers parses the GGUF's
metadata again for each load (tens of seconds for the model, several for the tokenizer).

Callers share the objects: they read them and must not change them (a test that needs a
changed copy makes one)."""

from __future__ import annotations

import functools
import os


def _gguf() -> tuple[str, str]:
    from jaxllm.loader.default_model import default_model_path

    return os.path.split(default_model_path())


@functools.cache
def hf_tokenizer():
    """AutoTokenizer.from_pretrained on the GGUF."""
    from transformers import AutoTokenizer

    folder, name = _gguf()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@functools.cache
def hf_model():
    """AutoModelForCausalLM.from_pretrained on the GGUF (dequantized), float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = _gguf()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()
