"""Pure-JAX reference for `kernel_cpu.matmul`, on the weights before `pack`."""

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array, layer=0) -> jax.Array:
    """float32 x [M, K] @ w[layer] ([L, K, N] in float32, bfloat16 or its uint16 bits)."""
    if w.dtype == jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return x.astype(jnp.float32) @ w[layer].astype(jnp.float32)
