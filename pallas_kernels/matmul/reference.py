"""Pure-JAX reference for `kernel_cpu.matmul`."""

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array, layer=0, *, transposed: bool = False) -> jax.Array:
    if w.dtype == jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    wl = w[layer].astype(jnp.float32)
    return x.astype(jnp.float32) @ (wl.T if transposed else wl)
