"""Tokenizers and generation-config defaults for a model folder, hub name or GGUF file.

A GGUF file carries its own tokenizer, chat template and EOS id, so a GGUF model needs no folder
of tokenizer files. Building the tokenizer from GGUF takes seconds, hence the cache.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

from jaxllm.loader.default_model import resolve_model

# generation_config.json keys vLLM turns into default sampling parameters.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def get_tokenizer(model, *, revision: Optional[str] = None, gguf_file: Optional[str] = None,
                  download_dir: Optional[str] = None):
    """A transformers tokenizer for `model`: a `LoadConfig`, a folder, a hub name, a .gguf path
    or None (the default model).

    From a `LoadConfig` it uses `tokenizer` (else `model`), `tokenizer_revision` and
    `download_dir`, as vLLM does. The result is shared per source: do not mutate it.
    """
    if model is not None and not isinstance(model, str):
        return get_tokenizer(model.tokenizer or model.model, revision=model.tokenizer_revision,
                             download_dir=model.download_dir)
    name = resolve_model(model)
    if gguf_file is None and name.endswith(".gguf") and os.path.isfile(name):
        name, gguf_file = os.path.split(name)
    if os.path.exists(name):
        name = os.path.abspath(name)
    return _load_tokenizer(name, gguf_file, revision, download_dir)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(name: str, gguf_file: Optional[str], revision: Optional[str],
                    cache_dir: Optional[str]):
    from transformers import AutoTokenizer

    try:
        if gguf_file is not None and os.path.isdir(name):  # torch-free (see gguf_tokenizer)
            from jaxllm.loader.gguf_tokenizer import gguf_tokenizer
            return gguf_tokenizer(os.path.join(name, gguf_file))
        return AutoTokenizer.from_pretrained(name, gguf_file=gguf_file, revision=revision,
                                             cache_dir=cache_dir)
    except (OSError, ValueError) as e:
        source = os.path.join(name, gguf_file) if gguf_file else name
        raise OSError(f"cannot load a tokenizer from {source}: {str(e).rstrip('.')}. Pass "
                      "--tokenizer, or --skip-tokenizer-init and give prompts as token ids.") from e


def load_generation_config(model: str, mode: str = "auto", *, revision: Optional[str] = None,
                           download_dir: Optional[str] = None) -> dict:
    """Defaults from the model's generation config, following vLLM's `--generation-config`.

    `mode` is 'auto' (the model's own generation_config.json), 'vllm' (none) or a folder holding
    one. Returns `eos_token_id` as a list plus whichever of SAMPLING_KEYS the file sets; {} when
    there is no file. For a GGUF model only the EOS id exists (from its metadata).
    """
    if mode == "vllm":
        return {}
    source = resolve_model(model) if mode == "auto" else mode
    if source.endswith(".gguf") and os.path.isfile(source):
        from jaxllm.loader.gguf import gguf_value, read_gguf

        eos = gguf_value(read_gguf(source), "tokenizer.ggml.eos_token_id")
        return {} if eos is None else {"eos_token_id": [int(eos)]}

    path = _generation_config_file(source, revision, download_dir)
    if path is None:
        return {}
    with open(path) as f:
        config = json.load(f)
    out = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    eos = config.get("eos_token_id")
    if eos is not None:
        out["eos_token_id"] = list(eos) if isinstance(eos, list) else [eos]
    return out


def _generation_config_file(source: str, revision: Optional[str],
                            download_dir: Optional[str]) -> Optional[str]:
    """Local path of `source`'s generation_config.json (a folder or hub name), None if it has none.

    Read as plain JSON rather than via transformers' GenerationConfig, which warns that sampling
    keys without `do_sample` "may be ignored" -- here they are exactly what is wanted.
    """
    if os.path.isdir(source):
        path = os.path.join(source, "generation_config.json")
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(source, "generation_config.json", revision=revision,
                               cache_dir=download_dir)
    except (OSError, ValueError):  # no such repo or file, offline, or not a repo id
        return None
