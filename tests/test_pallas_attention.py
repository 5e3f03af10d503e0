"""The Pallas ragged paged-attention kernels against the pure-JAX reference, on CPU.

Everything here runs the kernels in interpret mode (the only mode on CPU): it checks their
semantics, masking and page walking, not their speed or Mosaic/Triton compilation. The
`lowers` tests additionally lower both variants for TPU and CUDA (no compile: no device).

Cache slots no sequence owns, and slots past a sequence's length, hold NaN in the kernel's
cache (zeros in the reference's): any key outside the visible range that leaks into an
output shows up as NaN.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu_paged

from conftest import spread_grid
from pallas_kernels.ragged_paged_attention import kernel, reference

VARIANTS = ["tpu", "gpu"]
LAYER = 1  # cases read layer 1 of 2; layer 0 holds other data
# Tolerance (atol = rtol) by q's dtype, which sets the kernels' matmul dtype
# (kernel.compute_dtype). f32: the f32 reference up to summation order (seen: <= 6e-7).
# bf16: bf16 matmul inputs, probabilities included, and a bf16 output; seen: 7.8e-3, one bf16
# ulp at |x| in [1, 2), which the output rounding alone can cause.
ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_case(rng, q_lens, kv_lens, hq, hkv, d, bs, *, cache_dtype=jnp.float32,
              q_dtype=jnp.float32, scale=None, layers=2, pad_tokens=3, pad_seqs=1):
    """Random ragged batch; returns (kernel args, reference args, number of live tokens)."""
    S, n = len(q_lens), sum(q_lens)
    pages = [-(-k // bs) for k in kv_lens]
    nb, width = sum(pages) + 3, max(pages) + 1
    shape = (layers, nb, hkv, bs, d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    live = np.zeros(shape[:2] + (1, bs, 1), bool)
    tables = rng.integers(0, nb, (S + pad_seqs, width)).astype(np.int32)  # padding: garbage
    perm, used = rng.permutation(nb), 0
    for s, kl in enumerate(kv_lens):
        tables[s, :pages[s]] = perm[used:used + pages[s]]
        used += pages[s]
        for pos in range(kl):
            live[:, tables[s, pos // bs], :, pos % bs] = True
    k_ref, v_ref = (np.where(live, x, 0.0) for x in (k, v))
    k_ker, v_ker = (np.where(live, x, np.nan) for x in (k, v))
    if scale is not None:  # fp8: the cache holds x / scale; both sides read the same values
        k_ref, v_ref, k_ker, v_ker = (x / scale for x in (k_ref, v_ref, k_ker, v_ker))
    k_ref, v_ref, k_ker, v_ker = (jnp.asarray(x, cache_dtype)
                                  for x in (k_ref, v_ref, k_ker, v_ker))
    q = jnp.asarray(rng.standard_normal((n + pad_tokens, hq, d)), q_dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens), [n] * pad_seqs]).astype(np.int32)
    kvl = np.array(list(kv_lens) + [10_000] * pad_seqs, np.int32)  # padding: garbage
    meta = [LAYER] + [jnp.asarray(x) for x in (kvl, tables, cu, np.array([S], np.int32))]
    return (q, k_ker, v_ker, *meta), (q, k_ref, v_ref, *meta), n


def check(out, want, n, atol):
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(out[:n], want[:n], atol=atol, rtol=atol)
    assert np.all(out[n:] == 0), "padding tokens must produce zeros"


_reference = jax.jit(reference.ragged_paged_attention, static_argnames=(
    "sm_scale", "soft_cap", "k_scale", "v_scale", "chunk_blocks"))


@functools.lru_cache(maxsize=None)
def case(seed, q_lens, kv_lens, hq, hkv, d, bs, cache_dtype=jnp.float32, q_dtype=jnp.float32,
         scale=None, window=None, cap=None):
    """(kernel args, reference output, live tokens, attention kwargs); shared by both variants."""
    ker, ref, n = make_case(np.random.default_rng(seed), q_lens, kv_lens, hq, hkv, d, bs,
                            cache_dtype=cache_dtype, q_dtype=q_dtype, scale=scale)
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap, k_scale=scale,
              v_scale=scale)
    return ker, _reference(*ref, **kw), n, kw


# (q_lens, kv_lens, hq, hkv, d, page size, (q_tile, chunk_blocks) or None = the table's)
SHAPES = {
    "decode_1_and_many_pages_mha": ((1, 1, 1, 1), (5, 16, 17, 90), 2, 2, 64, 16, (16, 2)),
    "decode_gqa8_page128_d128": ((1, 1, 1), (3, 130, 300), 8, 1, 128, 128, None),
    "prefill_one_seq_many_pages_gqa4": ((40,), (40,), 8, 2, 128, 16, (16, 2)),
    "prefill_two_seqs_page128": ((20, 37), (20, 37), 4, 4, 64, 128, None),
    "mixed_gqa4": ((1, 7, 1, 30, 5), (40, 7, 3, 70, 25), 8, 2, 64, 16, (16, 2)),
    "mixed_gqa8_one_tile": ((3, 1, 12), (50, 9, 140), 8, 1, 64, 16, None),
    "group3_head_dim24": ((2, 1, 9), (20, 33, 9), 6, 2, 24, 16, (16, 2)),  # SmolLM2-like GQA
}


# Each grid below runs every shape (feature, dtype) in the default suite, on one variant or
# the other in turn (conftest.spread_grid); the slow run has both variants of each.
@pytest.mark.parametrize("shape,variant", spread_grid(list(SHAPES), VARIANTS, keep=2))
def test_matches_reference(shape, variant):
    *spec, blocks = SHAPES[shape]
    ker, want, n, kw = case(0, *spec)
    q_tile, chunk = blocks or (None, None)
    out = kernel.ragged_paged_attention(*ker, **kw, variant=variant, q_tile=q_tile,
                                        chunk_blocks=chunk)
    check(out, want, n, ATOL[jnp.float32])


# (window, soft cap, page size, blocks): windows inside one page and across pages.
FEATURES = {
    "window_and_softcap": (8, 30.0, 16, (16, 2)),
    "window_across_pages": (100, None, 16, (16, 2)),
    "window_page128": (37, 50.0, 128, None),
}


@pytest.mark.parametrize("feature,variant", spread_grid(list(FEATURES), VARIANTS, keep=2))
def test_window_and_softcap(feature, variant):
    window, cap, bs, blocks = FEATURES[feature]
    ker, want, n, kw = case(1, (5, 1, 40, 1), (50, 9, 140, 260), 8, 2, 64, bs, window=window,
                            cap=cap)
    q_tile, chunk = blocks or (None, None)
    out = kernel.ragged_paged_attention(*ker, **kw, variant=variant, q_tile=q_tile,
                                        chunk_blocks=chunk)
    check(out, want, n, ATOL[jnp.float32])


# (cache dtype, q dtype, scale). fp8 converts exactly into the matmul dtype (q's), so fp8 with
# an f32 query keeps the f32 tolerance; a bf16 query makes the whole step bf16.
DTYPES = {
    "f32": (jnp.float32, jnp.float32, None),
    "bf16": (jnp.bfloat16, jnp.bfloat16, None),
    "fp8_e4m3_bf16q": (jnp.float8_e4m3fn, jnp.bfloat16, 0.05),
    "fp8_e5m2_f32q": (jnp.float8_e5m2, jnp.float32, 0.02),
}


@pytest.mark.parametrize("dtype,variant", spread_grid(list(DTYPES), VARIANTS, keep=2))
def test_cache_dtypes(dtype, variant):
    cache_dtype, q_dtype, scale = DTYPES[dtype]
    ker, want, n, kw = case(2, (1, 6, 1), (33, 6, 70), 4, 2, 64, 16, cache_dtype, q_dtype,
                            scale)
    out = kernel.ragged_paged_attention(*ker, **kw, variant=variant, chunk_blocks=2)
    assert out.dtype == q_dtype
    check(out, want, n, ATOL[q_dtype])


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_live_sequences(variant):
    ker, _, _, kw = case(2, (1, 6, 1), (33, 6, 70), 4, 2, 64, 16)
    ker = ker[:-1] + (jnp.zeros(1, jnp.int32),)
    out = kernel.ragged_paged_attention(*ker, **kw, variant=variant, chunk_blocks=2)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_batches_one_compile(variant):
    """Random ragged batches of one token bucket (fixed shapes): all right, one compile."""
    rng = np.random.default_rng(8)
    T, S, B, bs, hkv, d, trials = 24, 4, 6, 16, 2, 64, 12
    nb = S * B + 2
    kc, vc = (jnp.asarray(rng.standard_normal((2, nb, hkv, bs, d)), jnp.float32)
              for _ in range(2))  # unowned slots hold finite garbage that must stay unseen
    q = jnp.asarray(rng.standard_normal((T, 2 * hkv, d)), jnp.float32)
    kw = dict(sm_scale=0.125)

    def pallas_attention(*args, sliding_window):  # the name its compilations are counted by
        return kernel.ragged_paged_attention(*args, **kw, variant=variant, q_tile=8,
                                             chunk_blocks=2, sliding_window=sliding_window)
    attn = jax.jit(pallas_attention)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))
    compiles = []  # jax.monitoring's public compile event, one per XLA compilation of attn

    def listener(event, secs, fun_name=None, **_):
        if (event == "/jax/core/compile/backend_compile_duration"
                and fun_name == "jit(pallas_attention)"):
            compiles.append(secs)
    jax.monitoring.register_event_duration_secs_listener(listener)
    for _ in range(trials):
        n = int(rng.integers(0, S + 1))
        q_lens = np.where(rng.random(n) < 0.5, 1, rng.integers(1, 10, n))
        q_lens = q_lens[np.cumsum(q_lens) < T]  # keep a padding token
        kv_lens = q_lens + rng.integers(0, B * bs - q_lens + 1)
        cu = np.cumsum(np.concatenate([[0], q_lens, np.zeros(S - len(q_lens), int)]))
        args = (q, kc, vc, int(rng.integers(0, 2)),
                jnp.asarray(np.pad(kv_lens, (0, S - len(q_lens)), constant_values=999),
                            jnp.int32),
                jnp.asarray(rng.permutation(nb)[:S * B].reshape(S, B), jnp.int32),
                jnp.asarray(cu, jnp.int32), jnp.asarray([len(q_lens)], jnp.int32))
        window = jnp.int32(rng.choice([0, int(rng.integers(1, 60))]))
        check(attn(*args, sliding_window=window), ref(*args, sliding_window=window),
              int(q_lens.sum()), ATOL[jnp.float32])
    jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1  # (none: the event was renamed, and this fails, not passes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_over_layers_with_traced_layer_and_window(variant):
    """The model runner's use: jit(scan over layers), layer and window traced; 0 = no window."""
    ker, ref, n = make_case(np.random.default_rng(4), [3, 1, 9], [30, 41, 9], 4, 2, 64, 16,
                            layers=3)
    windows = jnp.array([0, 7, 20], jnp.int32)

    def run(attn, args):
        q, kc, vc, _, *meta = args

        def layer(carry, xs):
            i, w = xs
            return carry, attn(q, kc, vc, i, *meta, sm_scale=0.125, sliding_window=w)
        return jax.lax.scan(layer, 0, (jnp.arange(3), windows))[1]

    attn = functools.partial(kernel.ragged_paged_attention, variant=variant, chunk_blocks=2)
    out = jax.jit(functools.partial(run, attn))(ker)
    want = jax.jit(functools.partial(run, reference.ragged_paged_attention))(ref)
    for layer in range(3):
        check(out[layer], want[layer], n, ATOL[jnp.float32])


def test_attention_layer_pallas_backend():
    """The pallas backend's attention op (write_kv, then the kernel with its defaults) under
    jit, against the reference backend's."""
    from jaxllm.layers.attention import AttentionMetadata, KVCache
    from jaxllm.layers.backends import make_backend
    rng = np.random.default_rng(5)
    q_lens, kv_lens = [4, 1], [4, 21]
    _, (q, kc, vc, _, kvl, tables, cu, ns), n = make_case(rng, q_lens, kv_lens, 4, 2, 64, 16)
    k_new, v_new = (jnp.asarray(rng.standard_normal((q.shape[0], 2, 64)), jnp.float32)
                    for _ in range(2))
    pos = np.concatenate([np.arange(kl - ql, kl) for ql, kl in zip(q_lens, kv_lens)])
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = np.asarray(tables)[seq, pos // 16] * 16 + pos % 16
    md = AttentionMetadata(jnp.asarray(np.pad(slots, (0, q.shape[0] - n), constant_values=-1)),
                           kvl, tables, cu, ns)

    @functools.partial(jax.jit, static_argnames="backend", donate_argnums=3)
    def step(q, k, v, cache, md, backend):
        return make_backend(backend).attention(q, k, v, cache, LAYER, md, sm_scale=0.125)

    want, want_cache = step(q, k_new, v_new, KVCache(kc.copy(), vc.copy()), md, "reference")
    out, cache = step(q, k_new, v_new, KVCache(kc, vc), md, "pallas")
    check(out, want, n, ATOL[jnp.float32])
    for got, ref_cache in zip(cache, want_cache):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref_cache))


def test_tpu_double_buffering_has_no_races():
    """The interpreter's race detector watches the DMAs into the 2-slot page buffers."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interp
    ker, want, n, kw = case(2, (1, 6, 1), (33, 6, 70), 4, 2, 64, 16)
    out = kernel.ragged_paged_attention(*ker, **kw, variant="tpu", chunk_blocks=1,
                                        interpret=pltpu.InterpretParams(detect_races=True))
    check(out, want, n, ATOL[jnp.float32])
    assert not interp.races.races_found


def _decode_case(seed, hq, hkv, d):
    """A decode batch (bf16-exact f32 cache) in our layout and in jax's paged-attention one.

    jax's TPU kernel rounds K and V to bf16; values that are already bf16 make that exact.
    """
    q_lens, kv_lens, bs = [1] * 4, [7, 33, 64, 100], 16
    ker, ref, _ = make_case(np.random.default_rng(seed), q_lens, kv_lens, hq, hkv, d, bs,
                            cache_dtype=jnp.bfloat16, pad_tokens=0, pad_seqs=0)
    f32 = lambda args: (args[0], args[1].astype(jnp.float32), args[2].astype(jnp.float32),
                        *args[3:])
    ker, ref = f32(ker), f32(ref)
    q, _, _, _, kv_lens, tables, *_ = ref
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % 4)))
    # jax's kernels take one layer as [Hkv, pages, BS, D] and pre-scaled queries.
    k, v = (c[LAYER].transpose(1, 0, 2, 3) for c in ref[1:3])
    return ker, (q * d ** -0.5, k, v, kv_lens, tables)


@pytest.mark.parametrize("hq,hkv,d,variant", spread_grid([(8, 2, 64), (8, 1, 128)], VARIANTS,
                                                         keep=2))
def test_decode_matches_jax_tpu_paged_attention(variant, hq, hkv, d):
    ker, (q, k, v, kv_lens, tables) = _decode_case(6, hq, hkv, d)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        want = jax_tpu_paged(q, k, v, kv_lens, tables, pages_per_compute_block=4)
    out = kernel.ragged_paged_attention(*ker, sm_scale=d ** -0.5, variant=variant)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=ATOL[jnp.float32])


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_matches_jax_gpu_paged_attention(variant):
    d = 64
    ker, (q, k, v, kv_lens, tables) = _decode_case(7, 8, 2, d)
    want = jax_gpu_paged.paged_attention(q, k, v, tables, kv_lens, pages_per_compute_block=2,
                                         k_splits=4, interpret=True)
    out = kernel.ragged_paged_attention(*ker, sm_scale=d ** -0.5, variant=variant)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=ATOL[jnp.float32])


@pytest.mark.parametrize("variant,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("cache_dtype,q_dtype", [
    (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.float8_e5m2, jnp.bfloat16)])
def test_lowers(variant, platform, cache_dtype, q_dtype):
    """Lowers to a Mosaic / Triton custom call (no device here, so nothing is compiled)."""
    T, hq, hkv, d, bs, S, B = 32, 8, 2, 128, 16, 4, 8
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    cache = jax.ShapeDtypeStruct((2, 32, hkv, bs, d), cache_dtype)

    def f(q, kc, vc, layer, kvl, bt, cu, ns, window):
        return kernel.ragged_paged_attention(
            q, kc, vc, layer, kvl, bt, cu, ns, sm_scale=0.1, sliding_window=window,
            soft_cap=30.0, k_scale=0.5, v_scale=0.5, variant=variant, interpret=False)
    lowered = jax.jit(f).trace(
        jax.ShapeDtypeStruct((T, hq, d), q_dtype), cache, cache, i32(), i32(S), i32(S, B),
        i32(S + 1), i32(1), i32()).lower(lowering_platforms=(platform,))
    assert ("tpu_custom_call" if variant == "tpu" else "xla.gpu.triton") in lowered.as_text()


@pytest.mark.parametrize("shape,variant", spread_grid(["mixed_gqa4", "group3_head_dim24"],
                                                     VARIANTS, keep=2))
def test_sinks_match_reference(shape, variant):
    """Attention sinks in the kernels (interpret mode) equal the reference's; group 3 pads
    the group to 4 rows, whose sinks must not leak."""
    *spec, blocks = SHAPES[shape]
    ker, ref, n = make_case(np.random.default_rng(0), *spec)
    d = spec[4]
    kw = dict(sm_scale=d ** -0.5, sliding_window=None, soft_cap=None)
    sinks = jnp.asarray(np.random.default_rng(5).standard_normal(spec[2]).astype(np.float32) * 2)
    want = reference.ragged_paged_attention(*ref, sinks=sinks, **kw)
    plain = reference.ragged_paged_attention(*ref, **kw)
    assert float(jnp.abs(want[:n] - plain[:n]).max()) > 1e-2  # the sinks matter here
    q_tile, chunk = blocks or (None, None)
    out = kernel.ragged_paged_attention(*ker, **kw, variant=variant, q_tile=q_tile,
                                        chunk_blocks=chunk, sinks=sinks)
    check(out, want, n, ATOL[jnp.float32])
