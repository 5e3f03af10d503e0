"""The native CPU few-row matmul (pallas_kernels/matmul/kernel_cpu.cc via the XLA FFI) against
its pure-JAX reference, and the decoder's use of it against XLA's dots.

The kernel is built with the system C++ compiler on first use; CI has one, so a build failure
fails these tests rather than skipping them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spread_grid
from flax import nnx

from pallas_kernels.matmul import kernel_cpu, reference


def test_kernel_builds():
    assert kernel_cpu.available(), "the CPU matmul did not build (see the warning in the log)"


# K not a multiple of the accumulators a strip run unrolls, N not a multiple of the 16-column
# strip (a zero-padded last strip). m past 4 runs the register-blocked path: 6-row blocks and a
# remainder, 64-column tiles and a part tile (32-column ones when 64-column ones would not share
# evenly: n = 130, 576), K in 256-long chunks and a part chunk (k = 600), past 48 rows a second
# block of rows. bf16 x against bf16 weights runs the native bf16 dot product where the CPU has it
# (AMX tiles of 16 rows and 32 k, or AVX512_BF16): K in pairs, an odd K padded.
# 60 cases; the default suite runs a spread of 15 that meets every value (conftest.spread_grid),
# as do the grids below (half of each).
@pytest.mark.parametrize("dtype,m,k,n,x_dtype", spread_grid(
    ["float32", "bfloat16", "bits"],
    [(1, 768, 1280), (3, 37, 1030), (4, 130, 7), (2, 5, 2311), (5, 33, 100), (13, 64, 130),
     (64, 96, 200), (64, 96, 576), (70, 600, 150), (9, 601, 40)],
    ["float32", "bfloat16"], keep=4))
def test_kernel_matches_reference(m, k, n, dtype, x_dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    L = 3
    w = jnp.asarray(rng.standard_normal((L, k, n), np.float32),
                    jnp.float32 if dtype == "float32" else jnp.bfloat16)
    if dtype == "bits":
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    packed = kernel_cpu.pack(w)
    strips = -(-n // 16)
    assert packed.shape == ((L, strips, k, 16) if dtype == "float32" else
                            (L, strips, -(-k // 2), 32))  # bf16: rows in pairs
    np.testing.assert_array_equal(np.asarray(kernel_cpu.unpack(packed, k, n)), np.asarray(w))
    f = jax.jit(lambda x, w, l: kernel_cpu.matmul(x, w, l, n=n))
    for layer in (0, L - 1):
        got = f(x, packed, jnp.int32(layer))
        want = reference.matmul(x, w, layer)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=1e-5 * np.sqrt(k))


# Streaming (m <= 4) and register-blocked rows, part tiles, a second block of rows (m = 70),
# K in several chunks summed in the scratch (k = 600: f32 256-row chunks; 2100: bf16 1024 pairs).
@pytest.mark.parametrize("dtype,m,k,n,x_dtype", spread_grid(
    ["float32", "bits"],
    [(1, 768, 1280), (3, 37, 1030), (13, 64, 130), (70, 600, 150), (64, 96, 200), (6, 2100, 40)],
    ["float32", "bfloat16"], keep=2))
def test_bf16_result_is_the_f32_result_rounded(m, k, n, dtype, x_dtype):
    """out_dtype=bfloat16 rounds the very sums of the float32 result, as astype would."""
    rng = np.random.default_rng(m + k + n)
    w = jnp.asarray(rng.standard_normal((2, k, n), np.float32))
    if dtype == "bits":
        w = jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    packed = kernel_cpu.pack(w)
    f = jax.jit(lambda x, w, out_dtype: kernel_cpu.matmul(x, w, 1, n=n, out_dtype=out_dtype),
                static_argnums=2)
    got, f32 = f(x, packed, jnp.bfloat16), f(x, packed, jnp.float32)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(f32.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("dtype,m,k,f,x_dtype", spread_grid(
    ["float32", "bits"], [(1, 768, 1024), (3, 37, 40), (13, 64, 96), (70, 600, 48), (33, 96, 1536)],
    ["float32", "bfloat16"], keep=2))
def test_gated_is_silu_and_mul_of_the_product(m, k, f, dtype, x_dtype):
    """gated=True gives the bits of silu_and_mul on the float32 product of the 2 f columns, f32
    and bf16 (f a multiple of 16: each gate strip beside its up strip in the tile loop; 40: the
    plain product first)."""
    from pallas_kernels.activation import kernel_cpu as act
    rng = np.random.default_rng(m + k + f)
    w = jnp.asarray(rng.standard_normal((2, k, 2 * f), np.float32) * 0.2)
    if dtype == "bits":
        w = jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    packed = kernel_cpu.pack(w)
    product = kernel_cpu.matmul(x, packed, 1, n=2 * f).reshape(m, 2, f)
    for out in (jnp.float32, jnp.bfloat16):
        got = kernel_cpu.matmul(x, packed, 1, n=f, out_dtype=out, gated=True)
        assert got.dtype == out and got.shape == (m, f)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(act.silu_and_mul(product, out), np.float32))


@pytest.mark.parametrize("dtype,m,k,n,x_dtype", spread_grid(
    ["float32", "bits"],
    [(1, 64, 1000), (3, 37, 1030), (13, 64, 130), (70, 96, 2311), (64, 96, 200)],
    ["float32", "bfloat16"], keep=2))
def test_argmax_is_the_first_maximum_of_the_f32_result(m, k, n, dtype, x_dtype):
    """The greedy LM head: jnp.argmax of the float32 result, also where columns tie (equal
    weight columns give equal products: the first one wins, across strips and within one)."""
    rng = np.random.default_rng(m + k + n)
    w = rng.standard_normal((1, k, n), np.float32)
    w[..., n - 1] = w[..., 5]  # ties across strips, one in the zero-padded last strip
    w[..., 7] = w[..., 5]      # and within a strip
    w = jnp.asarray(w)
    if dtype == "bits":
        w = jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16)
    x = rng.standard_normal((m, k), np.float32)
    x[0] = np.asarray(w if dtype == "float32" else jax.lax.bitcast_convert_type(
        w, jnp.bfloat16).astype(jnp.float32))[0, :, 5] * 10  # row 0's maximum: column 5
    x = jnp.asarray(x, x_dtype)
    packed = kernel_cpu.pack(w)
    got = jax.jit(lambda x, w: kernel_cpu.argmax(x, w, 0, n=n))(x, packed)
    f32 = jax.jit(lambda x, w: kernel_cpu.matmul(x, w, 0, n=n))(x, packed)
    assert got.dtype == jnp.int32 and got.shape == (m,)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(f32, axis=1)))
    assert int(got[0]) == 5


@pytest.mark.parametrize("dtype", ["float32", "bits"])
def test_packed_rows_are_the_rows_of_the_packed_transpose(dtype):
    """An embedding packed as LM head ([V, E] -> pack of [1, E, V]) is looked up in place."""
    rng = np.random.default_rng(0)
    emb = jnp.asarray(rng.standard_normal((37, 25), np.float32),  # odd: a padded pair
                      jnp.float32 if dtype == "float32" else jnp.bfloat16)
    if dtype == "bits":
        emb = jax.lax.bitcast_convert_type(emb, jnp.uint16)
    ids = jnp.asarray([0, 5, 16, 17, 36, 5], jnp.int32)
    got = kernel_cpu.packed_rows(kernel_cpu.pack(emb.T[None]), ids, 25)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(emb)[np.asarray(ids)])


def test_kernel_refuses_a_layer_out_of_range():
    w = kernel_cpu.pack(jnp.ones((2, 8, 8), jnp.float32))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(kernel_cpu.matmul(jnp.ones((1, 8)), w, 2, n=8))
    with pytest.raises(ValueError, match="need n in"):
        kernel_cpu.matmul(jnp.ones((1, 8)), w, 0, n=17)
    with pytest.raises(ValueError, match="out_dtype"):
        kernel_cpu.matmul(jnp.ones((1, 8)), w, 0, n=8, out_dtype=jnp.float16)


# tokens: streaming, register-blocked, three row blocks (a spread of 3 of the 6 by default)
@pytest.mark.parametrize("dtype,tokens", spread_grid(["float32", "bfloat16"], [4, 64, 128],
                                                     keep=2))
def test_decoder_native_steps_match_xla_dots(dtype, tokens, tiny_llama, load):
    """On backend 'cpu' every step runs the projections and the LM head (packed by the runner;
    the tied embedding is looked up in the packed LM head) in the kernel (bf16 weights as bits,
    as the engine's runner stores them); the logits equal those of the same steps run with XLA's
    dots (backend 'reference')."""
    from conftest import PagedRunner

    logits = {}
    for backend in ("cpu", "reference"):
        model = load(tiny_llama, dtype=dtype, attention_backend=backend)[0]
        assert model.backend.resident == (  # the projections run in the native matmul
            {"qkv", "o", "gate_up", "down", "router", "shared_gate", "experts_gate_up",
             "experts_down", "q_a", "q", "kv_a"} if backend == "cpu"
            else set())  # (and a MoE layer's, and DeepSeek's latent attention's)
        r = PagedRunner(model, 4, 1, 32, num_tokens=tokens)
        qkv = r.state["layers"][0]["qkv"][...]
        assert (qkv.ndim == 4) == (backend == "cpu")  # packed
        assert (qkv.dtype == np.uint16) == (dtype == "bfloat16")  # bf16 kept as bits
        out = [r.step([0], [[5, 9, 11]])[0]]  # a 3-token prompt, then greedy single tokens
        for _ in range(6):
            out.append(r.step([0], [[int(out[-1][-1].argmax())]])[0])
        logits[backend] = np.concatenate(out)
        if backend == "cpu":  # the greedy LM head: the logits' first maxima, without them
            hidden = jnp.asarray(np.random.default_rng(0).standard_normal(
                (tokens, model.cfg.hidden_size), np.float32), model.cfg.jnp_dtype)
            head = nnx.merge(r.graphdef, r.state)  # packed, as the runner has it
            np.testing.assert_array_equal(
                np.asarray(jax.jit(lambda h: head.greedy_head(h))(hidden)),
                np.asarray(jax.jit(lambda h: head.compute_logits(h))(hidden)).argmax(-1))
        else:
            assert model.greedy_head is None  # XLA's dot: sampled from the logits
    want = logits["reference"]
    tol = 1e-4 if dtype == "float32" else 2e-2 * np.abs(want).max()
    np.testing.assert_allclose(logits["cpu"], want, atol=tol, rtol=0)
    assert (logits["cpu"].argmax(-1) == want.argmax(-1)).all()
