"""Pure-JAX reference for `kernel_cpu.grouped_matmul`: `jax.lax.ragged_dot` on the weights
before `pack`, one layer's experts."""

import jax
import jax.numpy as jnp


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, layer=0) -> jax.Array:
    """float32 [M, N]: rows of group g (group_sizes[g] consecutive rows, in order) times
    w[layer, g] ([L, G, K, N] in float32, bfloat16 or its uint16 bits); rows past the groups
    zero."""
    if w.dtype == jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    x = x.astype(jnp.float32)
    return jax.lax.ragged_dot(x, w[layer].astype(jnp.float32), group_sizes,
                              precision=jax.lax.Precision.HIGHEST)
