"""LoRA adapters of a whole batch in the step: each token's adapter slot picks its delta.

The adapters live in a fixed number of slots stacked beside each layer projection (filled and
replaced between steps, so a batch may mix adapters, and the base model, with no recompile).
A projection's slots are A [I, S, P·R] and B [S, R, N] (I inputs flattened, S slots, R
--max-lora-rank; a fused projection of P parts, q/k/v or gate/up, holds a rank block per
part in A, and each part's columns of B), each adapter's scaling folded into its B.
punica's BGMV gathers each token's A and B; on XLA a gather of weights per token is a copy
of T weight matrices, so here every token runs through
all S slots' A in one dot (T x I x S·P·R), the products of slots other than the token's are
zeroed, and one dot per part with all B's sums the rest; a step of fewer tokens than slots
gathers each token's adapter instead.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

# Fused projections and the peft modules of each, in the order of their rank blocks.
LORA_PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class LoraBatch(NamedTuple):
    """Each token's adapter slot in a step: int32 [T] (-1 = the base model), as a float32
    one-hot [T, S] (all zero for none), and whether any token has one (bool [])."""
    slots: jax.Array
    mask: jax.Array
    any: jax.Array


def lora_batch(lora_slots: jax.Array, num_slots: int) -> LoraBatch:
    mask = lora_slots[:, None] == jnp.arange(num_slots, dtype=lora_slots.dtype)
    return LoraBatch(lora_slots, mask.astype(jnp.float32), jnp.any(lora_slots >= 0))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, batch: LoraBatch,
               split: Optional[tuple] = None) -> jax.Array:
    """x [T, I] through the adapter in each token's slot: float32 [T, N] =
    (x @ a[:, s]) @ b[s] for the token's slot s, zero for none. a [I..., S, P·R] (the input
    axes as the projection's; a rank block per part), b [S, R, out...] (the output axes as the
    projection's). split (axis, sizes): a fused projection's P parts along output axis `axis`
    (q, k and v heads; gate and up), part p's columns reached only through rank block p, so
    B is stored once, not P times with zeros; None: one part.

    Fewer tokens than slots (small decode steps) gather each token's A and B: T adapters'
    weights are read instead of all S. Otherwise every slot's are read once, as dense dots,
    unless no token has an adapter (a conditional: on XLA:CPU a conditional costs more than a
    small step's gathered delta, so small steps compute theirs)."""
    T = x.shape[0]
    if T < a.shape[-2]:
        return _delta(x, a, b, batch, split)
    zeros = jnp.zeros((T, math.prod(b.shape[2:])), jnp.float32)
    return jax.lax.cond(batch.any, lambda: _delta(x, a, b, batch, split), lambda: zeros)


def _delta(x, a, b, batch, split):
    S, PR = a.shape[-2:]
    R, outs = b.shape[1], b.shape[2:]
    T = x.shape[0]
    axis, sizes = split if split is not None else (0, (outs[0],))
    P = len(sizes)
    a = a.reshape(-1, S, PR)
    f32 = jnp.float32
    if T < S:
        slot = jnp.maximum(batch.slots, 0)
        at = jnp.take(a, slot, axis=1).astype(x.dtype)  # [I, T, P·R]
        xa = jnp.einsum("ti,itr->tr", x, at, preferred_element_type=f32)
        xa = (xa * (batch.slots >= 0)[:, None]).astype(b.dtype).reshape(T, P, R)
        b = jnp.take(b, slot, axis=0)  # [T, R, out...]
    else:
        xa = jnp.dot(x, a.reshape(-1, S * PR).astype(x.dtype), preferred_element_type=f32)
        xa = (xa.reshape(T, S, P, R) * batch.mask[:, :, None, None]).astype(b.dtype)
    pieces, lo = [], 0
    for p, size in enumerate(sizes):
        bp = jax.lax.slice_in_dim(b, lo, lo + size, axis=2 + axis)
        lo += size
        shape = bp.shape[2:]
        if T < S:
            d = jnp.einsum("tr,trm->tm", xa[:, p], bp.reshape(T, R, -1),
                           preferred_element_type=f32)
        else:
            d = jnp.dot(xa[:, :, p].reshape(T, S * R), bp.reshape(S * R, -1),
                        preferred_element_type=f32)
        pieces.append(d.reshape(T, *shape))
    delta = pieces[0] if P == 1 else jnp.concatenate(pieces, axis=1 + axis)
    return delta.reshape(T, -1)


def write_slot(stack: jax.Array, value: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """The stacked slots `stack` with slot `slot` (a traced index: one program for every
    slot) along `axis` replaced by `value` (the stack without that axis), cast to the
    stack's dtype; a stack of bf16 weights kept as their uint16 bits (the CPU backends'
    `weights_as_bits`) gets the value's bits."""
    if stack.dtype == jnp.uint16:
        value = jax.lax.bitcast_convert_type(value.astype(jnp.bfloat16), jnp.uint16)
    return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), slot, axis)


def fill_slot(layers, slot: int, weights: dict, write: Callable) -> None:
    """Write an adapter into slot `slot` of every layer group's stacks (`layers`: the model
    state's layer groups, updated in place). weights: {(layer group, projection): (A [L,
    in..., R], B [L, R, out...])}, the slot layout of jaxllm/loader/lora.py; the projections
    it leaves out get zeros. write: jitted `write_slot` (the stack donated)."""
    for g, group in layers.items():
        for name in [k[:-len("_lora_a")] for k in group if str(k).endswith("_lora_a")]:
            a_stack, b_stack = group[f"{name}_lora_a"], group[f"{name}_lora_b"]
            a, b = weights.get((g, name)) or (
                np.zeros(a_stack.shape[:-2] + a_stack.shape[-1:], np.float32),
                np.zeros(b_stack.shape[:1] + b_stack.shape[2:], np.float32))
            for stack, value, axis in ((a_stack, a, a_stack.ndim - 2), (b_stack, b, 1)):
                stack.set_value(write(stack.get_value(), value, np.int32(slot), axis))
