"""SiLU-and-multiply (the gated MLP's activation) in plain JAX: the semantics the CPU kernel
reproduces."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def silu_and_mul(x: jax.Array, dtype) -> jax.Array:
    """x [T, 2, F] (gate, up) -> silu(gate) * up [T, F] in `dtype`, rounded as transformers'
    bf16 ops are: gate and up in dtype, silu computed in float32 (torch's kernel does), then
    the product."""
    gate, up = x[:, 0].astype(dtype), x[:, 1].astype(dtype)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(dtype) * up
