"""The one decoder-only transformer; Llama 1-3, Mistral, Qwen2/2.5, Qwen3 and Gemma 2/3 are
flags of `ModelConfig`, not copies.

Weights are stacked over layers and a single `lax.scan` runs them, so compile time does not grow
with depth. The stacked KV cache rides in the scan carry; each layer writes its K/V before it
reads the cache, which lets XLA update the donated cache in place. Q/K/V and gate/up are fused
into one matmul each (fewer, larger dots run fastest on XLA:CPU). Every weight carries logical
axis names (`out_sharding` metadata) that `jaxllm.parallel.mesh` maps onto the device mesh.
"""

from __future__ import annotations

import math
import zlib
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache, paged_attention
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.rope import apply_rope, rope_tables
from pallas_kernels.activation import kernel_cpu as activation_cpu
from pallas_kernels.activation import reference as activation_ref
from pallas_kernels.matmul import kernel_cpu as matmul_cpu

ACTIVATIONS = {  # silu: activation_ref.silu_and_mul
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "gelu": partial(jax.nn.gelu, approximate=False),
}


# Layer weights the native CPU matmul reads, packed (`pack_native`) from [L, in, out] (row-major
# reshapes of the stacked ones): whether the hidden size is their input (else their output).
_PROJECTIONS = {"qkv": True, "o": False, "gate_up": True, "down": False}


def _weight(seed: int, name: str, shape, axes, dtype) -> nnx.Param:
    """Pseudo-random values in [-0.05, 0.05) (the dummy weights) from an integer hash of the
    element index: jax.random's threefry takes XLA:CPU ~2 s to compile per call."""
    x = jax.lax.iota(jnp.uint32, math.prod(shape)) * jnp.uint32(0x9E3779B9)
    x = x + jnp.uint32(zlib.crc32(f"{seed}/{name}".encode()))
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    x = (x ^ (x >> 16)).astype(jnp.float32) * (0.1 / 2**32) - 0.05
    return nnx.Param(x.reshape(shape).astype(dtype), out_sharding=axes)


def _constant(value: float, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), out_sharding=axes)


class Layers(nnx.Module):
    """All decoder layers' weights, each stacked on a leading 'layers' axis."""

    def __init__(self, cfg: ModelConfig, seed: int):
        L, E, F, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        K, G, dt = cfg.num_kv_heads, cfg.q_per_kv, cfg.jnp_dtype
        one = 1.0 - cfg.norm_offset  # a norm weight that scales by one
        norm = partial(_constant, one, (L, E), ("layers", "embed"), dt)
        self.attn_norm = norm()
        weight = partial(_weight, seed)
        self.qkv = weight("qkv", (L, E, K, G + 2, D),
                          ("layers", "embed", "kv_heads", "q_per_kv", "head_dim"), dt)
        self.qkv_bias = (_constant(0.0, (L, K, G + 2, D),
                                   ("layers", "kv_heads", "q_per_kv", "head_dim"), dt)
                         if cfg.qkv_bias else None)
        head_norm = partial(_constant, one, (L, D), ("layers", "head_dim"), dt)
        self.q_norm = head_norm() if cfg.qk_norm else None
        self.k_norm = head_norm() if cfg.qk_norm else None
        self.o = weight("o", (L, K, G, D, E),
                        ("layers", "kv_heads", "q_per_kv", "head_dim", "embed"), dt)
        self.o_bias = _constant(0.0, (L, E), ("layers", "embed"), dt) if cfg.o_bias else None
        self.post_attn_norm = norm() if cfg.sandwich_norms else None
        self.mlp_norm = norm()
        self.gate_up = weight("gate_up", (L, E, 2, F), ("layers", "embed", None, "mlp"), dt)
        self.down = weight("down", (L, F, E), ("layers", "mlp", "embed"), dt)
        self.post_mlp_norm = norm() if cfg.sandwich_norms else None

    def arrays(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class Decoder(nnx.Module):
    """token ids + positions + paged KV cache -> final hidden states; `compute_logits` -> logits.

    attention_backend is static: 'reference' (pure JAX, CPU) or 'pallas'. `seed` only picks the
    initial (dummy) weights; real ones come from the loader.
    """

    def __init__(self, cfg: ModelConfig, attention_backend: str = "reference", seed: int = 0):
        if cfg.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {cfg.activation!r} is not supported (supported: "
                              f"{', '.join(ACTIVATIONS)})")
        self.cfg = cfg
        self.attention_backend = attention_backend
        V, E, dt = cfg.vocab_size, cfg.hidden_size, cfg.jnp_dtype
        self.embed = _weight(seed, "embed", (V, E), ("vocab", "embed"), dt)
        self.layers = Layers(cfg, seed)
        self.final_norm = _constant(1.0 - cfg.norm_offset, (E,), ("embed",), dt)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else _weight(seed, "lm_head", (V, E), ("vocab", "embed"), dt))

    def __call__(self, kv_cache: KVCache, token_ids: jax.Array, positions: jax.Array,
                 md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        cfg = self.cfg
        if self.native_matmul and self.lm_head is None:  # packed as the LM head
            h = _from_bits(matmul_cpu.packed_rows(self.embed[...], token_ids, cfg.hidden_size))
        else:
            h = _from_bits(jnp.take(self.embed[...], token_ids, axis=0))
        if cfg.embed_scale is not None:
            h = h * jnp.asarray(cfg.embed_scale, h.dtype)
        specs = tuple(dict.fromkeys(cfg.rope))  # distinct RoPE settings (Gemma 3: local/global)
        cos, sin = rope_tables(specs, cfg.head_dim, positions, h.dtype)
        rope_ids = jnp.asarray([specs.index(s) for s in cfg.rope], jnp.int32)
        windowed = any(cfg.sliding_window)
        windows = jnp.asarray(cfg.sliding_window, jnp.int32)
        weights = self.layers.arrays()
        native = None
        if self.native_matmul:  # packed weights, read in place: not sliced per layer by the scan
            packed = {k: weights.pop(k) for k in _PROJECTIONS}
            widths = _projection_widths(cfg)

            def native(name, x, out_dtype=jnp.float32, *, layer):
                return matmul_cpu.matmul(x, packed[name], layer, n=widths[name],
                                         out_dtype=out_dtype)

        def body(carry, xs):
            h, cache = carry
            w, layer, rope_id, window = xs
            w = jax.tree.map(_from_bits, w)
            h, cache = _layer(cfg, self.attention_backend, w, h, cache, layer, md,
                              cos[rope_id], sin[rope_id], window if windowed else None,
                              None if native is None else partial(native, layer=layer))
            return (h, cache), None

        xs = (weights, jnp.arange(cfg.num_layers, dtype=jnp.int32), rope_ids, windows)
        (h, kv_cache), _ = jax.lax.scan(body, (h, kv_cache), xs)
        return rms_norm(h, self.final_norm[...], cfg), kv_cache

    @property
    def native_matmul(self) -> bool:
        """Whether the projections and the LM head run in the native CPU matmul (backend 'cpu'):
        it reads the stacked weights in place, where XLA:CPU copies each layer's slice out of
        the scan, and runs bf16 weights at f32 speed (XLA:CPU converts them first). Measured on
        AVX2 against XLA's dot: 2-3x at 1 row, 1.3x at 64-128 (f32), on par at 2048. The
        layer weights must then be packed (`pack_native`)."""
        return (self.attention_backend == "cpu" and matmul_cpu.available()
                and activation_cpu.available())

    @property
    def greedy_head(self):
        """hidden [N, E] -> int32 [N], the first maximum of compute_logits(hidden) without the
        logits: the native matmul keeps each 16 columns' maximum while they are in cache (64
        rows of a 32000 vocabulary: 8 MB written, then sliced and reduced in 0.9 ms). None
        for XLA's dot, and with soft-capping (its tanh can make ties of distinct logits)."""
        if not self.native_matmul or self.cfg.final_logit_softcap is not None:
            return None
        w = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return partial(matmul_cpu.argmax, w=w, n=self.cfg.vocab_size)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> float32 logits [N, V], final soft-capping applied."""
        w = self.embed[...] if self.lm_head is None else self.lm_head[...]
        if self.native_matmul:  # packed
            logits = matmul_cpu.matmul(hidden, w, n=self.cfg.vocab_size)
        else:
            logits = jnp.einsum("ne,ve->nv", hidden, _from_bits(w),
                                preferred_element_type=jnp.float32)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def weights_as_bits(state: nnx.State) -> nnx.State:
    """The state with its bf16 weights (layers, embedding, LM head) stored as their uint16
    bits, for XLA:CPU.

    XLA:CPU converts every bf16 array that enters a while loop (the layer scan, the multi-step
    loop) to f32, whole, on every call: bits pass through untouched and each use converts only
    what it reads (3x faster single-sequence decode, 1.6x at batch 64, measured on the 124M
    Llama; the embedding alone cost 2 ms per token inside the multi-step loop).
    """
    def to_bits(w):
        return jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == jnp.bfloat16 else w

    for name in ("layers", "embed", "lm_head"):
        if name in state:
            state[name] = jax.jit(lambda t: jax.tree.map(to_bits, t), donate_argnums=0)(state[name])
    return state


def pack_native(state: nnx.State, cfg: ModelConfig) -> nnx.State:
    """The state with the four layer projections and the LM head (for tied embeddings the
    embedding, then looked up in place) in the native matmul's packed layout (strips of 16
    output columns, `matmul_cpu.pack`): every read is sequential and no step repacks them
    (measured against row-major weights: projections 15% faster at 1 row and 13-30% at 64,
    the LM head 38% at 1 row and 2x at 64)."""
    L, E = cfg.num_layers, cfg.hidden_size
    pack = jax.jit(lambda w, shape: matmul_cpu.pack(w.reshape(shape)), static_argnums=1,
                   donate_argnums=0)
    for name, e_in in _PROJECTIONS.items():
        shape = (L, E, -1) if e_in else (L, -1, E)
        state["layers"][name] = jax.tree.map(lambda w: pack(w, shape), state["layers"][name])
    head = "lm_head" if "lm_head" in state else "embed"
    state[head] = jax.tree.map(lambda w: pack(w.T, (1, E, -1)), state[head])
    return state


def _projection_widths(cfg: ModelConfig) -> dict[str, int]:
    """Output columns of each packed projection."""
    E, D = cfg.hidden_size, cfg.head_dim
    return {"qkv": cfg.num_kv_heads * (cfg.q_per_kv + 2) * D, "o": E,
            "gate_up": 2 * cfg.intermediate_size, "down": E}


def _from_bits(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == jnp.uint16 else w


def rms_norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm over the last axis in float32; Gemma's (1 + w) scales in float32 too, Llama's w
    after casting back (both as transformers does it)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    if cfg.norm_offset:
        return (y * (cfg.norm_offset + w.astype(jnp.float32))).astype(x.dtype)
    return w * y.astype(x.dtype)


def _dot(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)


def _layer(cfg: ModelConfig, backend: str, w: dict, h: jax.Array, cache: KVCache, layer,
           md: AttentionMetadata, cos, sin, window, native=None) -> tuple[jax.Array, KVCache]:
    """One layer; `native(name, x2d, out_dtype)`, if given, runs the four projections instead of
    XLA (rounding to the model's dtype itself where nothing is added first)."""
    T, dt = h.shape[0], h.dtype
    K, G, D = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim

    x = rms_norm(h, w["attn_norm"], cfg)
    qkv = (_dot("te,ekgd->tkgd", x, w["qkv"]) if native is None
           else native("qkv", x, jnp.float32 if cfg.qkv_bias else dt).reshape(T, K, G + 2, D))
    if cfg.qkv_bias:
        qkv = qkv + w["qkv_bias"]
    qkv = qkv.astype(dt)
    q, k, v = qkv[:, :, :G].reshape(T, K * G, D), qkv[:, :, G], qkv[:, :, G + 1]
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg), rms_norm(k, w["k_norm"], cfg)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, cache = paged_attention(q, k, v, cache, layer, md, sm_scale=cfg.sm_scale, backend=backend,
                               sliding_window=window, soft_cap=cfg.attn_logit_softcap)
    # As 2-D operands: contracting (k, g, d) as separate axes makes XLA:CPU transpose the
    # weight every step.
    o = o.reshape(T, K * G * D)
    a = (_dot("tn,ne->te", o, w["o"].reshape(K * G * D, -1)) if native is None
         else native("o", o, jnp.float32 if cfg.o_bias else dt))
    if cfg.o_bias:
        a = a + w["o_bias"]
    a = a.astype(dt)
    if cfg.sandwich_norms:
        a = rms_norm(a, w["post_attn_norm"], cfg)
    h = h + a

    x = rms_norm(h, w["mlp_norm"], cfg)
    gate_up = (_dot("te,eaf->taf", x, w["gate_up"]) if native is None
               else native("gate_up", x).reshape(T, 2, -1))
    if cfg.activation == "silu":
        m = (activation_ref.silu_and_mul(gate_up, dt) if native is None
             else activation_cpu.silu_and_mul(gate_up, dt))
    else:
        gate_up = gate_up.astype(dt)
        m = ACTIVATIONS[cfg.activation](gate_up[:, 0]) * gate_up[:, 1]
    m = (_dot("tf,fe->te", m, w["down"]) if native is None else native("down", m, dt)).astype(dt)
    if cfg.sandwich_norms:
        m = rms_norm(m, w["post_mlp_norm"], cfg)
    return h + m, cache


def abstract_decoder(cfg: ModelConfig, attention_backend: str = "reference") -> Decoder:
    """The module with shapes only (nothing allocated); the loader fills in the weights."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Decoder(cfg, attention_backend))


def init_decoder(cfg: ModelConfig, seed: int = 0, attention_backend: str = "reference",
                 shardings=None) -> Decoder:
    """Dummy weights (uniform in +-0.05, norms at identity), created directly with `shardings`."""
    def make():
        with nnx.use_eager_sharding(False):
            return nnx.split(Decoder(cfg, attention_backend, seed))[1]

    graphdef = nnx.graphdef(abstract_decoder(cfg, attention_backend))
    return nnx.merge(graphdef, jax.jit(make, out_shardings=shardings)())
