"""The native CPU grouped matmul (pallas_kernels/grouped_matmul/kernel_cpu.cc via the XLA FFI)
against its reference (`jax.lax.ragged_dot`), its rows' batch invariance, and the CPU backend's
MoE experts on it against the XLA `ragged` experts.

The kernel is built with the system C++ compiler on first use; CI has one, so a build failure
fails these tests rather than skipping them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import spread_grid
from pallas_kernels.grouped_matmul import kernel_cpu, reference


def test_kernel_builds():
    assert kernel_cpu.available(), "the CPU grouped matmul did not build (see the log)"


def _weights(rng, shape, dtype):
    w = jnp.asarray(rng.standard_normal(shape, np.float32),
                    jnp.float32 if dtype == "float32" else jnp.bfloat16)
    return jax.lax.bitcast_convert_type(w, jnp.uint16) if dtype == "bits" else w


# Groups of 0 rows (no expert read), 1-4 rows (streamed strips), 5+ (register-blocked, a second
# 48-row block past 48); rows past the groups (another device's experts) must come back zero.
# Odd K (bf16 pairs padded), N not a multiple of the 16-column strip.
# 24 cases; the default suite runs a spread of 12 that meets every value (conftest.spread_grid).
@pytest.mark.parametrize("k,n,sizes,extra,dtype,x_dtype", spread_grid([
    (37, 70, [3, 0, 20, 1, 10], 6),
    (64, 130, [0, 0, 0, 0], 5),
    (33, 1030, [1, 2, 3, 4, 0, 0, 5], 0),
    (600, 40, [55, 0, 7], 2),
], ["float32", "bfloat16", "bits"], ["float32", "bfloat16"], keep=2))
def test_kernel_matches_ragged_dot(k, n, sizes, extra, dtype, x_dtype):
    rng = np.random.default_rng(k + n + len(sizes))
    L, G = 3, len(sizes)
    w = _weights(rng, (L, G, k, n), dtype)
    m = sum(sizes) + extra
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    packed = kernel_cpu.pack(w)
    f = jax.jit(lambda x, w, g, l: kernel_cpu.grouped_matmul(x, w, g, l, n=n))
    for layer in (0, L - 1):
        got = np.asarray(f(x, packed, gs, jnp.int32(layer)))
        want = np.asarray(reference.grouped_matmul(x, w, gs, layer))
        assert got.shape == (m, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
        np.testing.assert_array_equal(got[sum(sizes):], 0.0)
    # a bf16 result is the f32 one rounded
    got16 = kernel_cpu.grouped_matmul(x, packed, gs, 1, n=n, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got16.astype(jnp.float32)),
                                  np.asarray(f(x, packed, gs, 1).astype(jnp.bfloat16)
                                             .astype(jnp.float32)))


# Gated (the experts' gate/up activated in the kernel): the bits of the plain product's
# silu_and_mul, in f32 and bf16; F a multiple of 16 pairs each gate strip with its up strip in
# one AMX block, F = 40 takes the plain product first. Groups span 1-4 rows and 32-row blocks.
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k,f,sizes", [(37, 40, [3, 0, 20, 1]), (64, 96, [1, 40, 0, 33]),
                                       (512, 1024, [70, 5])])
def test_gated_is_silu_and_mul_of_the_product(k, f, sizes, x_dtype):
    from pallas_kernels.activation import kernel_cpu as act
    rng = np.random.default_rng(k + f)
    w = kernel_cpu.pack(_weights(rng, (2, len(sizes), k, 2 * f), "bfloat16") * 0.2)
    m = sum(sizes) + 3
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    product = kernel_cpu.grouped_matmul(x, w, gs, 1, n=2 * f).reshape(m, 2, f)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = kernel_cpu.grouped_matmul(x, w, gs, 1, n=f, out_dtype=dtype, gated=True)
        assert got.shape == (m, f) and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(act.silu_and_mul(product, dtype), np.float32))
        np.testing.assert_array_equal(np.asarray(got[sum(sizes):], np.float32), 0.0)


def test_kernel_refuses_groups_past_x_rows_and_layers():
    rng = np.random.default_rng(0)
    w = kernel_cpu.pack(_weights(rng, (2, 3, 8, 16), "float32"))
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(Exception, match="groups exceed"):
        kernel_cpu.grouped_matmul(x, w, jnp.asarray([2, 2, 1], jnp.int32), n=16).block_until_ready()
    with pytest.raises(Exception, match="layer out of range"):
        kernel_cpu.grouped_matmul(x, w, jnp.asarray([1, 1, 1], jnp.int32), 2,
                                  n=16).block_until_ready()


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", ["float32", "bits"])
@pytest.mark.parametrize("k", [37, 1000])  # bf16 x on AMX: K in one part tile; 31 and a part
def test_rows_do_not_depend_on_the_other_rows(dtype, x_dtype, k):
    """A group's row gives the same bits alone, with other rows in its group (streamed 1-4
    rows or register-blocked), and among other groups: batch invariance (issue 26)."""
    rng = np.random.default_rng(5)
    G, n = 4, 150
    w = _weights(rng, (1, G, k, n), dtype)
    packed = kernel_cpu.pack(w)
    f = jax.jit(lambda x, g: kernel_cpu.grouped_matmul(x, packed, g, n=n))
    rows = jnp.asarray(rng.standard_normal((60, k), np.float32), x_dtype)
    target = rows[:1]
    for g in range(G):  # the target row alone in group g
        alone = np.asarray(f(target, jnp.asarray(np.eye(G, dtype=np.int32)[g])))[0]
        for before, with_it in ((0, 0), (0, 3), (2, 3), (7, 30), (0, 50)):
            # `before` rows of groups < g, then the target and `with_it` more rows of group g
            sizes = np.zeros(G, np.int32)
            if g:
                sizes[0] = before
            sizes[g] += 1 + with_it
            x = jnp.concatenate([rows[1:1 + (before if g else 0)], target,
                                 rows[1:1 + with_it], rows[:5]])  # 5 rows past the groups
            got = np.asarray(f(x, jnp.asarray(sizes)))[before if g else 0]
            np.testing.assert_array_equal(got, alone, err_msg=f"group {g} {before} {with_it}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 9, 64])
def test_cpu_backend_experts_match_ragged(dtype, tokens):
    """The CPU backend's `moe` on packed experts (resident: the whole stack, a layer index)
    gives the XLA `ragged` experts' sum over that layer's weights."""
    from jaxllm.layers.backends.cpu import CpuBackend, pack_native
    from jaxllm.layers.backends.reference import ReferenceBackend

    rng = np.random.default_rng(tokens)
    L, X, E, F, k = 2, 8, 48, 40, 2
    dt = jnp.dtype(dtype)
    gu = jnp.asarray(rng.standard_normal((L, X, E, 2, F)) / 4, dt)
    down = jnp.asarray(rng.standard_normal((L, X, F, E)) / 4, dt)
    cfg = type("Cfg", (), {"hidden_size": E})()
    state = pack_native({"layers": {"g": {"experts_gate_up": gu + 0, "experts_down": down + 0}}},
                        cfg)["layers"]["g"]
    x = jnp.asarray(rng.standard_normal((tokens, E)), dt)
    ids = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(tokens)]),
                      jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    cpu = CpuBackend.create()
    assert cpu.native_matmul and cpu.moe_impl(tokens, k, X, dtype) == "grouped"
    assert {"experts_gate_up", "experts_down"} <= cpu.resident
    kw = dict(experts=X, ffn=F, activation="silu", dtype=dt, expert_parallel=False)
    got = jax.jit(lambda *a: cpu.moe(*a, **kw))(x, ids, weights, state["experts_gate_up"],
                                                state["experts_down"], jnp.int32(1))
    ref = ReferenceBackend()
    want = jax.jit(lambda *a: ref.moe(*a, **kw))(x, ids, weights, gu[1], down[1], 1)
    assert np.abs(np.asarray(want)).max() > 0.1
    # bf16: both round gate/up's activation to bf16, from sums in different orders
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol,
                               atol=tol * np.abs(np.asarray(want)).max())
