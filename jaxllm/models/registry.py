"""Which Hugging Face architectures run, and what each changes in the one generic decoder.

An adapter reads a transformers config and returns only the fields of `ModelConfig` that differ
from the Llama defaults; the decoder itself has no per-architecture code.
"""

from __future__ import annotations

from typing import Callable

from jaxllm.config import ConfigError


def _llama(c) -> dict:  # also Mistral: bias flags and sliding window come from the config
    return {}


def _qwen2(c) -> dict:
    return dict(qkv_bias=True, o_bias=False)  # Qwen2 hard-codes q/k/v biases


def _qwen3(c) -> dict:
    return dict(qk_norm=True)


def _gemma2(c) -> dict:
    return dict(norm_offset=1.0, embed_scale=c.hidden_size ** 0.5, sandwich_norms=True,
                query_pre_attn_scalar=float(c.query_pre_attn_scalar),
                final_logit_softcap=c.final_logit_softcapping,
                attn_logit_softcap=c.attn_logit_softcapping)


def _gemma3(c) -> dict:
    if getattr(c, "use_bidirectional_attention", False):
        raise ConfigError("Gemma 3 with use_bidirectional_attention (an embedding model) is not "
                          "supported")
    # Gemma 3 replaced attention soft-capping by q/k norms: transformers and vLLM ignore
    # attn_logit_softcapping even when the config sets it.
    return dict(_gemma2(c), qk_norm=True, attn_logit_softcap=None)


ARCHITECTURES: dict[str, Callable[[object], dict]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
}


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ConfigError(f"model architecture {archs or '(none in config.json)'} is not supported; "
                     f"supported: {', '.join(ARCHITECTURES)}")


def arch_features(hf_config) -> tuple[str, dict]:
    """(architecture name, the ModelConfig fields this architecture sets)."""
    arch = architecture_of(hf_config)
    return arch, ARCHITECTURES[arch](hf_config)
