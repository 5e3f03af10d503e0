"""Chunked local attention (Llama 4's `attention_chunk_size`: a query sees only the keys of its
own chunk of positions) in every attention path: the pure-JAX reference against a dense NumPy
attention, and the native CPU kernel and both Pallas kernels (interpret mode) against the
reference, with queries whose chunk starts mid-page, prompts and decode rows that cross chunk
boundaries, and a chunk combined with a sliding window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import kernel, kernel_cpu
from pallas_kernels.ragged_paged_attention.reference import write_kv
from pallas_kernels.ragged_paged_attention import reference

ragged_paged_attention = jax.jit(reference.ragged_paged_attention, static_argnames=(
    "sm_scale", "q_tile", "tiles_per_group", "chunk_blocks"))


def naive(q, ks, vs, q_lens, kv_lens, sm_scale, chunk=None, window=None):
    """Dense attention one sequence at a time in float64 (ks/vs: each sequence's [K, Hkv, D]),
    the mask as transformers' `chunked_causal_mask_function` (same chunk, causal)."""
    out, t0 = [], 0
    hq, hkv = q.shape[1], ks[0].shape[1]
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qq = q[t0:t0 + ql].astype(np.float64)
        k = np.repeat(ks[s][:kl], hq // hkv, axis=1).astype(np.float64)
        v = np.repeat(vs[s][:kl], hq // hkv, axis=1).astype(np.float64)
        sc = np.einsum("qhd,khd->hqk", qq, k) * sm_scale
        qpos, kpos = kl - ql + np.arange(ql), np.arange(kl)
        mask = kpos[None] <= qpos[:, None]
        if chunk:
            mask &= kpos[None] // chunk == qpos[:, None] // chunk
        if window:
            mask &= kpos[None] > qpos[:, None] - window
        sc = np.where(mask[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        out.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
        t0 += ql
    return np.concatenate(out)


def build(seed, q_lens, kv_lens, hq, hkv, d, bs, pad_tokens=3):
    """A paged batch (layer 1 of 2 holds it), plus each sequence's dense K/V."""
    rng = np.random.default_rng(seed)
    S, n = len(q_lens), sum(q_lens)
    width = max(-(-k // bs) for k in kv_lens) + 1
    nb = (S + 1) * width + 2
    kc = np.zeros((2, nb, hkv, bs, d), np.float32)
    vc = np.zeros_like(kc)
    tables = rng.permutation(nb)[:(S + 1) * width].reshape(S + 1, width).astype(np.int32)
    ks, vs = [], []
    for s, kl in enumerate(kv_lens):
        k, v = (rng.standard_normal((kl, hkv, d)).astype(np.float32) for _ in range(2))
        for p in range(kl):
            kc[1, tables[s, p // bs], :, p % bs], vc[1, tables[s, p // bs], :, p % bs] = k[p], v[p]
        ks.append(k)
        vs.append(v)
    q = rng.standard_normal((n + pad_tokens, hq, d)).astype(np.float32)
    cu = np.array([0, *np.cumsum(q_lens), n], np.int32)
    meta = (np.array([*kv_lens, 0], np.int32), tables, cu, np.array([S], np.int32))
    return q, kc, vc, meta, ks, vs, n


# (q_lens, kv_lens, hq, hkv, chunk, window): decode rows at, just past and well past a chunk
# boundary; prompts and chunks of prompts spanning several chunks; a chunk that is not a
# multiple of the page size; a window shorter than the chunk (the later start wins).
CASES = {
    "decode": ((1, 1, 1, 1), (16, 17, 33, 70), 4, 2, 16, None),
    "mixed": ((1, 7, 30, 12), (40, 7, 70, 12), 8, 2, 12, None),
    "prefill_one_chunk": ((20,), (20,), 4, 1, 32, None),
    "window_in_chunk": ((5, 1, 25), (50, 9, 60), 6, 2, 20, 8),
}


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_naive(name):
    q_lens, kv_lens, hq, hkv, chunk, window = CASES[name]
    d, bs = 16, 4
    q, kc, vc, meta, ks, vs, n = build(0, q_lens, kv_lens, hq, hkv, d, bs)
    want = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, chunk, window)
    if max(kv_lens) > chunk:  # the chunking changes the result in this case
        full = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, None, window)
        assert np.abs(want - full).max() > 1e-2
    for q_tile, groups, blocks in [(4, 2, 2), (16, 4, 64)]:
        out = ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 1, *map(jnp.asarray, meta),
            sm_scale=d ** -0.5, sliding_window=window, attention_chunk=chunk, q_tile=q_tile,
            tiles_per_group=groups, chunk_blocks=blocks)
        np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5)
        assert np.all(np.asarray(out[n:]) == 0)


def test_reference_chunk_zero_is_full_attention():
    """A traced chunk <= 0 (a layer without chunking, in a scan over layers) is full
    attention."""
    q, kc, vc, meta, ks, vs, n = build(1, (3, 9), (40, 9), 4, 2, 16, 4)
    want = naive(q, ks, vs, (3, 9), (40, 9), 0.25)
    run = jax.jit(lambda c: ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 1, *map(jnp.asarray, meta),
        sm_scale=0.25, attention_chunk=c))
    np.testing.assert_allclose(np.asarray(run(jnp.int32(0))[:n]), want, atol=2e-5, rtol=2e-5)


SLOW = pytest.mark.slow  # the same code paths as a default case; kept out of the default budget


@pytest.mark.parametrize("name,cache_dtype", [
    ("decode", jnp.float32), ("mixed", jnp.float32), ("window_in_chunk", jnp.float32),
    ("mixed", jnp.bfloat16), pytest.param("decode", jnp.bfloat16, marks=SLOW),
    pytest.param("window_in_chunk", jnp.bfloat16, marks=SLOW)])
def test_cpu_kernel_matches_reference(name, cache_dtype):
    """The native kernel (it writes this step's K/V too) against the reference's write_kv then
    attention; bf16 caches run on AMX tiles where the CPU has them (then bf16 products)."""
    assert kernel_cpu.available(), "the native CPU kernel did not build (a C++ compiler?)"
    q_lens, kv_lens, hq, hkv, chunk, window = CASES[name]
    d, bs = 64, 16
    q, kc, vc, meta, _, _, n = build(2, q_lens, kv_lens, hq, hkv, d, bs)
    rng = np.random.default_rng(3)
    T = q.shape[0]
    k_new, v_new = (jnp.asarray(rng.standard_normal((T, hkv, d)), jnp.float32) for _ in "kv")
    kv_lens_, tables, cu, _ = meta
    slots = np.full(T, -1, np.int32)  # this step's K/V into each sequence's last q_len slots
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        pos = np.arange(kl - ql, kl)
        slots[cu[s]:cu[s + 1]] = tables[s, pos // bs] * bs + pos % bs
    kc, vc = jnp.asarray(kc, cache_dtype), jnp.asarray(vc, cache_dtype)
    meta = tuple(map(jnp.asarray, meta))
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, attention_chunk=chunk)
    wk, wv = write_kv(kc, vc, 1, k_new, v_new, jnp.asarray(slots))
    want = ragged_paged_attention(jnp.asarray(q), wk, wv, 1, *meta, **kw)
    got, gk, _ = jax.jit(lambda kc, vc: kernel_cpu.ragged_paged_attention(
        jnp.asarray(q), k_new, v_new, kc, vc, 1, jnp.asarray(slots), *meta, **kw))(kc, vc)
    tiles = cache_dtype == jnp.bfloat16 and kernel_cpu.bf16_tiles()
    atol = 3e-2 if tiles else 2e-5  # AMX: q and the probabilities rounded to bf16
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=atol, rtol=0)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))


@pytest.mark.parametrize("name,variant", [
    # (the default suite runs each case and each variant once: mixed on the TPU variant,
    # window_in_chunk on the GPU one)
    ("mixed", "tpu"), pytest.param("mixed", "gpu", marks=SLOW), ("window_in_chunk", "gpu"),
    pytest.param("window_in_chunk", "tpu", marks=SLOW)])  # the TPU interpreter: ~8 s a case
def test_pallas_kernels_match_reference(name, variant):
    """Both Pallas variants in interpret mode, query blocks of 16 tokens and KV steps of 2
    pages of 16, so blocks span chunk boundaries and chunks start mid-step."""
    q_lens, kv_lens, hq, hkv, chunk, window = CASES[name]
    d, bs = 64, 16
    q, kc, vc, meta, _, _, n = build(4, q_lens, kv_lens, hq, hkv, d, bs)
    args = (jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 1, *map(jnp.asarray, meta))
    kw = dict(sm_scale=d ** -0.5, sliding_window=window)
    want = ragged_paged_attention(*args, **kw, attention_chunk=chunk)
    full = ragged_paged_attention(*args, **kw)
    assert float(jnp.abs(want[:n] - full[:n]).max()) > 1e-2  # the chunking matters here
    out = kernel.ragged_paged_attention(*args, **kw, attention_chunk=jnp.int32(chunk),
                                        variant=variant, q_tile=16, chunk_blocks=2)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(want)[:n], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[n:] == 0)


def test_backends_attention_with_chunk():
    """The backend op: the reference, CPU (native kernel) and Pallas (GPU kernel interpreted)
    backends all honour `attention_chunk`, traced (as a scan over layers passes it)."""
    from jaxllm.layers.attention import AttentionMetadata, KVCache
    from jaxllm.layers.backends.cpu import CpuBackend
    from jaxllm.layers.backends.pallas import PallasBackend
    from jaxllm.layers.backends.reference import ReferenceBackend

    q_lens, kv_lens, hq, hkv, chunk, _ = CASES["mixed"]
    d = 16
    q, kc, vc, meta, ks, vs, n = build(5, q_lens, kv_lens, hq, hkv, d, 4)
    T = q.shape[0]
    md = AttentionMetadata(jnp.full((T,), -1, jnp.int32), *map(jnp.asarray, meta))
    zeros = jnp.zeros((T, hkv, d), jnp.float32)
    cache = KVCache(jnp.asarray(kc), jnp.asarray(vc))
    want = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, chunk)
    for backend in (ReferenceBackend(), CpuBackend(native_matmul=False, native_sampling=False),
                    PallasBackend()):
        out, _ = jax.jit(lambda c: backend.attention(
            jnp.asarray(q), zeros, zeros, cache, 1, md, sm_scale=d ** -0.5,
            attention_chunk=c))(jnp.int32(chunk))
        np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5,
                                   err_msg=backend.name)
