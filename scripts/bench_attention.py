"""Microbenchmark of one ragged paged-attention call: time per call and KV bandwidth.

The batch: `--seqs` sequences of `--context` tokens each (this step's tokens included) share
`--tokens` query tokens (tokens == seqs: decode; one sequence with tokens == context: prefill).
Bandwidth: bytes of the KV pages the queries can see (K and V, one layer; a sliding window
skips the pages before it) over the time per call.
Runs anywhere: on CPU the reference or the native kernel (--backend cpu, f32, bf16 or float8
cache, a float8 one with scales of 1.0 as the reference gets them; the Pallas
kernels only interpret there, which measures the interpreter); unchanged on a TPU/GPU host with
--backend pallas.

    python scripts/bench_attention.py --tokens 64 --seqs 64 --context 512 --backend reference
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention import NATIVE_CPU_CACHE_DTYPES
from pallas_kernels.ragged_paged_attention import kernel, kernel_cpu, reference


def make_batch(tokens, seqs, context, page_size, q_heads, kv_heads, head_dim, dtype, layers,
               window):
    """Random q, caches and metadata in the reference's layout; returns (args, KV bytes read)."""
    if not seqs <= tokens <= seqs * context:
        raise SystemExit("need seqs <= tokens <= seqs * context")
    rng = np.random.default_rng(0)
    pages = -(-context // page_size)
    q_lens = np.full(seqs, tokens // seqs)
    q_lens[-1] += tokens - q_lens.sum()
    cache_shape = (layers, seqs * pages, kv_heads, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(cache_shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(cache_shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((tokens, q_heads, head_dim), np.float32),
                    jnp.bfloat16 if k.dtype.itemsize == 1 else dtype)
    tables = rng.permutation(seqs * pages).reshape(seqs, pages).astype(np.int32)
    meta = (np.full(seqs, context, np.int32), tables,
            np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
            np.array([seqs], np.int32))
    first_key = np.maximum(context - q_lens - (window or context) + 1, 0)
    pages_read = (pages - first_key // page_size).sum()
    kv_bytes = 2 * pages_read * page_size * kv_heads * head_dim * k.dtype.itemsize
    return (q, k, v, layers - 1, *map(jnp.asarray, meta)), kv_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", default="8/2", help="query heads / kv heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16",
                   help="cache dtype: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2")
    p.add_argument("--backend", choices=("reference", "cpu", "pallas"), default="reference")
    p.add_argument("--variant", choices=("tpu", "gpu"), default=None,
                   help="Pallas variant (default: by platform)")
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--sinks", action="store_true",
                   help="attention sinks (GPT-OSS): one learned logit per query head")
    p.add_argument("--layers", type=int, default=2,
                   help="layers in the stacked cache, read in turn (more than fit the caches: "
                        "the pages come from memory, as in a model's step)")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()

    hq, hkv = map(int, a.heads.split("/"))
    args, kv_bytes = make_batch(a.tokens, a.seqs, a.context, a.page_size, hq, hkv,
                                a.head_dim, jnp.dtype(a.dtype), a.layers, a.sliding_window)
    scale = 1.0 if jnp.dtype(a.dtype).itemsize == 1 else None
    kw = dict(sm_scale=a.head_dim ** -0.5, k_scale=scale, v_scale=scale)
    sinks = (jnp.asarray(np.random.default_rng(1).standard_normal(hq), jnp.float32)
             if a.sinks else None)
    if sinks is not None:
        kw["sinks"] = sinks
    if a.backend == "cpu":
        if jnp.dtype(a.dtype) not in NATIVE_CPU_CACHE_DTYPES:
            raise SystemExit("--backend cpu: the native kernel reads float32, bfloat16 or "
                             "float8 (e4m3fn, e5m2) caches")
        scales = None if scale is None else jnp.full((2,), scale, jnp.float32)
        # The kernel also writes this step's K/V: padding slots (-1) write nothing, so every
        # call sees the same cache; the caches are donated and come back (written in place).
        new_kv = jnp.zeros((a.tokens, hkv, a.head_dim), jnp.float32)
        slots = jnp.full((a.tokens,), -1, jnp.int32)

        def fn(q, kc, vc, layer, *meta, sliding_window):
            return kernel_cpu.ragged_paged_attention(
                q, new_kv, new_kv, kc, vc, layer, slots, *meta, sm_scale=kw["sm_scale"],
                sliding_window=sliding_window, sinks=sinks, kv_scales=scales)
    else:
        attend = (functools.partial(kernel.ragged_paged_attention, variant=a.variant, **kw)
                  if a.backend == "pallas" else
                  functools.partial(reference.ragged_paged_attention, **kw))

        def fn(*xs, sliding_window):  # the caches come back unchanged
            return attend(*xs, sliding_window=sliding_window), xs[1], xs[2]
    step = jax.jit(lambda *xs: fn(*xs[:-1], sliding_window=xs[-1]), donate_argnums=(1, 2))
    window = None if a.sliding_window is None else jnp.int32(a.sliding_window)

    calls = 0

    def run():  # each call reads the next layer, as a model's step does (--layers 12: from DRAM)
        nonlocal args, calls
        calls += 1
        _, kc, vc = out = step(*args[:3], jnp.int32(calls % a.layers), *args[4:], window)
        args = (args[0], kc, vc, *args[3:])
        jax.block_until_ready(out)

    t = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(a.iters):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    best, med = min(times), statistics.median(times)
    print(f"backend={a.backend} platform={jax.default_backend()} tokens={a.tokens} "
          f"seqs={a.seqs} context={a.context} page={a.page_size} heads={a.heads} "
          f"d={a.head_dim} dtype={a.dtype} window={a.sliding_window} sinks={a.sinks}")
    print(f"compile+first {compile_s:.2f} s | per call: best {best * 1e3:.3f} ms, "
          f"median {med * 1e3:.3f} ms | KV read {kv_bytes / 2**20:.1f} MiB -> "
          f"{kv_bytes / best / 1e9:.2f} GB/s (best)")


if __name__ == "__main__":
    main()
