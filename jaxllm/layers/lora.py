"""LoRA adapters of a whole batch in the step: each token's adapter slot picks its delta.

The adapters live in a fixed number of slots stacked beside each layer projection (filled and
replaced between steps, so a batch may mix adapters, and the base model, with no recompile).
A projection's slots are A [I, S, R] and B [S, R, N] (I inputs flattened, S slots, R the rank
budget of the projection: fused projections hold a block of rank per part, e.g. q, k and v),
each adapter's scaling folded into its B. punica's BGMV gathers each token's A and B; on XLA a
gather of weights per token is a copy of T weight matrices, so here every token runs through
all S slots' A in one dot (T x I x S·R, small beside the projection itself), the products of
slots other than the token's are zeroed, and one dot with all B's sums the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Fused projections and the peft modules of each, in the order of their rank blocks.
LORA_PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def slot_mask(lora_slots: jax.Array, num_slots: int, dtype) -> jax.Array:
    """Each token's slot (int32 [T], -1 = the base model) as a one-hot [T, S] in dtype."""
    return (lora_slots[:, None] == jnp.arange(num_slots, dtype=lora_slots.dtype)).astype(dtype)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """x [T, I] through the adapter in each token's slot: float32 [T, N] =
    (x @ a[:, s]) @ b[s] for the token's slot s (mask [T, S], `slot_mask`), zero for none.
    a [I..., S, R] (the input axes as the projection's), b [S, R, N...]."""
    S, R = a.shape[-2:]
    T = x.shape[0]
    xa = jnp.dot(x, a.reshape(-1, S * R).astype(x.dtype), preferred_element_type=jnp.float32)
    xa = (xa.reshape(T, S, R) * mask[:, :, None].astype(jnp.float32)).astype(b.dtype)
    return jnp.dot(xa.reshape(T, S * R), b.reshape(S * R, -1),
                   preferred_element_type=jnp.float32)


def write_slot(stack: jax.Array, value: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """The stacked slots `stack` with slot `slot` (a traced index: one program for every
    slot) along `axis` replaced by `value` (the stack without that axis), cast to the
    stack's dtype; a stack of bf16 weights kept as their uint16 bits (the CPU backends'
    `weights_as_bits`) gets the value's bits."""
    if stack.dtype == jnp.uint16:
        value = jax.lax.bitcast_convert_type(value.astype(jnp.bfloat16), jnp.uint16)
    return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), slot, axis)
