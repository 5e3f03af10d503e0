"""Batch invariance of the native CPU kernels and the sampler (issue 26): a row's result is the
same bits whatever else shares the call, how many rows there are, and how a prompt is split.

Each test computes a target's rows alone and then among other rows (more of them, in other
positions, a prompt in other chunks) and compares them bitwise; a check that merely agreed to
a tolerance would let the per-M rounding differences these tests exist to catch through.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.sampler import sample_rows
from jaxllm.models.params import rms_norm
from jaxllm.sequence import SamplingTensors
from pallas_kernels.activation import kernel_cpu as activation_cpu
from pallas_kernels.matmul import kernel_cpu as matmul_cpu
from pallas_kernels.ragged_paged_attention import kernel_cpu as attention_cpu
from test_sampler import req

# 1-4 rows stream the weights, more run the register-blocked GEMM (6-row blocks and their
# remainders, a second block of 48 rows past 48).
ROWS = (1, 2, 3, 4, 5, 6, 7, 11, 47, 48, 49, 70)


@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16", "bits"])
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k,n", [(600, 150), (37, 1030)])  # K chunks of 256; an odd K, 4+ strips
def test_matmul_rows_do_not_depend_on_m(w_dtype, x_dtype, k, n):
    """Every row of x[:m] @ w equals that row of x[:70] @ w bitwise, for each m, in each
    result kind (f32, bf16, the greedy head's argmax)."""
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((1, k, n), np.float32),
                    jnp.float32 if w_dtype == "float32" else jnp.bfloat16)
    if w_dtype == "bits":
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    packed = matmul_cpu.pack(w)
    x = jnp.asarray(rng.standard_normal((max(ROWS), k), np.float32), x_dtype)
    kinds = {"f32": lambda x: matmul_cpu.matmul(x, packed, n=n),
             "bf16": lambda x: matmul_cpu.matmul(x, packed, n=n, out_dtype=jnp.bfloat16),
             "argmax": lambda x: matmul_cpu.argmax(x, packed, n=n)}
    for kind, f in kinds.items():
        full = np.asarray(f(x))
        for m in ROWS:
            np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m], err_msg=f"{kind} m={m}")
    # and the rows are the plain f32 product (to rounding), so equal bits mean right bits
    want = np.asarray(x, np.float32) @ np.asarray(jax.lax.bitcast_convert_type(w, jnp.bfloat16)
                                                  if w_dtype == "bits" else w, np.float32)[0]
    np.testing.assert_allclose(np.asarray(kinds["f32"](x)), want, rtol=1e-4, atol=1e-4 * k)


# bf16 x against bf16 W runs AMX tiles where the CPU has them: blocks of 16 and 32 rows and
# their remainders; K in tiles of 32 and a part tile (30, 33: K shorter than a tile; 1000).
AMX_ROWS = (1, 15, 16, 17, 31, 32, 33, 48, 49, 100)


@pytest.mark.parametrize("k", [30, 32, 33, 768, 1000])
def test_bf16_matmul_rows_do_not_depend_on_m_or_their_neighbours(k):
    """With bf16 x and W, every row of x[:m] @ w, and of the rows shuffled, equals that row of
    x @ w bitwise (rows change places within and between the tiles of 16 rows)."""
    rng = np.random.default_rng(k)
    n = 40  # two whole strips and a part one
    w = jnp.asarray(rng.standard_normal((1, k, n), np.float32), jnp.bfloat16)
    packed = matmul_cpu.pack(w)
    x = jnp.asarray(rng.standard_normal((max(AMX_ROWS), k), np.float32), jnp.bfloat16)
    f = jax.jit(lambda x: matmul_cpu.matmul(x, packed, n=n))
    full = np.asarray(f(x))
    for m in AMX_ROWS:
        np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m], err_msg=f"m={m}")
    perm = rng.permutation(len(x))
    np.testing.assert_array_equal(np.asarray(f(x[perm])), full[perm])
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)[0]
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_rows_do_not_depend_on_t(dtype):
    """The XLA RMSNorm between the kernels: a decode step's token count (1-48) sets its row
    count, and XLA:CPU's own mean summed 2-7 rows in another order than 1 or 8+."""
    cfg = SimpleNamespace(norm_offset=0.0, norm_scale_f32=False, rms_norm_eps=1e-5)
    f = jax.jit(lambda x, w: rms_norm(x, w, cfg))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 576), np.float32) * 3, dtype)
    w = jnp.asarray(rng.random(576) + 0.5, dtype)
    full = np.asarray(f(x, w).astype(jnp.float32))
    for t in range(1, 17):
        np.testing.assert_array_equal(np.asarray(f(x[:t], w).astype(jnp.float32)), full[:t],
                                      err_msg=f"t={t}")
    xf = np.asarray(x, np.float64)  # and it is the RMSNorm (to rounding)
    want = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5) * np.asarray(w, np.float64)
    np.testing.assert_allclose(full, want, rtol=1e-2 if dtype == "bfloat16" else 1e-5)


def test_silu_mul_rows_do_not_depend_on_t():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((300, 2, 1536), np.float32))
    for dtype in ("float32", "bfloat16"):
        full = np.asarray(activation_cpu.silu_and_mul(x, dtype).astype(jnp.float32))
        for t in (1, 3, 21, 22, 299):
            got = np.asarray(activation_cpu.silu_and_mul(x[:t], dtype).astype(jnp.float32))
            np.testing.assert_array_equal(got, full[:t], err_msg=f"{dtype} t={t}")


class _Cache:
    """One layer of paged K/V holding a target sequence of L positions (block size 4, so a
    few hundred positions span several of the kernel's 32-page blocks) and random others, and
    `attend` running the kernel on any mix of query ranges of them."""

    HQ, HKV, D, BS, NB = 6, 2, 64, 4, 400

    def __init__(self, L, seed=0, cache_dtype="bfloat16", kv_scales=None, attend_to=None):
        """kv_scales: None or (k_scale, v_scale) for every call. attend_to: None (causal) or
        int32 [L], the target's last visible key position per position (image spans)."""
        rng = np.random.default_rng(seed)
        self.L = L
        self.q = rng.standard_normal((L, self.HQ, self.D), np.float32)
        self.k = rng.standard_normal((L, self.HKV, self.D), np.float32)
        self.v = rng.standard_normal((L, self.HKV, self.D), np.float32)
        self.cache = jnp.asarray(rng.standard_normal((2, 1, self.NB, self.HKV, self.BS, self.D),
                                                     np.float32), cache_dtype)
        self.B = -(-L // self.BS)
        self.tables = rng.permutation(self.NB)[:4 * self.B].reshape(4, self.B).astype(np.int32)
        self.kv_scales = None if kv_scales is None else jnp.asarray(kv_scales, jnp.float32)
        self.attend_to = attend_to

    def attend(self, parts, window=None):
        """parts: (table row, first query position, end): that sequence's queries first..end-1
        with kv_len = end, all in one call; row 0 is the target (its q/k/v), the others reuse
        the target's q/k/v rows at their positions but their own pages (and attend causally).
        Outputs per part."""
        q, k, v, slots, lens, cu, att = [], [], [], [], [], [0], []
        for row, a, b in parts:
            pos = np.arange(a, b)
            att.append(pos if self.attend_to is None or row else self.attend_to[pos])
            q.append(self.q[pos] * (1 + row)), k.append(self.k[pos]), v.append(self.v[pos])
            slots.append(self.tables[row, pos // self.BS] * self.BS + pos % self.BS)
            lens.append(b), cu.append(cu[-1] + b - a)
        rows = [p[0] for p in parts]
        out, kc, vc = attention_cpu.ragged_paged_attention(
            jnp.asarray(np.concatenate(q)), jnp.asarray(np.concatenate(k)),
            jnp.asarray(np.concatenate(v)), self.cache[0], self.cache[1], 0,
            jnp.asarray(np.concatenate(slots).astype(np.int32)), jnp.asarray(np.int32(lens)),
            jnp.asarray(self.tables[rows]), jnp.asarray(np.int32(cu)),
            jnp.asarray([len(parts)], jnp.int32), sm_scale=0.125, sliding_window=window,
            kv_scales=self.kv_scales, attend_to=None if self.attend_to is None
            else jnp.asarray(np.concatenate(att).astype(np.int32)))
        self.cache = jnp.stack([kc, vc])  # what was written stays (the same values again)
        out = np.asarray(out)
        return [out[cu[i]:cu[i + 1]] for i in range(len(parts))]

    def prefill(self, window=None):
        """Every position's K/V written (the target's whole prompt in one call): the state the
        splits below start from."""
        return self.attend([(0, 0, self.L)], window)[0]


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_attention_query_does_not_depend_on_batch_or_chunks(window, cache_dtype):
    """A query's output is the same bits in a whole-prompt step, in chunked prefill at any
    split, as a decode row, and next to other sequences (which change the task split); a
    float8 cache with its layer's scales too."""
    c = _Cache(L=300, cache_dtype=cache_dtype,
               kv_scales=(0.5, 3.0) if "float8" in cache_dtype else None)
    whole = c.prefill(window)
    for chunk in (1, 7, 16, 37, 129):  # chunked prefill, over a cache holding every position
        for a in range(0, c.L, chunk):
            b = min(a + chunk, c.L)
            got = c.attend([(0, a, b)], window)[0]
            np.testing.assert_array_equal(got, whole[a:b], err_msg=f"chunk {chunk} at {a}")
    for others in ([(1, 0, 5)], [(2, 40, 41), (1, 0, 299), (3, 10, 11)]):
        for at in (0, len(others)):
            parts = others[:at] + [(0, 250, 300)] + others[at:]
            got = c.attend(parts, window)[at]
            np.testing.assert_array_equal(got, whole[250:300], err_msg=f"{parts}")


@pytest.mark.parametrize("window", [None, 50])
def test_attention_image_query_does_not_depend_on_batch_or_chunks(window):
    """Bidirectional image tokens (attend_to, Gemma 3): an image's queries see the whole image
    and get the same bits in a whole-prompt step, in chunks that end outside images (as the
    scheduler splits prompts), and next to other sequences; the images cross the kernel's
    16-query tasks and its 32-page (128-key) blocks."""
    spans = ((20, 61), (100, 160), (250, 256))
    attend = np.arange(300)
    for a, b in spans:
        attend[a:b] = b - 1
    c = _Cache(L=300, cache_dtype="bfloat16", attend_to=attend)
    whole = c.prefill(window)
    assert not np.array_equal(whole, _Cache(L=300, cache_dtype="bfloat16").prefill(window))
    for cuts in ((20, 61, 100, 160, 250, 256), (10, 61, 99, 170, 249, 299), (64, 200)):
        bounds = (0, *cuts, 300)
        for a, b in zip(bounds, bounds[1:]):
            got = c.attend([(0, a, b)], window)[0]
            np.testing.assert_array_equal(got, whole[a:b], err_msg=f"{a}:{b} of {cuts}")
    for others in ([(1, 0, 5)], [(2, 40, 41), (1, 0, 299), (3, 10, 11)]):
        parts = others + [(0, 90, 170)]
        np.testing.assert_array_equal(c.attend(parts, window)[-1], whole[90:170])


@pytest.mark.slow  # an engine of its own (~20 s); the layers' row tests above stay default
def test_sampled_row_does_not_depend_on_batch():
    """sample_rows over the real vocabulary: a seeded row (top_p, top_k or plain, with
    logprobs) gives the same token and logprobs alone, in a batch of 9, of 40 and of 64,
    whichever logit chunk sizes (1, 16, 64 rows) and sampling groups it falls in."""
    V, S = 49152, 64
    f = jax.jit(lambda h, n, t: sample_rows(h, n, lambda x: x, t))
    rng = np.random.default_rng(0)
    kinds = [dict(temperature=0.9, top_p=0.9, logprobs=2), dict(temperature=0.8, logprobs=1),
             dict(temperature=1.0, top_k=50), dict(temperature=0.0, logprobs=3)]
    for trial, kind in enumerate(kinds):
        logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
        target = req(seed=trial, **kind)
        alone = f(jnp.asarray(logits), np.int32(1), SamplingTensors.from_seqs(
            [target], S, V, max_logprobs=5, penalty_width=64))
        for n, at in ((9, 4), (40, 33), (64, 17)):
            rs = [req(seed=100 + i, temperature=0.7, top_p=0.95 if i % 2 else 1.0)
                  for i in range(n)]
            rs[at] = target
            lg = rng.standard_normal((S, V)).astype(np.float32) * 3
            lg[at] = logits[0]
            out = f(jnp.asarray(lg), np.int32(n), SamplingTensors.from_seqs(
                rs, S, V, max_logprobs=5, penalty_width=64))
            for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(out)):
                np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[at],
                                              err_msg=f"{kind} n={n}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_layer_rows_do_not_depend_on_t(make_tiny_checkpoint, load, dtype):
    """A MoE layer's MLP on the CPU backend (router and shared-expert gate in the native
    matmul, experts in the grouped matmul, a shared expert) gives each token the same bits
    alone and among 1-70 others in any order."""
    from flax import nnx

    model, cfg, _ = load(make_tiny_checkpoint("qwen2_moe"), dtype=dtype)
    assert model.backend.name == "cpu" and model.backend.batch_variance(cfg, dtype) is None
    # The weights as the runner holds them (packed; resident, so read with the layer index)
    nnx.update(model, model.backend.relayout(nnx.split(model)[1], cfg))
    group = next(g for g, grp in zip(model.layers, model.groups) if grp.kind == "moe")
    w = {k: v[...] for k, v in vars(group).items() if isinstance(v, nnx.Param)}
    assert set(w) >= {"router", "experts_gate_up", "shared_gate", "gate_up"}
    f = jax.jit(lambda x: group.mlp(model.backend, w, x, jnp.int32(0))[0])
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((max(ROWS), cfg.hidden_size)), dtype)
    full = np.asarray(f(x).astype(jnp.float32))
    assert np.abs(full).max() > 0
    for t in ROWS:
        rows = rng.permutation(max(ROWS))[:t]
        np.testing.assert_array_equal(np.asarray(f(x[rows]).astype(jnp.float32)), full[rows],
                                      err_msg=f"t={t}")


def test_backends_say_why_they_are_not_batch_invariant():
    """What --batch-invariant refuses: the XLA backends, the CPU backend without its native
    matmul, or with a cache dtype its attention kernel does not take (MoE layers it runs
    invariant: `test_moe_layer_rows_do_not_depend_on_t`)."""
    from jaxllm.layers.backends.cpu import CpuBackend
    from jaxllm.layers.backends.pallas import PallasBackend
    from jaxllm.layers.backends.reference import ReferenceBackend

    from jaxllm.layers.quantization import QuantSpec

    dense = SimpleNamespace(moe_layers=(), num_experts=0, quant=None, lora=None, vision=None)
    moe = SimpleNamespace(moe_layers=(False, True), num_experts=8, quant=None, lora=None,
                          vision=None)
    assert CpuBackend().batch_variance(dense, jnp.bfloat16) is None
    gemma3_images = SimpleNamespace(**{**vars(dense),
                                       "vision": SimpleNamespace(bidirectional_images=True)})
    # Gemma 3's bidirectional image tokens and float8 caches run the native kernel too
    assert CpuBackend().batch_variance(gemma3_images, jnp.float32) is None
    assert CpuBackend().batch_variance(dense, jnp.float32) is None
    for backend in (ReferenceBackend(), PallasBackend()):
        assert "XLA dots" in backend.batch_variance(dense, jnp.float32)
    assert "native matmul" in CpuBackend(native_matmul=False).batch_variance(dense, jnp.float32)
    for fp8_cache in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        assert CpuBackend().batch_variance(dense, fp8_cache) is None
    assert "float16 KV cache" in CpuBackend().batch_variance(dense, jnp.float16)
    assert CpuBackend().batch_variance(moe, jnp.float32) is None
    assert "native matmul" in CpuBackend(native_matmul=False).batch_variance(moe, jnp.float32)
    # Quantized projections: int8/int4 in the native matmul (invariant), fp8 and quantized
    # experts in XLA's dots.
    int8, fp8 = QuantSpec("compressed-tensors", "int8"), QuantSpec("fp8", "float8_e4m3fn")
    native = CpuBackend(native_quant=True)
    assert native.batch_variance(SimpleNamespace(**{**vars(dense), "quant": int8}),
                                 jnp.float32) is None
    assert "float8_e4m3fn weights run XLA's dots" in CpuBackend().batch_variance(
        SimpleNamespace(**{**vars(dense), "quant": fp8}), jnp.float32)
    assert "quantized experts" in native.batch_variance(
        SimpleNamespace(**{**vars(moe), "quant": int8}), jnp.float32)
    assert "LoRA" in CpuBackend().batch_variance(
        SimpleNamespace(**{**vars(dense), "lora": object()}), jnp.float32)


def test_batch_invariant_flag_refuses_the_reference_backend(tiny_llama):
    from jaxllm import LLM
    from jaxllm.config import ConfigError

    with pytest.raises(ConfigError, match="--batch-invariant: .*reference backend's XLA dots"):
        LLM(tiny_llama, attention_backend="reference", batch_invariant=True,
            max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=16)
