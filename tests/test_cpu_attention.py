"""The native CPU attention kernel (kernel_cpu.cc via the XLA FFI) against the pure-JAX reference.

The kernel is built with the system C++ compiler on first use; CI has one, so a build failure
fails these tests rather than skipping them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import spread_grid
from jaxllm.layers.backends import resolve_backend
from pallas_kernels.ragged_paged_attention import kernel_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv


def test_kernel_builds_and_auto_picks_it_on_one_cpu_device():
    assert kernel_cpu.available(), "the CPU kernel did not build (see the warning in the log)"
    assert resolve_backend("auto") == "cpu"
    assert resolve_backend("auto", num_devices=2) == "reference"  # XLA cannot split the call
    assert resolve_backend("reference") == "reference"


def _case(seed, *, num_seqs, pad_seqs, hq, hkv, d, bs, max_len, ragged, layers=3,
          num_blocks=256):
    """Decode (one query per sequence) or a ragged step: a decode row, whole prompts and
    chunks of prompts whose earlier tokens are in the cache (kv_len > q_len), 40 queries for
    some, so a sequence spans several of the kernel's query chunks."""
    rng = np.random.default_rng(seed)
    S = num_seqs + pad_seqs
    B = -(-max_len // bs)
    kc = rng.standard_normal((layers, num_blocks, hkv, bs, d), np.float32)
    vc = rng.standard_normal((layers, num_blocks, hkv, bs, d), np.float32)
    tables = rng.permutation(num_blocks)[:S * B].reshape(S, B).astype(np.int32)
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:num_seqs] = rng.integers(1, max_len + 1, num_seqs)
    kv_lens[0] = 1  # a sequence with only its own key
    q_lens = np.zeros(S, np.int32)
    q_lens[:num_seqs] = 1
    if ragged:
        kv_lens[1:4] = max_len, 40, 41  # (max_len > 41) a long chunk, a whole 40-token prompt, a chunk of one
        q_lens[1:num_seqs] = np.minimum(rng.integers(1, 45, num_seqs - 1), kv_lens[1:num_seqs])
        q_lens[2:4] = 40
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((cu[-1] + 2, hq, d), np.float32)  # two padding query rows too
    # This step's K/V go to the slots of each sequence's last q_len positions; padding rows -1.
    slots = np.full(cu[-1] + 2, -1, np.int32)
    for s in range(num_seqs):
        pos = np.arange(kv_lens[s] - q_lens[s], kv_lens[s])
        slots[cu[s]:cu[s + 1]] = tables[s, pos // bs] * bs + pos % bs
    k, v = (rng.standard_normal((cu[-1] + 2, hkv, d), np.float32) for _ in range(2))
    return tuple(map(jnp.asarray, (q, k, v, kc, vc, slots, kv_lens, tables, cu,
                                   np.array([num_seqs], np.int32))))


def _reference(q, k, v, kc, vc, layer, slots, *rest, **kw):
    """The reference's write_kv then ragged_paged_attention: (out, k_cache, v_cache)."""
    kc, vc = write_kv(kc, vc, layer, k, v, slots)
    return ragged_paged_attention(q, kc, vc, layer, *rest, **kw), kc, vc


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _tiles_reference(q, kc, vc, layer, kv_lens, tables, cu, n, *, sm_scale, sliding_window,
                     soft_cap):
    """The AMX path's numerics (`kernel_cpu.bf16_tiles`), per query in float64 over the
    (already written) bf16 caches: scores of q rounded to bf16, the f32 softmax's
    probabilities rounded to bf16 before they weight the values, divided by the f32 sum.
    One block of pages (these cases have under 512 keys), so no online rescaling."""
    q, kc, vc = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (q, kc, vc))
    bs, out = kc.shape[3], np.zeros(q.shape, np.float32)
    for s in range(n):
        q_len, kv = int(cu[s + 1] - cu[s]), int(kv_lens[s])
        pages = np.asarray(tables[s, :-(-kv // bs)])
        keys, vals = (np.concatenate(c[layer, pages].transpose(0, 2, 1, 3), axis=0)[:kv]
                      .transpose(1, 0, 2) for c in (kc, vc))  # [Hkv, kv, D]
        G = q.shape[1] // kc.shape[2]
        for i in range(q_len):
            pos = kv - q_len + i
            j0 = max(0, pos - sliding_window + 1) if sliding_window else 0
            for hq in range(q.shape[1]):
                k, v = keys[hq // G, j0:pos + 1], vals[hq // G, j0:pos + 1]
                sc = (_bf16(q[cu[s] + i, hq]).astype(np.float64) @ k.T.astype(np.float64))
                sc = sc.astype(np.float32) * np.float32(sm_scale)
                if soft_cap:
                    sc = np.float32(soft_cap) * np.tanh(sc / np.float32(soft_cap))
                e = np.exp(sc - sc.max()).astype(np.float32)
                out[cu[s] + i, hq] = (_bf16(e).astype(np.float64) @ v) / e.sum(dtype=np.float64)
    return out


# 96 cases; the default suite runs a spread of 6 that meets every value (conftest.spread_grid).
@pytest.mark.parametrize("hq,hkv,d,bs,window,soft_cap,ragged,cache_dtype", spread_grid(
    [(12, 4, 64, 16), (9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4), (8, 2, 128, 16),
     (2, 1, 20, 4)],
    [(None, None), (7, None), (None, 5.0), (7, 5.0)], [False, True], ["float32", "bfloat16"],
    keep=16))
def test_kernel_matches_reference(hq, hkv, d, bs, window, soft_cap, ragged, cache_dtype):
    """Outputs and written caches equal the reference's write_kv + attention (a bf16 cache:
    k/v rounded to nearest even, bit for bit); the caches come back updated in place when
    donated."""
    case = _case(hq * 31 + d, num_seqs=11, pad_seqs=2, hq=hq, hkv=hkv, d=d, bs=bs, max_len=50,
                 ragged=ragged)
    q, k, v, kc, vc, slots, kv_lens, tables, cu, ns = case
    kc, vc = kc.astype(cache_dtype), vc.astype(cache_dtype)
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=soft_cap)
    n = int(cu[11])
    kernel = jax.jit(lambda kc, vc, layer: kernel_cpu.ragged_paged_attention(
        q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns, **kw), donate_argnums=(0, 1))
    for layer in (0, 2):
        want, want_k, want_v = _reference(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu,
                                           ns, q_tile=1 if not ragged else 8, **kw)
        got, got_k, got_v = kernel(jnp.array(kc), jnp.array(vc), np.int32(layer))
        if cache_dtype == "bfloat16" and d in (64, 128) and kernel_cpu.bf16_tiles():
            want = _tiles_reference(q, want_k, want_v, layer, kv_lens, tables, cu, 11, **kw)
            # The kernel's exp and numpy's may differ in an f32 ulp, which can move a
            # probability's bf16 rounding by one bit (2**-8 of it): rare, and small.
            diff = np.abs(np.asarray(got)[:n] - want[:n])
            assert diff.max() < 4e-3 and (diff > 2e-5).mean() < 0.01, (diff.max(),
                                                                        (diff > 2e-5).mean())
        else:
            np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-5,
                                       rtol=0)
        assert not np.asarray(got)[n:].any(), "rows of no sequence must be zero"
        assert got_k.dtype == got_v.dtype == jnp.dtype(cache_dtype)
        np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
        assert not np.array_equal(np.asarray(got_k), np.asarray(kc)), "nothing was written"


# 9 cases; the default suite runs the 3 of a diagonal (every head shape, every count).
@pytest.mark.parametrize("num_seqs,hq,hkv", spread_grid([1, 2, 3], [(12, 4), (9, 3), (8, 1)],
                                                       keep=4))
def test_kernel_few_sequences_split_heads(hq, hkv, num_seqs):
    """With fewer query chunks than the threads want (decode of a few sequences), tasks take
    ranges of kv heads instead of all of them: the same outputs."""
    q, k, v, kc, vc, slots, kv_lens, tables, cu, ns = _case(
        hq + num_seqs, num_seqs=num_seqs, pad_seqs=1, hq=hq, hkv=hkv, d=64, bs=16, max_len=100,
        ragged=False)
    kv_lens = kv_lens.at[num_seqs - 1].set(100)  # one sequence of 7 pages
    kw = dict(sm_scale=0.125, sliding_window=None, soft_cap=None)
    want, _, _ = _reference(q, k, v, kc, vc, 1, slots, kv_lens, tables, cu, ns, q_tile=1, **kw)
    got, _, _ = jax.jit(lambda kc, vc: kernel_cpu.ragged_paged_attention(
        q, k, v, kc, vc, 1, slots, kv_lens, tables, cu, ns, **kw))(kc, vc)
    np.testing.assert_allclose(np.asarray(got)[:num_seqs], np.asarray(want)[:num_seqs],
                               atol=2e-5, rtol=0)


def test_kernel_traced_window_and_bfloat16_queries():
    """Gemma's per-layer window arrives traced (inside the layer scan); bf16 q comes back bf16,
    rounded by the kernel."""
    q, k, v, kc, vc, slots, kv_lens, tables, cu, ns = _case(5, num_seqs=6, pad_seqs=0, hq=6,
                                                            hkv=2, d=32, bs=8, max_len=50,
                                                            ragged=True)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    f = jax.jit(lambda w: kernel_cpu.ragged_paged_attention(
        qb, kb, vb, kc, vc, 1, slots, kv_lens, tables, cu, ns, sm_scale=0.2,
        sliding_window=w)[0])
    for w in (0, 9):
        got = f(jnp.int32(w))
        assert got.dtype == jnp.bfloat16
        want, _, _ = _reference(qb.astype(jnp.float32), kb.astype(jnp.float32),
                                vb.astype(jnp.float32), kc, vc, 1, slots, kv_lens, tables, cu,
                                ns, sm_scale=0.2, sliding_window=w if w else None)
        n = int(cu[-1])
        np.testing.assert_allclose(np.asarray(got, np.float32)[:n], np.asarray(want)[:n],
                                   atol=2e-2, rtol=0)
        # rounded in the kernel: exactly the f32 result's rounding, padding rows zero
        f32 = kernel_cpu.ragged_paged_attention(
            qb.astype(jnp.float32), kb, vb, kc, vc, 1, slots, kv_lens, tables, cu, ns,
            sm_scale=0.2, sliding_window=jnp.int32(w))[0]
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(f32.astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("hkv,d,window,split", [(2, 64, None, False), (1, 32, 24, False),
                                                  (3, 64, None, True)])
def test_kernel_sinks_match_reference(hkv, d, window, split):
    """Attention sinks (GPT-OSS) in the native kernel equal the reference's, over decode and
    ragged steps, a window, and tasks that take ranges of kv heads (split); f32 caches."""
    hq = 2 * hkv if not split else 3 * hkv
    num_seqs = 2 if split else 6
    q, k, v, kc, vc, slots, kv_lens, tables, cu, ns = _case(
        7, num_seqs=num_seqs, pad_seqs=1, hq=hq, hkv=hkv, d=d, bs=16, max_len=80,
        ragged=not split)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(hq).astype(np.float32) * 2)
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=None)
    want, wk, _ = _reference(q, k, v, kc, vc, 1, slots, kv_lens, tables, cu, ns, sinks=sinks,
                             **kw)
    plain, _, _ = _reference(q, k, v, kc, vc, 1, slots, kv_lens, tables, cu, ns, **kw)
    got, gk, _ = jax.jit(lambda kc, vc: kernel_cpu.ragged_paged_attention(
        q, k, v, kc, vc, 1, slots, kv_lens, tables, cu, ns, sinks=sinks, **kw))(kc, vc)
    n = int(cu[num_seqs])
    assert float(jnp.abs(want[:n] - plain[:n]).max()) > 1e-2  # the sinks matter here
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))
