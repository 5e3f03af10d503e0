"""Batch invariance of the native CPU matmul across its few-row paths (issue 44): one row, two,
3-48 rows (3-16 with AVX-512) streaming each strip once for all of them (row blocks of 5 or
6), more the register-blocked GEMM. A row gives the same bits at every M, in the dense matmul
(f32, bf16 and the greedy head's argmax results; gated), and in the grouped matmul at every
group size.

`test_rows_agree_on_each_isa_path` runs the same checks in a child process per ISA the
kernels are built for (`JAXLLM_CPU_MARCH`: the build is keyed by its flags), on each that this
CPU can execute.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_on_isa
from pallas_kernels.grouped_matmul import kernel_cpu as grouped_cpu
from pallas_kernels.matmul import kernel_cpu as matmul_cpu

# The row counts, and each edge of the paths between them: 2 (a two-row stream), 6/7
# and 11 (one and two row blocks), 16/17 and 48/49 (the last streamed count and the GEMM, with
# and without AVX-512).
ROWS = (1, 2, 3, 5, 6, 7, 8, 11, 16, 17, 48, 49, 64)
# K: one chunk of 256 with an odd tail (bf16 pairs padded); several chunks and a part one.
# N: a part strip, and strips past the 4 a task takes.
SHAPES = ((37, 40), (600, 150))


def _weights(rng, shape, w_dtype):
    w = jnp.asarray(rng.standard_normal(shape, np.float32),
                    jnp.float32 if w_dtype == "float32" else jnp.bfloat16)
    return jax.lax.bitcast_convert_type(w, jnp.uint16) if w_dtype == "bits" else w


def check_dense(w_dtype, x_dtype):
    """Each row of x[:m] @ w equals that row of x[:64] @ w bitwise, for every m of ROWS, in
    each result kind; and the rows are the f32 product (to rounding)."""
    for k, n in SHAPES:
        rng = np.random.default_rng(k + n)
        w = _weights(rng, (1, k, n), w_dtype)
        packed = matmul_cpu.pack(w)
        gate_up = matmul_cpu.pack(_weights(rng, (1, k, 2 * n), w_dtype))
        x = jnp.asarray(rng.standard_normal((max(ROWS), k), np.float32), x_dtype)
        kinds = {"f32": lambda x: matmul_cpu.matmul(x, packed, n=n),
                 "bf16": lambda x: matmul_cpu.matmul(x, packed, n=n, out_dtype=jnp.bfloat16),
                 "argmax": lambda x: matmul_cpu.argmax(x, packed, n=n),
                 "gated": lambda x: matmul_cpu.matmul(x, gate_up, n=n, gated=True)}
        for kind, f in kinds.items():
            f = jax.jit(f)
            full = np.asarray(f(x))
            for m in ROWS:
                np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m],
                                              err_msg=f"{kind} k={k} n={n} m={m}")
        wf = np.asarray(jax.lax.bitcast_convert_type(w, jnp.bfloat16)
                        if w_dtype == "bits" else w, np.float32)[0]
        np.testing.assert_allclose(np.asarray(kinds["f32"](x)), np.asarray(x, np.float32) @ wf,
                                   rtol=1e-4, atol=1e-4 * k)


def check_grouped(w_dtype, x_dtype):
    """A row of group 1 gives the same bits whatever the size of its group (ROWS) and the rows
    of the group before it."""
    rng = np.random.default_rng(7)
    G, k, n = 3, 600, 150
    packed = grouped_cpu.pack(_weights(rng, (1, G, k, n), w_dtype))
    f = jax.jit(lambda x, g: grouped_cpu.grouped_matmul(x, packed, g, n=n))
    rows = jnp.asarray(rng.standard_normal((80, k), np.float32), x_dtype)
    alone = np.asarray(f(rows[:1], jnp.asarray([0, 1, 0], jnp.int32)))[0]
    for before in (0, 5):
        for m in ROWS:
            x = jnp.concatenate([rows[1:1 + before], rows[:m]])
            got = np.asarray(f(x, jnp.asarray([before, m, 0], jnp.int32)))[before]
            np.testing.assert_array_equal(got, alone, err_msg=f"before {before} m={m}")


DTYPES = [("float32", "float32"), ("bits", "float32"), ("bits", "bfloat16"),
          ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("w_dtype,x_dtype", [
    ("float32", "float32"), ("bits", "bfloat16"),
    # the same paths as the two above (bf16 weights as bits or as bf16; f32 x against them)
    pytest.param("bits", "float32", marks=pytest.mark.slow),
    pytest.param("bfloat16", "bfloat16", marks=pytest.mark.slow)])
def test_dense_rows_do_not_depend_on_m(w_dtype, x_dtype):
    check_dense(w_dtype, x_dtype)


@pytest.mark.parametrize("w_dtype,x_dtype", [("float32", "float32"), ("bits", "bfloat16")])
def test_grouped_rows_do_not_depend_on_their_group_size(w_dtype, x_dtype):
    check_grouped(w_dtype, x_dtype)


# -march values the kernels have distinct paths for, and the CPU flags each needs to run.
ISAS = {
    "x86-64-v2": {"sse4_2"},  # the portable (no AVX2) path
    "haswell": {"avx2", "fma"},  # AVX2
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},  # AVX-512
    "cooperlake": {"avx512f", "avx512vl", "avx512_bf16"},  # AVX512_BF16 (vdpbf16ps)
    "sapphirerapids": {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"},  # AMX
}


@pytest.mark.slow  # a kernel build per ISA (tens of seconds each on 2 cores) and a child each
@pytest.mark.parametrize("march", list(ISAS))
def test_rows_agree_on_each_isa_path(march):
    run_on_isa(march, ISAS[march], (
        "import test_invariant_matmul_rows as t\n"
        "for w, x in t.DTYPES: t.check_dense(w, x)\n"
        "t.check_grouped('float32', 'float32'); t.check_grouped('bits', 'bfloat16')\n"))
