"""`Gemma4Spec`: the settings only Gemma 4 has, read from its transformers text config once
(`from_hf`) and carried in `ModelConfig.gemma4` (jaxllm/models/gemma4.py runs them).

Kept apart from jaxllm/models/gemma4.py so that the registry (imported by the model config)
can build it without importing the model.
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Gemma4Spec:
    global_head_dim: int      # full-attention layers' head dim (sliding ones: cfg.head_dim)
    global_kv_heads: int      # full-attention layers' KV heads (sliding ones: cfg.num_kv_heads)
    k_eq_v: bool              # attention_k_eq_v: full layers' V is their K projection
    per_layer_size: int       # hidden_size_per_layer_input P (0: no per-layer inputs)
    per_layer_vocab: int      # vocab_size_per_layer_input
    # Per layer: the layer whose KV cache it reads (num_kv_shared_layers: the last earlier
    # layer of its type), or -1 when it projects and caches its own K/V.
    kv_producer: tuple[int, ...]
    double_wide_mlp: bool     # use_double_wide_mlp: the KV-shared layers' FFN is twice as wide
    # Per layer: a full-attention layer (else sliding). Its geometry, whatever the windows
    # (--disable-sliding-window sets them all to 0).
    full_layers: tuple[bool, ...] = ()

    @classmethod
    def from_hf(cls, c) -> "Gemma4Spec":
        n, types = c.num_hidden_layers, list(c.layer_types)
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ConfigError(f"Gemma 4 layer_types {unknown} are not supported")
        full = types.index("full_attention") if "full_attention" in types else None
        geometry = c.per_layer_config[full] if full is not None else None
        shared = c.num_kv_shared_layers or 0
        first_shared = n - shared
        producers = []
        for i, t in enumerate(types):
            if i < first_shared:
                producers.append(-1)
                continue
            earlier = [j for j in range(first_shared) if types[j] == t]
            if not earlier:
                raise ConfigError(f"Gemma 4 num_kv_shared_layers={shared}: layer {i} ({t}) "
                                  "has no earlier layer of its type to share the KV cache of")
            producers.append(earlier[-1])
        P = c.hidden_size_per_layer_input or 0
        vocab_p = c.vocab_size_per_layer_input if P else 0
        if P and vocab_p < c.vocab_size:
            raise ConfigError(f"Gemma 4 vocab_size_per_layer_input={vocab_p} is smaller than "
                              f"vocab_size={c.vocab_size} (tokens past it have no per-layer "
                              "embedding)")
        return cls(
            global_head_dim=geometry.head_dim if geometry is not None else c.head_dim,
            global_kv_heads=(geometry.num_key_value_heads if geometry is not None
                             else c.num_key_value_heads),
            k_eq_v=bool(c.attention_k_eq_v), per_layer_size=P, per_layer_vocab=vocab_p,
            kv_producer=tuple(producers), double_wide_mlp=bool(c.use_double_wide_mlp),
            full_layers=tuple(t == "full_attention" for t in types))
