"""The experts of a mixture-of-experts layer, in plain JAX: five ways to compute the same sum.

Every function takes the tokens x [T, E], each token's top-k experts `ids` [T, k] (int32) and
routing `weights` [T, k] (float32), the stacked expert weights w_gate_up [X, E, 2, F] and
w_down [X, F, E], and `act` (float32 gate/up [N, 2, F] -> [N, F] in the model's dtype), and
returns sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) [T, E] in float32; `gate_up_bias`
[X, 2, F] (GPT-OSS; None: none) is added to each expert's gate/up sums before `act`. No token
is ever dropped (no capacity factor). An id outside [0, X) contributes nothing: that is how an expert-
sharded caller leaves out the experts another device holds.

  ragged  tokens sorted by expert, `lax.ragged_dot` over the groups, un-sorted (TPU/GPU lower
          it to a grouped matmul; XLA:CPU to a masked dense dot over all X groups)
  tiled   as ragged, with the grouped matmul a loop over row tiles (`tiled_grouped_matmul`):
          the routed FLOPs plus at most a tile per expert, in small matmuls (many tokens)
  dense   every token through every expert (one einsum), then the routing weights pick
          (X/k times the FLOPs of the routed sum, but no sort and few large dots)
  loop    as dense, but one 2-D matmul per expert over its weights in place (`lax.map`)
  gather  each token's k experts' weights gathered (reads only the experts used: few tokens)

Which one a backend runs, and for which batch size, is the backend's decision
(`jaxllm.layers.backends`; the CPU backend runs `experts_sorted` on its native grouped matmul);
scripts/bench_moe.py measures them.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxllm.layers.quantization import QuantizedWeight

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation, as an `activation` the backends' gated ops accept: float32
    gate/up [N, 2, F] -> (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit), in dtype. (The checkpoints interleave gate and up columns; the
    loader separates them into the [2, F] layout.)"""
    alpha: float
    limit: float

    def __call__(self, gate_up: jax.Array, dtype) -> jax.Array:
        gate = jnp.minimum(gate_up[:, 0], self.limit)
        up = jnp.clip(gate_up[:, 1], -self.limit, self.limit)
        return ((up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))).astype(dtype)


def row_experts(sizes: jax.Array, rows: int) -> jax.Array:
    """The expert of each of `rows` rows sorted by expert (sizes[g] rows for expert g; rows
    past the groups get the last expert, their results unused)."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right"),
                       sizes.shape[0] - 1)


def ragged_dot(lhs, rhs, group_sizes) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=F32)


def tiled_grouped_matmul(lhs, rhs, group_sizes, tile: int = 16,
                         tile_dot: Optional[Callable] = None) -> jax.Array:
    """`ragged_dot` as a loop over `tile`-row tiles: each group's rows padded to whole tiles,
    then one [tile, K] x [K, N] matmul per tile with its group's rhs read in place, for only the
    tiles the groups fill (at most M / tile + G). XLA:CPU runs ragged_dot as a dense dot over
    every group; this does ~1/G of that work once groups hold a few tiles each.
    tile_dot: rhs is then a pytree of stacked [G, ...] arrays (a `QuantizedWeight`) and
    tile_dot(rows [tile, K], its group g) -> float32 [tile, N] the rows times that group's
    matrix: quantized experts decoded one tile's expert at a time, never all at once."""
    M, K = lhs.shape
    G = group_sizes.shape[0]
    if tile_dot is None:
        def tile_dot(x, w):
            return jnp.dot(x, w, preferred_element_type=F32)
    N = jax.eval_shape(tile_dot, lhs[:tile], jax.tree.map(lambda a: a[0], rhs)).shape[1]
    starts = jnp.cumsum(group_sizes) - group_sizes
    tiles = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    P = (M // tile + G) * tile  # padded rows, at most
    group = jnp.searchsorted(starts + group_sizes, jnp.arange(M), side="right")  # G: past all
    g = jnp.minimum(group, G - 1)
    rows = jnp.where(group < G, (tile_ends[g] - tiles[g]) * tile + jnp.arange(M) - starts[g],
                     P)  # each row's place in the padded groups; rows past them: a spare row
    padded = jnp.zeros((P + 1, K), lhs.dtype).at[rows].set(lhs)[:P]
    tile_group = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(P // tile), side="right"),
                             G - 1)

    def one_tile(t, out):
        y = tile_dot(jax.lax.dynamic_slice_in_dim(padded, t * tile, tile),
                     jax.tree.map(lambda a: a[tile_group[t]], rhs))
        return jax.lax.dynamic_update_slice_in_dim(out, y, t * tile, 0)

    out = jax.lax.fori_loop(0, tile_ends[-1], one_tile, jnp.zeros((P, N), F32))
    return out[jnp.minimum(rows, P - 1)]


def experts_ragged(x, ids, weights, w_gate_up, w_down, act: Callable,
                   grouped_matmul: Callable = ragged_dot,
                   gate_up_bias: Optional[jax.Array] = None) -> jax.Array:
    """grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> float32 [M, N]: rows of
    group g times rhs[g]; rows past the groups may hold anything (they are zeroed here). The
    weights may be `QuantizedWeight`s (the grouped matmul then reads them so: MXFP4), whose
    scales show the float layout's axes but the input's."""
    X, _, _, F = (w_gate_up.scale if isinstance(w_gate_up, QuantizedWeight)
                  else w_gate_up).shape
    w_gu = jax.tree.map(lambda a: a.reshape(X, a.shape[1], 2 * F), w_gate_up)

    def up(xs, sizes):
        gu = grouped_matmul(xs, w_gu, sizes).reshape(-1, 2, F)
        if gate_up_bias is not None:
            gu = gu + jnp.asarray(gate_up_bias)[row_experts(sizes, gu.shape[0])].astype(F32)
        return act(gu)

    return experts_sorted(x, ids, weights, X, up, lambda h, sizes: grouped_matmul(h, w_down, sizes))


def experts_sorted(x, ids, weights, experts: int, up: Callable, down: Callable) -> jax.Array:
    """The routed sum with the token-expert rows sorted by expert: up(xs [M, E], sizes [X]) ->
    the activated gate/up h [M, F] and down(h, sizes) -> float32 [M, E] run each expert's rows
    (sizes[g] consecutive rows for expert g; rows past the groups may hold anything) against
    its weights, in whatever layout they hold them (`experts_ragged`; the CPU backend's packed
    experts, activated in its grouped matmul)."""
    T, k = ids.shape
    X = experts
    flat = jnp.where((ids >= 0) & (ids < X), ids, X).reshape(-1)  # others sort last, unused
    order = stable_order(flat, X)
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    y = down(up(x[order // k], sizes), sizes)
    # Un-sorted by a gather (row i of the routed pairs sits at pos[i]) that XLA fuses with the
    # mask and the weighting, where a scatter into zeros is a separate, slower pass on XLA:CPU
    # (docs/performance.md, "Where a step's time goes, per op, and the routing's sort").
    pos = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    y = jnp.where((flat < X)[:, None], y[pos], 0.0).reshape(T, k, -1)
    # Elementwise, in k's order: a row's sum never depends on T (a dot's order might).
    return sum(y[:, j] * weights[:, j, None] for j in range(k))


def stable_order(flat, experts: int) -> jax.Array:
    """argsort(flat, stable=True) for ids in [0, experts]: one sort of unique int32 keys
    (id * n + index), which XLA:CPU runs without the stable sort's index operand and comparator,
    several times faster (docs/performance.md, "Where a step's time goes, per op, and the
    routing's sort")."""
    n = flat.size
    if (experts + 1) * n >= 2 ** 31:
        return jnp.argsort(flat, stable=True).astype(jnp.int32)
    return jnp.sort(flat * n + jnp.arange(n, dtype=jnp.int32)) % n


def experts_dense(x, ids, weights, w_gate_up, w_down, act: Callable, gate_up_bias=None
                  ) -> jax.Array:
    T = x.shape[0]
    X, _, _, F = w_gate_up.shape
    gu = jnp.einsum("te,xegf->txgf", x, w_gate_up, preferred_element_type=F32)
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.astype(F32)[None]
    return _weighted_down(act(gu.reshape(T * X, 2, F)).reshape(T, X, F), ids, weights, w_down)


def experts_loop(x, ids, weights, w_gate_up, w_down, act: Callable, gate_up_bias=None
                 ) -> jax.Array:
    T = x.shape[0]
    X, E, _, F = w_gate_up.shape
    gu = jax.lax.map(lambda w: jnp.dot(x, w.reshape(E, 2 * F), preferred_element_type=F32),
                     w_gate_up)  # [X, T, 2F]: one 2-D matmul per expert, weights read in place
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.astype(F32).reshape(X, 1, 2 * F)
    h = act(gu.reshape(X * T, 2, F)).reshape(X, T, F).transpose(1, 0, 2)
    return _weighted_down(h, ids, weights, w_down)


def _weighted_down(h, ids, weights, w_down):
    """h [T, X, F] (every token's activations in every expert) -> the routed sum [T, E]: the
    routing weights scale h first, so the down projection is one 2-D matmul over (X, F)."""
    T, X, F = h.shape
    combine = jnp.einsum("tkx,tk->tx", jax.nn.one_hot(ids, X, dtype=F32), weights)
    hw = (h.astype(F32) * combine[:, :, None]).astype(h.dtype).reshape(T, X * F)
    return jnp.dot(hw, w_down.reshape(X * F, -1), preferred_element_type=F32)


def experts_gather(x, ids, weights, w_gate_up, w_down, act: Callable, gate_up_bias=None
                   ) -> jax.Array:
    T, k = ids.shape
    X, _, _, F = w_gate_up.shape
    used = (ids >= 0) & (ids < X)
    ids, weights = jnp.where(used, ids, 0), jnp.where(used, weights, 0.0)
    # In float32: XLA:CPU has no batched bf16 x bf16 -> f32 dot (`UNIMPLEMENTED ... DotThunk`),
    # and only k experts' weights per token are converted.
    gu = jnp.einsum("te,tkegf->tkgf", x.astype(F32), w_gate_up[ids].astype(F32))
    if gate_up_bias is not None:
        gu = gu + jnp.asarray(gate_up_bias)[ids].astype(F32)
    h = act(gu.reshape(T * k, 2, F)).reshape(T, k, F)
    y = jnp.einsum("tkf,tkfe->tke", h.astype(F32), w_down[ids].astype(F32))
    return jnp.einsum("tke,tk->te", y, weights)


EXPERT_IMPLS = {"ragged": experts_ragged, "dense": experts_dense, "loop": experts_loop,
                "gather": experts_gather,
                "tiled": partial(experts_ragged, grouped_matmul=tiled_grouped_matmul)}
