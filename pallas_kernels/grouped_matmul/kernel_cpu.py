"""Grouped matmul for XLA:CPU (`kernel_cpu.cc` via the XLA FFI), what megablox `gmm` is on TPU:
rows sorted by group (expert), each group against its expert's weights read in place, doing only
the routed work; for the experts of a mixture-of-experts layer.

The weights are the matmul's packed layout (`pallas_kernels.matmul.kernel_cpu.pack`) with the
layer and expert axes flattened into its leading axis, [L * G, S, K', 16 | 32] (`pack` below):
the matmul's `pack`, checks and strips as they are, and one index (layer * G + expert) picks an
expert in place. The CPU backend runs on one device, so nothing shards the experts axis.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi
from pallas_kernels.matmul import kernel_cpu as matmul_cpu

TARGET = "jaxllm_grouped_matmul"
SILU_TARGET = "jaxllm_grouped_matmul_silu"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmGroupedMatmul"),
                                      (SILU_TARGET, "JaxllmGroupedMatmulSilu")))


def pack(w: jax.Array) -> jax.Array:
    """Stacked experts [L, G, K, N] -> the matmul's packed strips of the L * G matrices."""
    L, G, K, N = w.shape
    return matmul_cpu.pack(w.reshape(L * G, K, N))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, layer=0, *, n: int,
                   out_dtype=jnp.float32, gated: bool = False) -> jax.Array:
    """[M, n]: rows of group g (group_sizes[g] consecutive rows of x [M, K], in order; G =
    len(group_sizes) groups) times expert g of layer `layer` of w (`pack`ed from [L, G, K, n]),
    summed in float32 as `matmul_cpu.matmul` sums (a row's bits do not depend on the other
    rows); rows past the groups zero. x bfloat16 stays so against bfloat16 weights, else is
    taken as float32; out_dtype float32 or bfloat16. gated: the experts are gate/up projections
    of 2 n columns, activated in the kernel (`matmul_cpu.matmul`'s gated)."""
    if not available():
        raise RuntimeError("the CPU grouped matmul kernel could not be built (see the log)")
    x = matmul_cpu.operand(x, w, 2 * n if gated else n)
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    call = jax.ffi.ffi_call(SILU_TARGET if gated else TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(x, w, group_sizes.astype(jnp.int32), jnp.asarray(layer, jnp.int32))
