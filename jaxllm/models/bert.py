"""The encoder-only transformer of BERT, RoBERTa and XLM-RoBERTa (`ModelConfig.encoder`).

Word + position + token-type embeddings and a LayerNorm, then post-LN blocks: bidirectional
self-attention (every token sees every real token of its prompt) and a GELU MLP, each added
to its input and normalized. There is no KV cache and no causal mask: a prompt is one padded
bucket that runs once (jaxllm/worker/pooler.py), so the attention is a dense masked softmax
in plain XLA, the same program on every platform; the model is built with the reference
backend whatever --attention-backend resolves to (jaxllm/loader/bert_weights.py refuses the
others by name).

Weights are stacked over the layers and the blocks run in one `lax.scan`. Layer norms and the
softmax run in float32, projections sum in float32; each result is cast back to the model's
dtype where transformers' is. The classification heads (BERT's pooler, RoBERTa's dense +
out_proj) are not here: the pooler applies them on the host (jaxllm/loader/classifier_head.py).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.backends.reference import ACTIVATIONS, ReferenceBackend
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.params import dummy_weight

# Stacked layer weights ([L, ...]) by name, with their shapes from (E, F).
LAYER_SHAPES = {
    "wq": lambda E, F: (E, E), "bq": lambda E, F: (E,),
    "wk": lambda E, F: (E, E), "bk": lambda E, F: (E,),
    "wv": lambda E, F: (E, E), "bv": lambda E, F: (E,),
    "wo": lambda E, F: (E, E), "bo": lambda E, F: (E,),
    "ln1_w": lambda E, F: (E,), "ln1_b": lambda E, F: (E,),
    "wi": lambda E, F: (E, F), "bi": lambda E, F: (F,),
    "wout": lambda E, F: (F, E), "bout": lambda E, F: (E,),
    "ln2_w": lambda E, F: (E,), "ln2_b": lambda E, F: (E,),
}


def top_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The embedding tables' and embedding LayerNorm's shapes, by name."""
    spec, E = cfg.encoder, cfg.hidden_size
    return {"word": (cfg.vocab_size, E),
            "position": (spec.max_positions + spec.position_offset, E),
            "token_type": (spec.type_vocab_size, E), "emb_norm_w": (E,), "emb_norm_b": (E,)}


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """torch.nn.LayerNorm over the last axis, in float32, cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _dense(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return (jnp.einsum("te,ef->tf", x, w, preferred_element_type=jnp.float32)
            + b.astype(jnp.float32)).astype(x.dtype)


def bidirectional_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array,
                            sm_scale: float) -> jax.Array:
    """Dense attention without a causal mask: q, k, v [T, H, D], key_valid bool [T] (the
    prompt's real tokens; padding keys get no weight) -> [T, H, D] in q's dtype."""
    s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    s = jnp.where(key_valid[None, None, :], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("hqk,khd->qhd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


class BertEncoder(nnx.Module):
    """token ids of one prompt, padded to a bucket -> its final hidden states [T, E].

    It stands where the engine's ModelRunner expects a decoder (`backend`, `cfg`,
    `kv_cache_shapes`: none, `moe_layer_ids`), so the pooling engine is built as for a decoder;
    only the pooler calls it (`encode`), never the generate step. `weights`: the loader's
    arrays by name (`top_shapes` and `LAYER_SHAPES`, the latter stacked); None: dummy ones."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, weights: Optional[dict] = None,
                 backend: Backend = ReferenceBackend()):
        if cfg.encoder is None:
            raise ValueError("BertEncoder needs an encoder-only ModelConfig (cfg.encoder)")
        if cfg.activation not in ACTIVATIONS:
            raise ConfigError(f"{cfg.architecture}: hidden_act {cfg.activation!r} is not "
                              f"supported (supported: {', '.join(ACTIVATIONS)})")
        self.cfg, self.backend = cfg, backend
        E, F, L, dt = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.jnp_dtype

        def param(name: str, shape: tuple) -> nnx.Param:
            if weights is None:
                if name.startswith(("ln", "emb_norm")):  # norms at identity
                    one = 1.0 if name.endswith("_w") else 0.0
                    return nnx.Param(jnp.full(shape, one, dt))
                return dummy_weight(seed, name, shape, (None,) * len(shape), dt)
            w = weights[name]
            if tuple(w.shape) != tuple(shape):
                raise ConfigError(f"{cfg.architecture}: weight {name} has shape "
                                  f"{tuple(w.shape)}, expected {tuple(shape)}")
            return nnx.Param(w)

        for name, shape in top_shapes(cfg).items():
            setattr(self, name, param(name, shape))
        self.encoder = nnx.Dict({name: param(name, (L, *f(E, F)))
                                 for name, f in LAYER_SHAPES.items()})

    def weights(self) -> dict[str, jax.Array]:
        """The weights by name, as `weights` takes them."""
        out = {name: getattr(self, name)[...] for name in top_shapes(self.cfg)}
        out.update({name: p[...] for name, p in self.encoder.items()})
        return out

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def attention_backend(self) -> str:
        return self.backend.name

    def kv_cache_shapes(self, num_blocks: int, block_size: int, state_slots: int = 0) -> tuple:
        """None: an encoder keeps no KV cache."""
        return ()

    def encode(self, token_ids: jax.Array, num_tokens: jax.Array,
               type_start: jax.Array) -> jax.Array:
        """token_ids int32 [T] (a prompt's num_tokens real ones, then padding) -> final hidden
        states [T, E]. type_start: the first token of segment 1 (a sequence pair's second
        text; >= num_tokens: one segment), vLLM's compressed token type ids."""
        cfg, spec = self.cfg, self.cfg.encoder
        T = token_ids.shape[0]
        idx = jnp.arange(T, dtype=jnp.int32)
        valid = idx < num_tokens
        if spec.padding_idx is None:
            positions = idx
        else:  # RoBERTa: create_position_ids_from_input_ids
            real = (token_ids != spec.padding_idx) & valid
            positions = jnp.cumsum(real.astype(jnp.int32)) * real + spec.padding_idx
        positions = jnp.where(valid, positions, 0)
        types = jnp.where(valid & (idx >= type_start), 1, 0)
        h = (jnp.take(self.word[...], token_ids, axis=0, mode="clip")
             + jnp.take(self.position[...], positions, axis=0, mode="clip")
             + jnp.take(self.token_type[...], types, axis=0, mode="clip"))
        eps = spec.layer_norm_eps
        h = layer_norm(h, self.emb_norm_w[...], self.emb_norm_b[...], eps)
        H, D = cfg.num_heads, cfg.head_dim
        act = ACTIVATIONS[cfg.activation]

        def block(h, w):
            q, k, v = (_dense(h, w[f"w{n}"], w[f"b{n}"]).reshape(T, H, D) for n in "qkv")
            ctx = bidirectional_attention(q, k, v, valid, D ** -0.5).reshape(T, H * D)
            h = layer_norm(_dense(ctx, w["wo"], w["bo"]) + h, w["ln1_w"], w["ln1_b"], eps)
            inner = act(_dense(h, w["wi"], w["bi"]).astype(jnp.float32)).astype(h.dtype)
            h = layer_norm(_dense(inner, w["wout"], w["bout"]) + h, w["ln2_w"], w["ln2_b"], eps)
            return h, None

        stacked = {name: p[...] for name, p in self.encoder.items()}
        h, _ = jax.lax.scan(block, h, stacked)
        return h

