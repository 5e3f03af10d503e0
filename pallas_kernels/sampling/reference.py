"""Pure-JAX reference for `kernel_cpu.draw`: the sampler's plain draw (jaxllm/layers/sampler.py
without filters or logits processing), row by row.

A random row scales its logits by 1 / temperature (s = x * (1 / T), m = max(s)), keeps the
tokens with s >= m + log(min_p) (every token for min_p 0), weighs each kept token exp(s - m)
and sums the weights per block of 64 tokens. With u the row's uniform and Z the total, it takes
the first block whose running mass exceeds u * Z, then the first token in it whose running
weight exceeds what is left; a token of zero weight is never taken (rounding falls back to the
last positive one). A greedy row takes its first maximum.
"""

import jax
import jax.numpy as jnp

BLOCK = 64


def _first_above(w, target):
    c = jnp.cumsum(w, -1)
    ok = (c > target[:, None]) & (w > 0)
    last = jnp.max(jnp.where(w > 0, jnp.arange(w.shape[1]), 0), -1)
    return jnp.where(ok.any(-1), jnp.argmax(ok, -1), last)


def draw(logits: jax.Array, temperature: jax.Array, min_p: jax.Array, uniforms: jax.Array,
         greedy: jax.Array) -> jax.Array:
    """int32 [N]: the token of each row of float32 logits [N, V]."""
    x = logits.astype(jnp.float32)
    N, V = x.shape
    pad = -V % BLOCK
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    inv = 1.0 / jnp.where(greedy, 1.0, temperature)
    s = x * inv[:, None]
    m = jnp.max(s, -1)
    tau = m + jnp.log(min_p)
    e = jnp.where(s >= tau[:, None], jnp.exp(s - m[:, None]), 0.0).reshape(N, -1, BLOCK)
    mass = e.sum(-1)
    target = uniforms * mass.sum(-1)
    b = _first_above(mass, target)
    before = jnp.take_along_axis(jnp.cumsum(mass, -1) - mass, b[:, None], 1)[:, 0]
    tok = b * BLOCK + _first_above(jnp.take_along_axis(e, b[:, None, None], 1)[:, 0],
                                   target - before)
    return jnp.where(greedy, jnp.argmax(logits, -1), tok).astype(jnp.int32)
