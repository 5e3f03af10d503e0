"""The pure-XLA backend: every op in plain JAX; the semantics every other backend matches.

On an XLA:CPU platform it also works around two XLA:CPU costs (see `relayout`, `logit_rows`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import AbstractMesh, PartitionSpec as P

from jaxllm.layers.attention import REFERENCE_TILING, AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.experts import (EXPERT_IMPLS, experts_ragged, ragged_dot, row_experts,
                                  tiled_grouped_matmul)
from jaxllm.layers.lora import lora_delta
from jaxllm.layers.quantization import (QuantizedWeight, dequantize, dequantize_experts,
                                        is_mxfp4)
from pallas_kernels.activation import reference as activation_ref
from pallas_kernels.grouped_matmul import mxfp4
from pallas_kernels.gated_delta_rule import reference as gdn_ref
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_mla.reference import ragged_paged_mla, write_latent

ACTIVATIONS = {  # silu: activation_ref.silu_and_mul
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "gelu": partial(jax.nn.gelu, approximate=False),
}


def from_bits(w: jax.Array) -> jax.Array:
    """A weight `weights_as_bits` stored as uint16 back as bfloat16 (others unchanged)."""
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == jnp.uint16 else w


def weights_as_bits(state: nnx.State) -> nnx.State:
    """The state with its bf16 weights (layers, embedding, LM head) stored as their uint16
    bits, for XLA:CPU.

    XLA:CPU converts every bf16 array that enters a while loop (the layer scan, the multi-step
    loop) to f32, whole, on every call: bits pass through untouched and each use converts only
    what it reads, which speeds up decode most at small batches, where the conversion dominates
    (docs/performance.md has the figures).
    """
    def to_bits(w):
        return jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == jnp.bfloat16 else w

    for name in ("layers", "embed", "lm_head"):
        if name in state:
            state[name] = jax.jit(lambda t: jax.tree.map(to_bits, t), donate_argnums=0)(state[name])
    return state


# Routed rows up to which the XLA MXFP4 grouped matmul decodes each row's expert (as many
# decodings as rows, no loop) rather than each tile's (a loop; at most rows + experts tiles).
MXFP4_ROW_DECODE = 8


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(Backend):
    name: ClassVar[str] = "reference"
    mesh: Optional[AbstractMesh] = None  # the model's mesh, if it has several devices

    def relayout(self, state, cfg):
        return weights_as_bits(state) if _on_cpu() else state

    def weight(self, w):
        return from_bits(w)

    def embed(self, table, ids, width):
        return from_bits(jnp.take(table, ids, axis=0))

    def lora(self, x, a, b, batch, split=None):
        return lora_delta(x, from_bits(a), from_bits(b), batch, split)

    def project(self, x, w, layer, *, n, out_dtype, bias=None):
        # As 2-D operands: contracting separate axes made XLA:CPU transpose the weight
        # every step. A quantized weight is dequantized to x's dtype first (XLA fuses it
        # into the dot's operand where the platform can).
        w = (dequantize(w, x.shape[-1], n, x.dtype) if isinstance(w, QuantizedWeight)
             else w.reshape(x.shape[-1], n))
        y = jnp.einsum("tk,kn->tn", x, w, preferred_element_type=jnp.float32)
        return (y if bias is None else y + bias.reshape(n)).astype(out_dtype)

    def gated_activation(self, gate_up, activation, dtype):
        if callable(activation):  # e.g. GPT-OSS's ClampedSwiGLU
            return activation(gate_up, dtype)
        if activation == "silu":
            return activation_ref.silu_and_mul(gate_up, dtype)
        gate_up = gate_up.astype(dtype)
        return ACTIVATIONS[activation](gate_up[:, 0]) * gate_up[:, 1]

    def moe_impl(self, tokens: int, top_k: int, experts: int, dtype) -> str:
        """Which `jaxllm.layers.experts` implementation runs this many tokens (static; the
        CPU backend overrides it with its native grouped matmul).

        Off CPU the grouped matmul (`ragged`). On XLA:CPU `ragged_dot` is a masked dense dot
        over every group (X times the work), so, as scripts/bench_moe.py ranks them
        (docs/performance.md, 'Structured output, MoE and multi-host' and 'Mixture of
        experts'): `gather` while the tokens' experts are few against all of them (it reads
        only those experts); else in float32 the per-expert `loop`, in bf16 `dense`
        (`loop`'s while loop makes XLA:CPU convert each bf16 expert whole); from 64 routed rows
        per expert on average the `tiled` grouped matmul, which does only the routed work and
        then beats both."""
        if not _on_cpu():
            return "ragged"
        if 2 * tokens * top_k <= experts:
            return "gather"
        if tokens * top_k >= 64 * experts:
            return "tiled"
        return "loop" if jnp.dtype(dtype) == jnp.float32 else "dense"

    def grouped_matmul(self, lhs, rhs, group_sizes):
        """The grouped matmul of the `ragged` experts (`jaxllm.layers.experts`); MXFP4 experts
        (`QuantizedWeight`) decoded per tile's expert (`quantized_grouped_matmul`)."""
        if isinstance(rhs, QuantizedWeight):
            return quantized_grouped_matmul(lhs, rhs, group_sizes)
        return ragged_dot(lhs, rhs, group_sizes)

    def moe(self, x, ids, weights, w_gate_up, w_down, layer, *, experts, ffn, activation,
            dtype, expert_parallel, gate_up_bias=None):
        # MXFP4 experts stay 4-bit: the grouped matmul decodes them a tile's expert at a time.
        # Other quantized experts are widened whole, then run as float ones.
        mxfp4 = is_mxfp4(w_gate_up)
        if isinstance(w_gate_up, QuantizedWeight) and not mxfp4:
            w_gate_up = dequantize_experts(w_gate_up, x.shape[1], 2 * ffn, dtype)
            w_gate_up = w_gate_up.reshape(-1, x.shape[1], 2, ffn)
        if isinstance(w_down, QuantizedWeight) and not mxfp4:
            w_down = dequantize_experts(w_down, ffn, x.shape[1], dtype)

        def run(x, ids, weights, w_gate_up, w_down, bias):  # the experts' weights: slices
            X = jax.tree.leaves(w_gate_up)[0].shape[0]
            name = "ragged" if mxfp4 else self.moe_impl(*ids.shape, X, dtype)
            act = lambda gu: self.gated_activation(gu, activation, dtype)  # noqa: E731
            kw = {} if bias is None else {"gate_up_bias": bias}
            if name == "ragged":
                return experts_ragged(x, ids, weights, w_gate_up, w_down, act,
                                      self.grouped_matmul, **kw)
            return EXPERT_IMPLS[name](x, ids, weights, w_gate_up, w_down, act, **kw)

        n = 1 if self.mesh is None else self.mesh.shape["model"]
        split = (w_gate_up.scale if mxfp4 else w_gate_up).shape[0 if expert_parallel else 3]
        # MXFP4 down projections shard their inputs: whole scale groups to each device, or
        # left to XLA's partitioner.
        groups_split = not mxfp4 or expert_parallel or w_down.scale.shape[1] % n == 0
        if n == 1 or split % n or not groups_split:  # one device, or replicated (left to
            # XLA's partitioner)
            return run(x, ids, weights, w_gate_up, w_down, gate_up_bias)

        # Tokens stay replicated (each device has the whole batch after attention): every
        # device runs its shard of the experts (or of every expert's FFN) and a psum adds the
        # partial sums. Ids of experts held elsewhere fall outside the local range and count
        # for nothing there.
        def shard(x, ids, weights, w_gate_up, w_down, *bias):
            if expert_parallel:
                ids = ids - jax.lax.axis_index("model") * jax.tree.leaves(w_gate_up)[0].shape[0]
            return jax.lax.psum(run(x, ids, weights, w_gate_up, w_down, *bias or (None,)),
                                "model")

        specs = ((P("model"), P("model"), P("model")) if expert_parallel
                 else (P(None, None, None, "model"), P(None, "model", None),
                       P(None, None, "model")))  # the gate/up bias [X, 2, F] as the weights
        if mxfp4:  # values and scales sharded alike
            specs = (QuantizedWeight(specs[0], specs[0]), QuantizedWeight(specs[1], specs[1]),
                     specs[2])
        bias = () if gate_up_bias is None else (gate_up_bias,)
        return jax.shard_map(shard, mesh=self.mesh,
                             in_specs=(P(), P(), P(), *specs[:2 + len(bias)]), out_specs=P(),
                             check_vma=False)(x, ids, weights, w_gate_up, w_down, *bias)

    def attention(self, q, k, v, cache: KVCache, layer, md: AttentionMetadata, *, sm_scale,
                  sliding_window=None, soft_cap: Optional[float] = None, sinks=None,
                  attention_chunk=None, kv_scales=None):
        kw = {} if sinks is None else {"sinks": sinks}
        if kv_scales is not None:  # this layer's scales: written divided, read multiplied
            kw.update(k_scale=kv_scales[0], v_scale=kv_scales[1])
        kc, vc = write_kv(cache.k, cache.v, layer, k, v, md.slot_mapping,
                          k_scale=kw.get("k_scale"), v_scale=kw.get("v_scale"))
        if attention_chunk is not None:
            kw["attention_chunk"] = attention_chunk
        return self.attend(q, kc, vc, layer, md, sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap, **kw), KVCache(kc, vc)

    def attend(self, q, kc, vc, layer, md: AttentionMetadata, **kw) -> jax.Array:
        """The attention over caches that already hold this step's k/v."""
        q_tile, groups, keys = REFERENCE_TILING[md.decode_only]
        if md.attend_to is not None:
            kw["attend_to"] = md.attend_to
        return ragged_paged_attention(
            q, kc, vc, layer, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
            q_tile=q_tile, tiles_per_group=groups, chunk_blocks=max(1, keys // kc.shape[3]), **kw)

    def gated_delta_rule(self, q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs,
                         *, decode_only):
        recurrent, chunked = self.delta_rule_forms()
        args = (q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs)
        if decode_only or q.shape[0] == 1:  # one token per sequence: no program for prompts
            return recurrent(*args)
        one_each = jnp.max(cu_q_lens[1:] - cu_q_lens[:-1]) <= 1  # decode steps in any program
        return jax.lax.cond(one_each, lambda: recurrent(*args), lambda: chunked(*args))

    def delta_rule_forms(self):
        """(recurrent, chunked): the two forms of the delta rule this backend runs."""
        return gdn_ref.gated_delta_rule_recurrent, gdn_ref.gated_delta_rule_chunked

    def mla_attention(self, q, latent, cache: KVCache, layer, md: AttentionMetadata, *,
                      sm_scale, kv_lora_rank):
        # The CPU backend runs this XLA reference too (no native MLA kernel yet, so MLA models
        # are not batch-invariant there); the Pallas backend runs its attention kernel.
        kc = write_latent(cache.k, layer, latent, md.slot_mapping)
        q_tile, groups, keys = REFERENCE_TILING[md.decode_only]
        out = ragged_paged_mla(q, kc, layer, md.kv_lens, md.block_tables, md.cu_q_lens,
                               md.num_seqs, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale,
                               q_tile=q_tile, tiles_per_group=groups,
                               chunk_blocks=max(1, keys // kc.shape[3]))
        return out, KVCache(kc, cache.v)

    def logits(self, hidden, w, vocab):
        return jnp.einsum("ne,ve->nv", hidden, from_bits(w), preferred_element_type=jnp.float32)

    def greedy_head(self, w, vocab):
        return None

    def draw(self):
        return None

    def decode_programs(self, cache_dtype):
        return True

    def logit_rows(self, cfg, rows):
        # XLA:CPU runs a bf16 weight against few rows by converting all of it to f32 first
        # (a few rows then take longer than 64): bf16 keeps only the largest chunk there.
        return (max(rows),) if _on_cpu() and cfg.jnp_dtype == jnp.bfloat16 else tuple(rows)

    def batch_variance(self, cfg, cache_dtype):
        return (f"the {self.name} backend's XLA dots pick their summation order by shape, and "
                "a batch's token count picks the shape; use --attention-backend cpu on one "
                "CPU device")


def quantized_grouped_matmul(lhs, rhs: QuantizedWeight, group_sizes) -> jax.Array:
    """The grouped matmul over MXFP4 experts (q [G, K / 2, N], scales [G, K / 32, N]) in XLA,
    decoding only the experts it reads: up to MXFP4_ROW_DECODE rows (small decode steps) each
    row's expert, in float32, in one batched dot (no loop); more rows in
    `tiled_grouped_matmul`, each tile's expert decoded as it is read (in float32 on XLA:CPU,
    whose bf16 dots convert their operands first; else in lhs's dtype), 16-row tiles up to 64
    rows, then 64. Either way as the kernel computes it: lhs's even and odd input columns
    against the low and high nibbles' values, two dots whose operands are each one decoded
    half (XLA:CPU runs a dot of a decoded, re-interleaved whole several times slower). No
    float copy of all experts is made."""
    (M, K), N = lhs.shape, rhs.scale.shape[-1]
    h = K // 2
    x = mxfp4.even_odd(lhs, K)

    def halves(w, dtype):
        return mxfp4.decode_halves(w.q.reshape(h, N), w.scale.reshape(-1, N), dtype)

    if M <= MXFP4_ROW_DECODE:  # (batched dots in float32: XLA:CPU has no batched bf16 one)
        lo, hi = jax.vmap(lambda w: halves(w, jnp.float32))(
            jax.tree.map(lambda a: a[row_experts(group_sizes, M)], rhs))
        x = x.astype(jnp.float32)
        return (jnp.einsum("mk,mkn->mn", x[:, :h], lo)
                + jnp.einsum("mk,mkn->mn", x[:, h:], hi))

    def tile_dot(x, w):
        lo, hi = halves(w, dtype)
        x = x.astype(dtype)
        return (jnp.dot(x[:, :h], lo, preferred_element_type=jnp.float32)
                + jnp.dot(x[:, h:], hi, preferred_element_type=jnp.float32))

    dtype = jnp.float32 if _on_cpu() else lhs.dtype
    return tiled_grouped_matmul(x, rhs, group_sizes, 16 if M <= 64 else 64, tile_dot=tile_dot)
