"""The pure-JAX ragged paged attention against a naive dense per-sequence attention (NumPy)."""

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv


def naive(q, ks, vs, q_lens, kv_lens, sm_scale, window=None, soft_cap=None, sinks=None):
    """Dense attention one sequence at a time; ks/vs are each sequence's full [K, Hkv, D].
    sinks [Hq]: transformers' gpt_oss eager form, a sink column joined to the scores, the
    softmax taken, the column dropped."""
    out, t0 = [], 0
    hq, hkv = q.shape[1], ks[0].shape[1]
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qq = q[t0:t0 + ql].astype(np.float64)
        k = np.repeat(ks[s][:kl], hq // hkv, axis=1).astype(np.float64)
        v = np.repeat(vs[s][:kl], hq // hkv, axis=1).astype(np.float64)
        sc = np.einsum("qhd,khd->hqk", qq, k) * sm_scale
        if soft_cap:
            sc = soft_cap * np.tanh(sc / soft_cap)
        qpos = kl - ql + np.arange(ql)
        kpos = np.arange(kl)
        mask = kpos[None] <= qpos[:, None]
        if window:
            mask &= kpos[None] > qpos[:, None] - window
        sc = np.where(mask[None], sc, -np.inf)
        if sinks is not None:
            col = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (hq, ql, 1))
            sc = np.concatenate([sc, col], -1)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if sinks is not None:
            p = p[..., :-1]
        out.append(np.einsum("hqk,khd->qhd", p, v))
        t0 += ql
    return np.concatenate(out)


def build_case(rng, q_lens, kv_lens, hq, hkv, d, bs, num_blocks=64, layers=2, pad_tokens=3,
               pad_seqs=1, dtype=np.float32):
    S = len(q_lens)
    T = sum(q_lens) + pad_tokens
    max_blocks = max(-(-k // bs) for k in kv_lens) + 1
    k_cache = np.zeros((layers, num_blocks, hkv, bs, d), dtype)
    v_cache = np.zeros_like(k_cache)
    perm = rng.permutation(num_blocks)
    tables = np.zeros((S + pad_seqs, max_blocks), np.int32)
    ks, vs, used = [], [], 0
    for s, kl in enumerate(kv_lens):
        nb = -(-kl // bs)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        k = rng.standard_normal((kl, hkv, d)).astype(dtype)
        v = rng.standard_normal((kl, hkv, d)).astype(dtype)
        for p in range(kl):
            k_cache[1, tables[s, p // bs], :, p % bs] = k[p]
            v_cache[1, tables[s, p // bs], :, p % bs] = v[p]
        ks.append(k)
        vs.append(v)
    q = rng.standard_normal((T, hq, d)).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs]).astype(np.int32)
    kvl = np.array(list(kv_lens) + [0] * pad_seqs, np.int32)
    return q, k_cache, v_cache, kvl, tables, cu, np.array([S], np.int32), ks, vs


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,window,cap", [
    ([1, 1, 1], [5, 33, 17], 4, 4, None, None),          # decode only
    ([20], [20], 8, 2, None, None),                      # prefill
    ([1, 7, 1, 30], [40, 7, 3, 70], 8, 1, None, None),   # mixed, MQA, chunked prefill
    ([5, 1, 12], [50, 9, 12], 6, 2, 8, 30.0),            # sliding window + soft cap
])
def test_reference_matches_naive(q_lens, kv_lens, hq, hkv, window, cap):
    rng = np.random.default_rng(0)
    d, bs = 16, 4
    q, kc, vc, kvl, bt, cu, ns, ks, vs = build_case(rng, q_lens, kv_lens, hq, hkv, d, bs)
    want = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, window, cap)
    n = sum(q_lens)
    tilings = [(4, 2, 2), (16, 4, 64)]  # (q_tile, tiles_per_group, chunk_blocks)
    if max(q_lens) == 1:
        tilings.append((1, 64, 32))     # the engine's decode-only tiling
    for q_tile, groups, chunk in tilings:
        out = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 1,
                                     jnp.asarray(kvl), jnp.asarray(bt), jnp.asarray(cu),
                                     jnp.asarray(ns), sm_scale=d ** -0.5, sliding_window=window,
                                     soft_cap=cap, chunk_blocks=chunk, q_tile=q_tile,
                                     tiles_per_group=groups)
        np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5)
        assert np.all(np.asarray(out[n:]) == 0)  # padding tokens produce zeros


def test_write_kv_scatters_and_drops_padding():
    kc = jnp.zeros((2, 4, 2, 4, 3))
    vc = jnp.zeros_like(kc)
    k = jnp.arange(3 * 2 * 3, dtype=jnp.float32).reshape(3, 2, 3) + 1
    slots = jnp.array([5, 14, -1], jnp.int32)  # block 1 offset 1, block 3 offset 2, padding
    kc2, vc2 = write_kv(kc, vc, 1, k, -k, slots)
    np.testing.assert_array_equal(kc2[1, 1, :, 1], k[0])
    np.testing.assert_array_equal(vc2[1, 3, :, 2], -k[1])
    assert float(jnp.abs(kc2).sum()) == float(jnp.abs(k[:2]).sum())  # padding row dropped
    assert float(jnp.abs(kc2[0]).sum()) == 0.0  # other layer untouched


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,window", [
    ([1, 1, 1], [5, 33, 17], 4, 2, None),             # decode only
    ([1, 7, 1, 30], [40, 7, 3, 70], 8, 2, None),      # mixed, chunked prefill
    ([5, 1, 12], [50, 9, 12], 6, 2, 8),               # sliding window
])
def test_reference_sinks_match_naive(q_lens, kv_lens, hq, hkv, window):
    rng = np.random.default_rng(1)
    d, bs = 16, 4
    q, kc, vc, kvl, bt, cu, ns, ks, vs = build_case(rng, q_lens, kv_lens, hq, hkv, d, bs)
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    want = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, window, sinks=sinks)
    without = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, window)
    assert np.abs(want - without).max() > 1e-2  # the sinks matter in this case
    n = sum(q_lens)
    for q_tile, groups, chunk in [(4, 2, 2), (16, 4, 64), (1, 64, 32)]:
        out = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 1,
                                     jnp.asarray(kvl), jnp.asarray(bt), jnp.asarray(cu),
                                     jnp.asarray(ns), sm_scale=d ** -0.5, sliding_window=window,
                                     sinks=jnp.asarray(sinks), chunk_blocks=chunk,
                                     q_tile=q_tile, tiles_per_group=groups)
        np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5)
        assert np.all(np.asarray(out[n:]) == 0)


def test_backends_attention_with_sinks():
    """The backend op: the reference, CPU (native kernel) and Pallas (its GPU kernel in interpret
    mode here) backends all honour `sinks`."""
    from jaxllm.layers.attention import AttentionMetadata, KVCache
    from jaxllm.layers.backends.cpu import CpuBackend
    from jaxllm.layers.backends.pallas import PallasBackend
    from jaxllm.layers.backends.reference import ReferenceBackend

    rng = np.random.default_rng(2)
    q_lens, kv_lens, hq, hkv, d, bs = [1, 6], [9, 6], 4, 2, 16, 4
    q, kc, vc, kvl, bt, cu, ns, ks, vs = build_case(rng, q_lens, kv_lens, hq, hkv, d, bs)
    T = q.shape[0]
    sinks = jnp.asarray((rng.standard_normal(hq) * 2).astype(np.float32))
    md = AttentionMetadata(jnp.full((T,), -1, jnp.int32), jnp.asarray(kvl), jnp.asarray(bt),
                           jnp.asarray(cu), jnp.asarray(ns))  # slots -1: the cache is full
    zeros = jnp.zeros((T, hkv, d), jnp.float32)
    cache = KVCache(jnp.asarray(kc), jnp.asarray(vc))
    want = naive(q, ks, vs, q_lens, kv_lens, d ** -0.5, sinks=np.asarray(sinks))
    n = sum(q_lens)
    for backend in (ReferenceBackend(), CpuBackend(native_matmul=False, native_sampling=False),
                    PallasBackend()):
        out, _ = backend.attention(jnp.asarray(q), zeros, zeros, cache, 1, md,
                                   sm_scale=d ** -0.5, sinks=sinks)
        np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5)
