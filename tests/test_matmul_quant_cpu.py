"""The native CPU matmul on quantized weights (`kernel_cpu.matmul_quantized`: int8 or int4
values, per-channel or per-group float32 scales, optional zero points) against a float64
reference of the dequantized weights, its gated form, and its batch invariance.

The kernel is built with the system C++ compiler on first use; a build failure fails these
tests rather than skipping them. (JAXLLM_CPU_MARCH=x86-64-v3 or x86-64-v2 runs them on the
AVX2 or the portable path.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import spread_grid
from jaxllm.layers.quantization import pack_int4
from pallas_kernels.matmul import kernel_cpu

L = 3  # layers in a stack; the tests read the last one


def test_kernel_builds():
    assert kernel_cpu.available(), "the CPU matmul did not build (see the warning in the log)"


def weights(rng, bits, k, n, group, zero):
    """Random quantized weights: (q as integers [L, k, n], the stored form, scale, zero)."""
    G = 1 if group is None else k // group
    top = 127 if bits == 8 else 7
    q = rng.integers(-top - 1, top + 1, (L, k, n))
    scale = (rng.uniform(0.5, 2.0, (L, G, n)) / top).astype(np.float32)
    z = rng.uniform(-top / 2, top / 2, (L, G, n)).astype(np.float32) if zero else None
    stored = pack_int4(q) if bits == 4 else q.astype(np.int8)
    return q, jnp.asarray(stored), jnp.asarray(scale), None if z is None else jnp.asarray(z)


def reference(x, q, scale, zero, layer):
    """float64 x @ ((q - zero) * scale)[layer], and |x| @ (|q| + |zero|) |scale|: the size of
    the terms a float32 sum rounds (tolerances are relative to it, per element)."""
    k = q.shape[1]
    rows = k // scale.shape[1]
    s = np.repeat(np.asarray(scale[layer], np.float64), rows, axis=0)
    z = 0.0 if zero is None else np.repeat(np.asarray(zero[layer], np.float64), rows, axis=0)
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    return x64 @ ((q[layer] - z) * s), np.abs(x64) @ ((np.abs(q[layer]) + np.abs(z)) * s)


def assert_close(got, want, size, what=""):
    err = np.abs(np.asarray(got, np.float64) - want)
    bad = err > 1e-5 * size + 1e-30
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off, worst relative "
                           f"error {(err / np.maximum(size, 1e-30)).max():.2e}")


# M: up to 128 rows (AVX2: 16) stream the strips in panels of up to 8 rows (AVX2: 4), more run
# the widened-tile path (chunks of 48 rows in panels of up to 6, 4). K: per-channel an odd one
# (a padded pair) and one not a multiple of 16; groups of 32 and 128. N: a padded last strip,
# and many strips.
CASES = [(1, 96, 40, None, False), (3, 97, 40, None, True), (4, 576, 200, 32, False),
         (5, 96, 40, None, True), (17, 576, 40, 32, True), (64, 96, 40, 32, False),
         (1, 640, 72, 128, True), (64, 640, 40, 128, True), (3, 70, 1030, None, False),
         (17, 384, 520, 128, False), (150, 97, 40, None, True), (133, 256, 72, 128, False)]


# 48 cases; the default suite runs a spread of 24 that meets every value (conftest.spread_grid).
@pytest.mark.parametrize("m,k,n,group,zero,bits,x_dtype", spread_grid(
    CASES, [8, 4], ["float32", "bfloat16"], keep=2))
def test_matches_the_dequantized_product(m, k, n, group, zero, bits, x_dtype):
    rng = np.random.default_rng([m, k, n, bits])
    q, stored, scale, z = weights(rng, bits, k, n, group, zero)
    packed = kernel_cpu.pack_quantized(stored, scale, z)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    f = jax.jit(lambda x, p, l, out: kernel_cpu.matmul_quantized(x, p, l, n=n, out_dtype=out),
                static_argnums=3)
    for layer in (0, L - 1):
        got = f(x, packed, jnp.int32(layer), jnp.float32)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        assert_close(got, *reference(x, q, scale, z, layer), what=f"layer {layer}")
    # bfloat16 results are the float32 sums rounded, as astype would
    got = f(x, packed, jnp.int32(L - 1), jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(f(x, packed, jnp.int32(L - 1), jnp.float32)
                                             .astype(jnp.bfloat16), np.float32))


# f a multiple of 16: each gate strip beside its up strip (f = 40: the plain product first)
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,f,bits,group,zero", [(1, 96, 48, 8, None, False),
                                                   (3, 97, 40, 4, None, True),
                                                   (17, 576, 64, 4, 32, True),
                                                   (64, 96, 40, 8, 32, False),
                                                   (9, 256, 80, 8, 128, True),
                                                   (140, 96, 48, 4, 32, False),
                                                   (131, 64, 40, 8, None, True)])
def test_gated_is_silu_and_mul_of_the_product(m, k, f, bits, group, zero, x_dtype):
    from pallas_kernels.activation import kernel_cpu as act
    rng = np.random.default_rng([m, k, f])
    _, stored, scale, z = weights(rng, bits, k, 2 * f, group, zero)
    packed = kernel_cpu.pack_quantized(stored, scale, z)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    product = kernel_cpu.matmul_quantized(x, packed, 1, n=2 * f).reshape(m, 2, f)
    for out in (jnp.float32, jnp.bfloat16):
        got = kernel_cpu.matmul_quantized(x, packed, 1, n=f, out_dtype=out, gated=True)
        assert got.dtype == out and got.shape == (m, f)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(act.silu_and_mul(product, out), np.float32))


ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 47, 48, 49, 64, 128, 129)


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits,group,zero", [(8, None, True), (4, 32, True), (4, None, False)])
def test_rows_do_not_depend_on_m(bits, group, zero, x_dtype):
    """Every row of x[:m] @ w is that row of x[:150] @ w bitwise (streamed or widened, any panel
    of rows), f32, bf16 and gated."""
    rng = np.random.default_rng(bits)
    k, f = 192, 48
    _, stored, scale, z = weights(rng, bits, k, 2 * f, group, zero)
    packed = kernel_cpu.pack_quantized(stored, scale, z)
    x = jnp.asarray(rng.standard_normal((150, k), np.float32), x_dtype)
    kinds = {"f32": lambda x: kernel_cpu.matmul_quantized(x, packed, 2, n=2 * f),
             "bf16": lambda x: kernel_cpu.matmul_quantized(x, packed, 2, n=2 * f,
                                                           out_dtype=jnp.bfloat16),
             "gated": lambda x: kernel_cpu.matmul_quantized(x, packed, 2, n=f, gated=True)}
    for kind, fn in kinds.items():
        full = np.asarray(fn(x))
        for m in ROWS:
            np.testing.assert_array_equal(np.asarray(fn(x[:m])), full[:m],
                                          err_msg=f"{kind} m={m}")
        np.testing.assert_array_equal(np.asarray(fn(x[137:138])), full[137:138], err_msg=kind)


def test_packed_layout():
    """pack_quantized's layout: strips of 16 columns stored in groups (int8 2, int4 4), their
    32-byte loads side by side; int8 loads of 2 rows (a zero row for an odd K), int4 loads of 4
    rows (byte 2j + t: row 4b + t in the low nibble, 4b + 2 + t in the high one, plus 8; K padded
    with zeros to a multiple of 4); scales [L, S, G, 16]."""
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (2, 5, 20))  # 2 strips (the second padded), one group
    scale = jnp.asarray(rng.uniform(size=(2, 1, 20)), jnp.float32)
    p8, s8 = kernel_cpu.pack_quantized(jnp.asarray(q, jnp.int8), scale)
    assert p8.shape == (2, 1, 3, 64) and p8.dtype == jnp.int8 and s8.shape == (2, 2, 1, 16)
    loads = np.asarray(p8)[1, 0].reshape(3, 2, 2, 16)  # [pair, strip, row, column]
    np.testing.assert_array_equal(loads[:, 1, :, :4].reshape(6, 4)[:5], q[1, :, 16:])
    assert not loads[2, :, 1].any() and not loads[:, 1, :, 4:].any()
    p4, s4, z4 = kernel_cpu.pack_quantized(jnp.asarray(pack_int4(q)), scale, scale + 1)
    assert p4.shape == (2, 1, 2, 128) and p4.dtype == jnp.uint8
    nibbles = lambda b: (int(b) & 15, int(b) >> 4)  # noqa: E731
    assert nibbles(p4[1, 0, 0, 32 + 7]) == (q[1, 1, 19] + 8, q[1, 3, 19] + 8)  # column 19: j = 3
    assert nibbles(p4[1, 0, 1, 32 + 6]) == (q[1, 4, 19] + 8, 8)  # row 6: padding, zero
    np.testing.assert_array_equal(np.asarray(s4)[1, 1, 0, :4], np.asarray(scale)[1, 0, 16:])
    np.testing.assert_array_equal(np.asarray(z4)[1, 1, 0, :4], np.asarray(scale)[1, 0, 16:] + 1)


def test_refuses_what_it_cannot_run():
    rng = np.random.default_rng(0)
    _, stored, scale, _ = weights(rng, 8, 64, 32, 32, False)
    packed = kernel_cpu.pack_quantized(stored, scale)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(kernel_cpu.matmul_quantized(jnp.ones((1, 64)), packed, L, n=32))
    with pytest.raises(ValueError, match="need n in"):
        kernel_cpu.matmul_quantized(jnp.ones((1, 64)), packed, 0, n=40)
    with pytest.raises(ValueError, match="out_dtype"):
        kernel_cpu.matmul_quantized(jnp.ones((1, 64)), packed, 0, n=32, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="groups of a multiple of 2"):
        kernel_cpu.pack_quantized(stored[:, :63], scale[:, :1].repeat(3, axis=1))
    with pytest.raises(ValueError, match="groups of a multiple of 4"):  # int4: 2 groups of 30
        kernel_cpu.pack_quantized(jnp.asarray(pack_int4(np.zeros((1, 60, 32)))),
                                  jnp.ones((1, 2, 32)))
