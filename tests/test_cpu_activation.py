"""The native CPU SiLU-and-multiply (pallas_kernels/activation/kernel_cpu.cc via the XLA FFI)
against its pure-JAX reference. Built with the system C++ compiler on first use; CI has one, so
a build failure fails these tests rather than skipping them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.activation import kernel_cpu, reference


def test_kernel_builds():
    assert kernel_cpu.available(), "the CPU activation did not build (see the warning in the log)"


# F not a multiple of 8 (a scalar tail), T above a task's rows (2048-wide rows: 16 per task),
# gates large either way (exp(-|g|) underflows, never overflows) and zeros.
@pytest.mark.parametrize("t,f", [(1, 8), (3, 37), (64, 2048), (33, 2050)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_reference(t, f, dtype):
    rng = np.random.default_rng(t * 10000 + f)
    x = rng.standard_normal((t, 2, f)).astype(np.float32) * 4
    x[0, 0, :4] = [80.0, -80.0, 0.0, -0.0]
    x = jnp.asarray(x)
    got = kernel_cpu.silu_and_mul(x, dtype)
    want = jax.jit(reference.silu_and_mul, static_argnums=1)(x, jnp.dtype(dtype))
    assert got.shape == (t, f) and got.dtype == jnp.dtype(dtype)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    else:  # the same roundings: equal but where an f32 ulp decides one
        assert np.mean(got != want) < 1e-3
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-6)


def test_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel_cpu.silu_and_mul(jnp.zeros((2, 2, 8)), jnp.float16)
