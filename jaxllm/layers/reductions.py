"""Batch-invariant reductions: a row's sum in an order fixed by the row's length alone.

XLA:CPU picks a reduction's loop (and so its rounding order) by the whole operand's shape:
f32 rows summed 2-7 at a time differed from the same rows summed alone or among 8 or more. A
decode step's token count sets that shape, so a request's RMSNorm, softmax and sampling draw
would depend on how many others were decoding with it. Elementwise adds are never
reassociated (no fast-math), so a tree of them fixes the order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rowsum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed tree of elementwise adds (halves added until one is
    left, zero-padded to a power of two): the same bits for a row whatever the other axes
    hold."""
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(n - 1, 0).bit_length()) - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
