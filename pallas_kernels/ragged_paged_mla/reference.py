"""Pure-JAX ragged paged multi-head latent attention (MLA, absorbed form): the reference.

The cache holds one "head" per token: the latent, kv_lora_rank R values (the normed compressed
KV) then qk_rope_head_dim Dr values (the rotated key shared by all heads), so per token and
layer R + Dr values instead of 2 * heads * head_dim. With W_UK folded into the query
(q_lat = W_UK^T q_nope per head) and W_UV applied after attention, every head attends over the
same latent:

  score(t, s, h) = (q_lat[t, h] . c[s] + q_rope[t, h] . k_rope[s]) * sm_scale
  out[t, h]      = sum_s softmax_s(score) * c[s]                         [T, H, R]

which is multi-query attention with K = the whole latent and V = its first R values. Layout as
pallas_kernels/ragged_paged_attention/reference.py (slot_mapping, block_tables, kv_lens,
cu_q_lens, num_seqs), with latent_cache [L, NB, 1, BS, R + Dr]; this reference runs that
module's ragged paged attention with the latent as both K and V and keeps the first R values of
the output (the Dr extra values it sums are the price of reusing it).
"""

from __future__ import annotations

from typing import Optional

import jax

from pallas_kernels.ragged_paged_attention.reference import ArrayOrInt, ragged_paged_attention


def write_latent(latent_cache: jax.Array, layer: ArrayOrInt, latent: jax.Array,
                 slot_mapping: jax.Array) -> jax.Array:
    """Scatter this step's latents [T, R + Dr] into their slots (slot < 0: padding, dropped)."""
    nb, bs = latent_cache.shape[1], latent_cache.shape[3]
    blk = jax.numpy.where(slot_mapping < 0, nb, slot_mapping // bs)
    return latent_cache.at[layer, blk, 0, slot_mapping % bs].set(
        latent.astype(latent_cache.dtype), mode="drop")


def ragged_paged_mla(q: jax.Array, latent_cache: jax.Array, layer: ArrayOrInt,
                     kv_lens: jax.Array, block_tables: jax.Array, cu_q_lens: jax.Array,
                     num_seqs: jax.Array, *, kv_lora_rank: int, sm_scale: float,
                     q_tile: int = 8, tiles_per_group: int = 8,
                     chunk_blocks: Optional[int] = None) -> jax.Array:
    """q [T, H, R + Dr] (absorbed query, then its rotated part) over a cache that already
    holds this step's latents -> [T, H, R] in q's dtype (causal, as the paged attention)."""
    out = ragged_paged_attention(q, latent_cache, latent_cache, layer, kv_lens, block_tables,
                                 cu_q_lens, num_seqs, sm_scale=sm_scale, q_tile=q_tile,
                                 tiles_per_group=tiles_per_group, chunk_blocks=chunk_blocks)
    return out[..., :kv_lora_rank]
