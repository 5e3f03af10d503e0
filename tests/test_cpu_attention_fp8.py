"""The native CPU attention kernel on float8 KV caches (e4m3fn, e5m2; with and without per-layer
scales) and with attend_to (Gemma 3's bidirectional image tokens), against the pure-JAX
reference (issues 45 and 50); the CPU backend routes both to the kernel.

Written caches must equal the reference's bit for bit (saturation and round-to-nearest-even
included); outputs agree to f32 rounding (the kernel applies k_scale to the scores and v_scale
to the output, the reference to the values). The kernel is built on first use, as in
tests/test_cpu_attention.py: a build failure fails these tests.
"""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import run_on_isa, spread_grid
from pallas_kernels.ragged_paged_attention import kernel_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv
from test_cpu_attention import _case

FP8 = ("float8_e4m3fn", "float8_e5m2")


@jax.jit
def _write_and_attend(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns, kv_scales, kw):
    ks, vs = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    kc, vc = write_kv(kc, vc, layer, k, v, slots, k_scale=ks, v_scale=vs)
    return ragged_paged_attention(q, kc, vc, layer, kv_lens, tables, cu, ns, k_scale=ks,
                                  v_scale=vs, **kw), kc, vc


def _reference(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns, *, kv_scales=None,
               attend_to=None, sm_scale, soft_cap=None, sliding_window=None):
    """The reference's write_kv then ragged_paged_attention with the scales: (out, kc, vc)."""
    kw = dict(attend_to=attend_to, sliding_window=sliding_window)
    return _write_and_attend(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns,
                             kv_scales, _Static(sm_scale, soft_cap, kw))


class _Static(dict):
    """Keyword arguments for a jitted call: sm_scale and soft_cap static (hashed), the rest
    traced (None or arrays, sliding_window an int32 scalar)."""

    def __init__(self, sm_scale, soft_cap, traced):
        super().__init__(sm_scale=sm_scale, soft_cap=soft_cap, **traced)


jax.tree_util.register_pytree_node(
    _Static, lambda d: ((d["attend_to"], d["sliding_window"]), (d["sm_scale"], d["soft_cap"])),
    lambda aux, ch: _Static(*aux, dict(attend_to=ch[0], sliding_window=ch[1])))


@jax.jit
def _kernel_call(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns, kv_scales, kw):
    return kernel_cpu.ragged_paged_attention(q, k, v, kc, vc, layer, slots, kv_lens, tables,
                                             cu, ns, kv_scales=kv_scales, **kw)


def _kernel(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns, *, kv_scales=None,
            attend_to=None, sm_scale, soft_cap=None, sliding_window=None):
    """The kernel under jit: (out, kc, vc)."""
    kw = dict(attend_to=attend_to, sliding_window=sliding_window)
    return _kernel_call(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns, kv_scales,
                        _Static(sm_scale, soft_cap, kw))


def _bits(x):
    return np.asarray(x).view(np.uint8 if np.asarray(x).dtype.itemsize == 1 else np.uint32)


def _fp8_cache(rng, shape, dtype):
    """Random float8 pages over the format's whole range: magnitudes 1e-4..300 (subnormals to
    the largest exponents), saturated as a write would leave them."""
    top = float(jnp.finfo(dtype).max)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 2.5, shape)
    return jnp.asarray(np.clip(x, -top, top).astype(np.float32)).astype(dtype)


def _assert_close(got, want, n):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.abs(want[:n]).max()))
    np.testing.assert_allclose(got[:n], want[:n], rtol=1e-4, atol=1e-4 * scale)
    assert not got[n:].any(), "rows of no sequence must be zero"


def check_fp8(hq, hkv, d, bs, dtype, scales, ragged):
    """A decode or ragged step on a float8 cache: outputs as the reference's, and the written
    pages its bits, with values past the format's range (saturated) among them."""
    case = _case(hq * 7 + d + len(dtype), num_seqs=11, pad_seqs=2, hq=hq, hkv=hkv, d=d, bs=bs,
                 max_len=50, ragged=ragged)
    q, k, v, kc, vc, slots, kv_lens, tables, cu, ns = case
    rng = np.random.default_rng(d)
    kc, vc = (_fp8_cache(rng, kc.shape, dtype) for _ in range(2))
    k, v = k * 40, v * 300  # past 448 (e4m3) after the scales; inf and 1e6 past e5m2's too
    k = k.at[0, 0, :3].set(jnp.asarray([jnp.inf, -1e6, 1e-30]))
    v = v.at[1, 0, :2].set(jnp.asarray([-jnp.inf, 7e4]))
    sc = None if scales is None else jnp.asarray(scales, jnp.float32)
    kw = dict(sm_scale=d ** -0.5)
    n = int(cu[11])
    for layer in (1,):
        want, want_k, want_v = _reference(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu,
                                           ns, kv_scales=sc, **kw)
        got, got_k, got_v = _kernel(q, k, v, kc, vc, layer, slots, kv_lens, tables, cu, ns,
                                    kv_scales=sc, **kw)
        assert got_k.dtype == got_v.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(_bits(got_k), _bits(want_k))
        np.testing.assert_array_equal(_bits(got_v), _bits(want_v))
        written = np.abs(np.asarray(want_k[layer], np.float32))
        assert (written == float(jnp.finfo(dtype).max)).any(), "nothing saturated"
        assert not np.array_equal(_bits(got_k), _bits(kc)), "nothing was written"
        _assert_close(got, want, n)


# 48 cases; the default suite runs a spread of 5 that meets every value (conftest.spread_grid).
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,scales,ragged", spread_grid(
    [(8, 2, 64, 16), (6, 3, 32, 8), (4, 4, 128, 16), (4, 1, 20, 4)], list(FP8),
    [None, [1.0, 1.0], [0.37, 2.9]], [False, True], keep=9))
def test_fp8_kernel_matches_reference(hq, hkv, d, bs, dtype, scales, ragged):
    check_fp8(hq, hkv, d, bs, dtype, scales, ragged)


def _special_values(dtype):
    """Every finite value of the format, the midpoints between neighbours (ties: round to
    even) and the f32 values either side of them, zeros, f32 subnormals, infinities, NaNs and
    values past the range."""
    codes = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, dtype)).astype(np.float32)
    codes = np.unique(codes[np.isfinite(codes)])
    mids = ((codes[1:].astype(np.float64) + codes[:-1]) / 2).astype(np.float32)
    big = np.float32(jnp.finfo(dtype).max)
    return np.concatenate([
        codes, mids, np.nextafter(mids, np.float32(np.inf)),
        np.nextafter(mids, np.float32(-np.inf)),
        np.float32([0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, -np.nan, 1e30, -1e30]),
        big * np.float32([1.01, 1.05, 1.2, -1.07])]).astype(np.float32)


@pytest.mark.parametrize("dtype,scales", [
    ("float8_e4m3fn", None), ("float8_e5m2", (0.37, 2.9)),
    *(pytest.param(dt, sc, marks=pytest.mark.slow)
      for dt, sc in (("float8_e5m2", None), ("float8_e4m3fn", (0.37, 2.9)),
                     ("float8_e4m3fn", (3e-3, 1.0)), ("float8_e5m2", (3e-3, 1.0))))])
def test_fp8_write_bits_on_every_value(dtype, scales):
    """Every float8 value, its rounding ties and their neighbours, zeros of both signs,
    subnormals, infinities and values past the range are written as the reference's write_kv
    writes them (divided by the scale, saturated, rounded to nearest even); NaNs as NaNs."""
    x = _special_values(dtype)
    hkv, d, bs = 2, 20, 8  # d: two 8-value vectors, and a tail written one value at a time
    x = np.resize(x, -(-x.size // (hkv * d)) * hkv * d).reshape(-1, hkv, d)
    T = x.shape[0]
    nb = -(-T // bs) + 1
    kc = jnp.zeros((1, nb, hkv, bs, d), dtype)
    slots = jnp.asarray(np.random.default_rng(0).permutation(nb * bs)[:T].astype(np.int32))
    k, v = jnp.asarray(x), jnp.asarray(x[::-1])
    q = jnp.zeros((T, hkv, d), jnp.float32)
    meta = (jnp.zeros(1, jnp.int32), jnp.zeros((1, nb), jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.zeros(1, jnp.int32))  # no sequence: only the write
    sc = None if scales is None else jnp.asarray(scales, jnp.float32)
    _, got_k, got_v = _kernel(q, k, v, kc, kc, 0, slots, *meta, sm_scale=1.0, kv_scales=sc)
    ks, vs = (None, None) if sc is None else sc
    want_k, want_v = write_kv(kc, kc, 0, k, v, slots, k_scale=ks, v_scale=vs)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        # A NaN is stored as one of the format's NaNs: XLA's scatter of a float8 e5m2 NaN
        # writes another NaN code than its convert does (0x7F, not 0x7E), so not compared bitwise.
        nan = np.isnan(np.asarray(want, np.float32))
        assert nan.sum() >= 2 and np.isnan(np.asarray(got, np.float32)[nan]).all()
        np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])
    if scales is None:
        assert len(np.unique(_bits(got_k))) > 200  # most of the format's codes were written


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_reads_every_code_exactly(dtype):
    """Each of the format's 256 codes (subnormals of both signs, NaNs, e5m2's infinities) is
    read as its value: 256 one-key sequences, sequence s's value row all code s, so its output
    is that value (its one probability is 1); d = 64 reads values 8 at a time, d = 20 one at a
    time."""
    S = 256
    codes = np.arange(256, dtype=np.uint8)
    for d in (64, 20):
        pages = np.repeat(codes, d).reshape(1, S, 1, 1, d).view(getattr(ml_dtypes, dtype))
        vc = jnp.asarray(pages)
        z = jnp.zeros((S, 1, d), jnp.float32)
        out, _, _ = _kernel(z, z, z, jnp.zeros_like(vc), vc, 0, jnp.full(S, -1, jnp.int32),
                            jnp.ones(S, jnp.int32), jnp.arange(S, dtype=jnp.int32)[:, None],
                            jnp.arange(S + 1, dtype=jnp.int32), jnp.array([S], jnp.int32),
                            sm_scale=1.0)
        want = codes.view(getattr(ml_dtypes, dtype)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(out)[:, 0],  # NaN where NaN
                                      np.repeat(want[:, None], d, 1), err_msg=f"d={d}")


def _image_case(hq, hkv, d, seed=0):
    """A ragged step with image spans (attend_to: each image token's last key is its image's
    last token): a 70-query chunk whose image crosses the kernel's 16-query tasks and its
    128-key block (block size 4: 32 pages), a whole prompt with an image, a chunk whose image
    began in an earlier step (those keys in the cache), two decode rows and a padding row."""
    rng = np.random.default_rng(seed)
    bs, B, nbk = 4, 80, 512
    # (first query position, kv_len, image spans (start, end) as positions)
    seqs = [(150, 151, ()), (100, 170, ((110, 160),)), (0, 40, ((5, 30), (33, 34))),
            (200, 236, ((190, 220),)), (60, 61, ())]
    S = len(seqs) + 1
    tables = rng.permutation(nbk)[:S * B].reshape(S, B).astype(np.int32)
    kv_lens, cu, slots, attend = np.zeros(S, np.int32), [0], [], []
    for s, (p0, end, spans) in enumerate(seqs):
        pos = np.arange(p0, end)
        last = pos.copy()
        for a, b in spans:
            last[(pos >= a) & (pos < b)] = b - 1
        kv_lens[s] = end
        cu.append(cu[-1] + len(pos))
        slots.append(tables[s, pos // bs] * bs + pos % bs)
        attend.append(last)
    T = cu[-1] + 3  # padding rows
    slots = np.concatenate(slots + [np.full(3, -1)]).astype(np.int32)
    attend = np.concatenate(attend + [np.zeros(3)]).astype(np.int32)
    cu = np.array(cu + [cu[-1]], np.int32)
    q = rng.standard_normal((T, hq, d), np.float32)
    k, v = (rng.standard_normal((T, hkv, d), np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((2, nbk, hkv, bs, d), np.float32) for _ in range(2))
    args = tuple(map(jnp.asarray, (q, k, v, kc, vc)))
    meta = tuple(map(jnp.asarray, (slots, kv_lens, tables, cu, np.array([len(seqs)], np.int32))))
    return args, meta, jnp.asarray(attend), int(cu[len(seqs)])


def check_attend_to(hq, hkv, d, window, cache_dtype, soft_cap=None):
    (q, k, v, kc, vc), (slots, *meta), attend, n = _image_case(hq, hkv, d)
    kc, vc = kc.astype(cache_dtype), vc.astype(cache_dtype)
    sc = jnp.asarray([0.8, 1.7], jnp.float32) if "float8" in cache_dtype else None
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=soft_cap)
    want, want_k, _ = _reference(q, k, v, kc, vc, 1, slots, *meta, kv_scales=sc,
                                 attend_to=attend, **kw)
    causal, _, _ = _reference(q, k, v, kc, vc, 1, slots, *meta, kv_scales=sc, **kw)
    assert np.abs(np.asarray(causal)[:n] - np.asarray(want)[:n]).max() > 0.1  # images matter
    got, got_k, _ = _kernel(q, k, v, kc, vc, 1, slots, *meta, kv_scales=sc, attend_to=attend,
                            **kw)
    np.testing.assert_array_equal(_bits(got_k), _bits(want_k))
    _assert_close(got, want, n)


@pytest.mark.parametrize("hq,hkv,d,window,cache_dtype,soft_cap", [
    (8, 2, 64, None, "float32", None),  # GQA
    (8, 2, 64, 7, "float8_e4m3fn", 5.0),  # a window shorter than the images
    pytest.param(4, 4, 32, 40, "float8_e4m3fn", 5.0, marks=pytest.mark.slow),
    pytest.param(6, 1, 128, None, "float8_e5m2", None, marks=pytest.mark.slow),
    pytest.param(6, 3, 20, 100, "bfloat16", None, marks=pytest.mark.slow),
])
def test_attend_to_matches_reference(hq, hkv, d, window, cache_dtype, soft_cap):
    """Image tokens see their whole image, as the reference's attend_to, over images that
    cross the kernel's query tasks and key blocks or began in an earlier step, with GQA, a
    sliding window, a soft cap and float8 caches."""
    check_attend_to(hq, hkv, d, window, cache_dtype, soft_cap)


@pytest.mark.parametrize("case", ["fp8", "fp8_scales", "attend_to"])
def test_cpu_backend_runs_them_in_the_native_kernel(case):
    """CpuBackend.attention calls the native kernel (its FFI target in the step's program) for
    float8 caches with or without scales and for attend_to; a float16 cache runs the
    reference."""
    from jaxllm.layers.attention import AttentionMetadata, KVCache
    from jaxllm.layers.backends.cpu import CpuBackend

    (q, k, v, kc, vc), (slots, lens, tables, cu, ns), attend, _ = _image_case(4, 2, 32)
    md = AttentionMetadata(slots, lens, tables, cu, ns,
                           attend_to=attend if case == "attend_to" else None)
    dtype = "float32" if case == "attend_to" else "float8_e4m3fn"
    scales = jnp.ones(2, jnp.float32) if case == "fp8_scales" else None

    def program(dtype):
        f = jax.jit(lambda q, k, v, kc, vc: CpuBackend().attention(
            q, k, v, KVCache(kc, vc), 1, md, sm_scale=0.1, kv_scales=scales))
        return f.lower(q, k, v, kc.astype(dtype), vc.astype(dtype)).as_text()

    assert kernel_cpu.TARGET in program(dtype)
    assert kernel_cpu.TARGET not in program("float16")


ISAS = {"x86-64-v3": {"avx2", "fma", "f16c"}, "x86-64-v2": {"sse4_2"}}


@pytest.mark.slow  # a kernel build per ISA (tens of seconds on 2 cores) and a child each
@pytest.mark.parametrize("march", list(ISAS))
def test_fp8_and_attend_to_on_each_isa_path(march):
    """The same checks on the kernel built for AVX2 with F16C (x86-64-v3: float8 widened
    through f16 in hardware) and for SSE4.2 (x86-64-v2: one value at a time)."""
    run_on_isa(march, ISAS[march], (
        "import test_cpu_attention_fp8 as t\n"
        "for dt in t.FP8: t.check_fp8(8, 2, 64, 16, dt, (0.37, 2.9), True)\n"
        "t.test_fp8_write_bits_on_every_value('float8_e4m3fn', (0.37, 2.9))\n"
        "t.test_fp8_write_bits_on_every_value('float8_e5m2', None)\n"
        "t.check_attend_to(8, 2, 64, 7, 'float8_e4m3fn')\n"
        "for dt in t.FP8: t.test_fp8_reads_every_code_exactly(dt)\n"))
