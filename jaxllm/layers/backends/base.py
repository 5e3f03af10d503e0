"""The op interface a model is written against, and what else a backend decides.

A backend is chosen once at start-up (`jaxllm.layers.backends.make_backend`) and is a static
part of the model: its ops are traced into the step program. Ops take weights as the backend
stored them (`relayout`, applied once at load), so a layout change never leaks into the model.
This base class has no implementations; `ReferenceBackend` (pure XLA) has them all, and the
others override only what they run differently.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.attention import AttentionMetadata, KVCache


class Backend:
    """The ops of one decoder step. Subclasses are frozen dataclasses: hashable, and their
    repr names everything that changes a compiled program (the executable cache keys on it)."""

    name: ClassVar[str]
    # Layer weights the projections read stacked ([layers, ...], with the layer index) rather
    # than as the scan's per-layer slices.
    resident: ClassVar[frozenset] = frozenset()
    # Of those, the ones it also reads stacked when they are quantized (`QuantizedWeight`s of
    # its own layout); other quantized projections arrive as the scan's per-layer slices.
    resident_quantized: ClassVar[frozenset] = frozenset()

    def relayout(self, state: nnx.State, cfg) -> nnx.State:
        """The loaded (logical-layout) state as this backend's ops read it; called once."""
        raise NotImplementedError

    def weight(self, w: jax.Array) -> jax.Array:
        """A stored (scan-sliced) layer weight as the model computes with it (norms, biases)."""
        raise NotImplementedError

    def embed(self, table: jax.Array, ids: jax.Array, width: int) -> jax.Array:
        """Rows `ids` of the stored embedding table: [T, width] in the model's dtype."""
        raise NotImplementedError

    def project(self, x: jax.Array, w: jax.Array, layer, *, n: int, out_dtype,
                bias: Optional[jax.Array] = None) -> jax.Array:
        """x [T, K] @ w -> [T, n], summed in float32, plus bias (flattened to [n]), in
        out_dtype. w is a layer's slice, or the whole stack for `resident` weights (then
        `layer` picks it); its input axes come first, in x's order, its outputs last."""
        raise NotImplementedError

    def lora(self, x: jax.Array, a: jax.Array, b: jax.Array, batch, split=None) -> jax.Array:
        """The LoRA delta of a projection for each token's adapter: x [T, I] -> float32 [T, N]
        (jaxllm/layers/lora.py's lora_delta: a [I..., S, P·R], b [S, R, out...], batch a
        LoraBatch, split the fused parts)."""
        raise NotImplementedError

    def gated_activation(self, gate_up: jax.Array, activation, dtype) -> jax.Array:
        """float32 gate/up [T, 2, F] -> activation(gate) * up [T, F] in dtype (activation: a
        name of reference.ACTIVATIONS, or a callable (gate_up, dtype) -> [T, F])."""
        raise NotImplementedError

    def gated_project(self, x: jax.Array, w: jax.Array, layer, *, n: int, activation: str,
                      dtype) -> jax.Array:
        """A gated MLP's first half: x [T, K] @ w, a fused gate/up projection of 2 n outputs
        (gate, then up), then `gated_activation` -> [T, n] in dtype."""
        gate_up = self.project(x, w, layer, n=2 * n, out_dtype=jnp.float32)
        return self.gated_activation(gate_up.reshape(x.shape[0], 2, n), activation, dtype)

    def moe(self, x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate_up: jax.Array,
            w_down: jax.Array, layer, *, experts: int, ffn: int, activation, dtype,
            expert_parallel: bool, gate_up_bias: Optional[jax.Array] = None) -> jax.Array:
        """The routed experts of a mixture-of-experts layer: x [T, E], each token's top-k
        expert ids [T, k] (int32) and routing weights [T, k] (float32), the stacked experts
        w_gate_up [X, E, 2, F] and w_down [X, F, E] -> sum_k weight * expert(x), float32
        [T, E]. No token is dropped. As `project`'s, the weights are a layer's slice, or the
        whole stack in the backend's layout for `resident` ones (then `layer` picks it; X =
        `experts`, F = `ffn`, which such a layout may not show). expert_parallel: the experts
        are sharded over the mesh's `model` axis (else each expert's F is); see
        `jaxllm.layers.experts`. activation: a name, or a callable (float32 gate/up [N, 2, F],
        dtype) -> [N, F] (`jaxllm.layers.experts.ClampedSwiGLU`). gate_up_bias: [X, 2, F],
        added to each expert's gate/up sums before the activation (None: no biases)."""
        raise NotImplementedError

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer,
                  md: AttentionMetadata, *, sm_scale: float, sliding_window=None,
                  soft_cap: Optional[float] = None,
                  sinks: Optional[jax.Array] = None, attention_chunk=None,
                  kv_scales: Optional[jax.Array] = None) -> tuple[jax.Array, KVCache]:
        """Write this step's k/v [T, Hkv, D] into layer `layer` of the cache, then attend:
        q [T, Hq, D] -> (out [T, Hq, D], updated cache). Layout: see
        pallas_kernels/ragged_paged_attention/reference.py. sinks: None (statically absent)
        or float32 [Hq], one learned logit per head in the softmax denominator (GPT-OSS).
        attention_chunk: None (statically absent) or an int32 scalar, maybe traced (per
        layer; <= 0: none): a query sees only keys of its own chunk (Llama 4).
        kv_scales: None (statically absent: k/v stored as they are) or float32 [2], this
        layer's (k_scale, v_scale), maybe traced (the layer scan's slice): the cache stores
        k / k_scale and v / v_scale (a float8 cache saturates) and attention multiplies
        them back, as vLLM's fp8 KV cache does."""
        raise NotImplementedError

    def mla_attention(self, q: jax.Array, latent: jax.Array, cache: KVCache, layer,
                      md: AttentionMetadata, *, sm_scale: float, kv_lora_rank: int
                      ) -> tuple[jax.Array, KVCache]:
        """Multi-head latent attention (absorbed form) over a paged latent cache: write this
        step's latents [T, R + Dr] into layer `layer` of cache.k ([L, NB, 1, BS, R + Dr];
        cache.v is empty, the latent serves as K and V), then attend with q [T, H, R + Dr]
        -> (out [T, H, R], updated cache). See pallas_kernels/ragged_paged_mla/reference.py."""
        raise NotImplementedError

    def gated_delta_rule(self, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                         beta: jax.Array, rec_state: jax.Array, slots: jax.Array,
                         fresh: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                         decode_only: bool) -> tuple[jax.Array, jax.Array]:
        """The gated delta rule of a linear-attention layer over a ragged batch, each sequence
        continuing from its state slot (or zero where `fresh`) -> (out [T, Hv, Dv] in v's
        dtype, rec_state [N, Hv, Dk, Dv] updated). Layout and math:
        pallas_kernels/gated_delta_rule/reference.py. decode_only: statically one row per
        sequence (the recurrent form alone); else the chunked form runs unless the step's
        sequences all have at most one row."""
        raise NotImplementedError

    def logits(self, hidden: jax.Array, w: jax.Array, vocab: int) -> jax.Array:
        """hidden [N, E] against the stored LM head -> float32 logits [N, vocab]."""
        raise NotImplementedError

    def greedy_head(self, w: jax.Array, vocab: int) -> Optional[Callable]:
        """hidden [N, E] -> int32 [N], the first maximum of `logits`, without the logits; None
        where the backend has no faster way than sampling the logits."""
        raise NotImplementedError

    def draw(self) -> Optional[Callable]:
        """(float32 logits [N, V], temperature, min_p, uniforms, greedy, live [N]) -> int32
        [N]: the sampler's plain draw (pallas_kernels/sampling/reference.py; rows not live
        unread); None where the backend has no faster way than the sampler's XLA path."""
        raise NotImplementedError

    def decode_programs(self, cache_dtype) -> bool:
        """Whether pure-decode steps need programs of their own (`decode_only` metadata)."""
        raise NotImplementedError

    def logit_rows(self, cfg, rows: tuple[int, ...]) -> tuple[int, ...]:
        """The LM-head chunk sizes (of `rows`) the sampler should use."""
        raise NotImplementedError

    def batch_variance(self, cfg, cache_dtype) -> Optional[str]:
        """Why a request's results may depend on the rest of its batch with this backend and
        model (None: they do not, bit for bit; docs/batch_invariance.md). --batch-invariant
        refuses to start with the reason."""
        raise NotImplementedError
