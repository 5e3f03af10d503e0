"""The Pallas gated DeltaNet kernels (pallas_kernels/gated_delta_rule/{kernel,tpu,gpu}.py), both
platform variants in Pallas' interpreter, against the pure-JAX reference (itself tested against
transformers in test_gated_delta_rule.py): ragged batches across chunk boundaries with
sequences continuing from their slots and fresh ones, padding sequences and rows, a length-1
sequence, one-token decode rows, decays near 0 and near 1, float32 and bfloat16 inputs.

Tolerances: the kernels compute in float32 as the reference does, in other summation orders
(per-chunk dots against batched einsums), so float32 results agree to F32_TOL; with bfloat16
inputs both read the same bf16 values and round the outputs to bf16, so outputs agree to one
bf16 rounding step at their magnitude (BF16_TOL) and the float32 states to F32_TOL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta_rule import ops
from pallas_kernels.gated_delta_rule import reference as ref

HK, HV, DK, DV = 2, 4, 16, 12     # a v head dim that is no power of 2: the GPU variant pads it
T, S, N = 288, 6, 8               # rows, sequences (some padding), state slots
F32_TOL = dict(rtol=1e-4, atol=2e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
VARIANTS = ("gpu", "tpu")

reference = {"chunked": jax.jit(ref.gated_delta_rule_chunked),
             "recurrent": jax.jit(ref.gated_delta_rule_recurrent)}
kernels = {"chunked": jax.jit(ops.gated_delta_rule_chunked,
                              static_argnames=("variant", "interpret")),
           "recurrent": jax.jit(ops.gated_delta_rule_recurrent,
                                static_argnames=("variant", "interpret"))}


def case(lens, fresh, seed, g_scale=1.0, g_shift=0.0, dtype=jnp.float32, rows=T):
    """A ragged batch of sequences of `lens` in slots 5, 0, 7, 2, ... (not the row order)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, HK, DK))
    k = rng.standard_normal((rows, HK, DK))
    v = rng.standard_normal((rows, HV, DV))
    g = -np.abs(rng.standard_normal((rows, HV))) * g_scale + g_shift
    beta = 1 / (1 + np.exp(-rng.standard_normal((rows, HV))))
    state = rng.standard_normal((N, HV, DK, DV)) * 0.5
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1:] = cu[len(lens)]
    slots = np.array([5, 0, 7, 2, 3, 1][:S], np.int32)
    slots[len(lens):] = -1                                  # padding sequences
    fresh = np.array(list(fresh) + [False] * (S - len(fresh)))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
            jnp.asarray(state, jnp.float32), jnp.asarray(slots), jnp.asarray(fresh),
            jnp.asarray(cu), jnp.asarray([len(lens)], jnp.int32))


def check(form, args, variant, tol=F32_TOL):
    want_out, want_state = reference[form](*args)
    out, state = kernels[form](*args, variant=variant, interpret=True)
    assert out.dtype == want_out.dtype and state.dtype == want_state.dtype
    assert float(jnp.abs(want_out).max()) > 0.05            # the case computes something
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                               **tol)
    np.testing.assert_allclose(np.asarray(state), np.asarray(want_state), **F32_TOL)
    untouched = np.setdiff1d(np.arange(N), np.asarray(args[6]))
    np.testing.assert_array_equal(np.asarray(state)[untouched], np.asarray(args[5])[untouched])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lens,fresh", [
    # chunk boundaries (64, 65, 130), a length-1 prompt, decode rows (1) of continuing
    # sequences beside prompts: a mixed prefill + decode batch
    pytest.param((65, 1, 130, 64, 1), (True, True, False, True, False), id="mixed"),
    pytest.param((1,), (True,), id="length-1"),
    pytest.param((200, 63), (False, True), id="continued"),
])
def test_chunked_matches_reference(variant, lens, fresh):
    check("chunked", case(lens, fresh, seed=sum(lens)), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("g_scale,g_shift", [(1e-4, 0.0), (0.0, -30.0)],
                         ids=["decay-near-1", "decay-near-0"])
def test_chunked_decays_near_0_and_1(variant, g_scale, g_shift):
    check("chunked", case((130, 70, 1), (True, False, False), 3, g_scale, g_shift), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("g_scale,g_shift", [(1.0, 0.0), (1e-4, 0.0), (0.0, -30.0)],
                         ids=["decay", "decay-near-1", "decay-near-0"])
def test_recurrent_decode_rows(variant, g_scale, g_shift):
    """One-token decode: five sequences one row each (one fresh), padding rows after."""
    args = case((1,) * 5, (False, True, False, False, False), 4, g_scale, g_shift, rows=8)
    check("recurrent", args, variant)


@pytest.mark.slow  # its own compiles (~15 s)
@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_inputs(variant):
    args = case((65, 1, 130, 64, 1), (True, True, False, True, False), 5, dtype=jnp.bfloat16)
    check("chunked", args, variant, BF16_TOL)
    args = case((1,) * 5, (False, True, False, False, False), 6, dtype=jnp.bfloat16, rows=8)
    check("recurrent", args, variant, BF16_TOL)
