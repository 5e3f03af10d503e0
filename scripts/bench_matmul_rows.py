"""Microbenchmark of the native CPU matmul at few rows: ms per call (wall, and the process's CPU
time over both cores, which the machine's other load disturbs less) of one K x N projection at
each row count M, and t(M) / t(1), the cost of a speculative verify step's rows against a
decode step's one.

One jitted `lax.scan` runs the kernel on each of `--layers` stacked layers in turn, so that the
weights stream from memory as in a model's forward pass (the time per call is the scan's over
the layers); the row counts alternate, best of `--reps`. The build follows $JAXLLM_CPU_MARCH
(`pallas_kernels/cpu_ffi.py`): `JAXLLM_CPU_MARCH=haswell` measures the AVX2 path.

    python scripts/bench_matmul_rows.py --shapes 576x1536 2048x8192 --rows 1 2 5 8 64
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import kernel_cpu


def runner(n: int):
    def run(x, w):
        def body(c, layer):
            y = kernel_cpu.matmul(x, w, layer, n=n)
            return c + y[0, 0], None
        return jax.lax.scan(body, jnp.float32(0), jnp.arange(w.shape[0], dtype=jnp.int32))[0]
    return jax.jit(run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["576x1536", "2048x8192"], help="KxN")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 64])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="weights and activations: float32, bfloat16 (both bf16), or "
                        "bf16w (bf16 weights, f32 activations)")
    p.add_argument("--mib", type=float, default=256, help="weight bytes streamed per call")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if not kernel_cpu.available():
        raise SystemExit("the CPU matmul kernel could not be built (see the log)")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        K, N = map(int, shape.split("x"))
        for dtype in args.dtypes:
            wdt = jnp.float32 if dtype == "float32" else jnp.bfloat16
            xdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
            per = K * N * jnp.dtype(wdt).itemsize
            L = max(1, int(args.mib * 2**20 // per))
            w = jnp.asarray(rng.standard_normal((L, K, N), np.float32) * 0.05, wdt)
            if wdt == jnp.bfloat16:
                w = jax.lax.bitcast_convert_type(w, jnp.uint16)
            w = kernel_cpu.pack(w)
            f = runner(N)
            xs = {m: jnp.asarray(rng.standard_normal((m, K), np.float32), xdt)
                  for m in args.rows}
            for m in args.rows:
                jax.block_until_ready(f(xs[m], w))  # compile
            best = {m: float("inf") for m in args.rows}
            cpu = dict(best)
            for _ in range(args.reps):
                for m in args.rows:
                    t, c = time.perf_counter(), time.process_time()
                    jax.block_until_ready(f(xs[m], w))
                    best[m] = min(best[m], (time.perf_counter() - t) / L)
                    cpu[m] = min(cpu[m], (time.process_time() - c) / L)
            for name, ts in (("wall", best), ("cpu", cpu)):
                cells = "  ".join(f"M={m} {ts[m] * 1e3:.3f}" for m in args.rows)
                ratio = "  ".join(f"t({m})/t(1) {ts[m] / ts[args.rows[0]]:.2f}"
                                  for m in args.rows[1:] if m <= 8)
                print(f"{K}x{N} {dtype:8s} L={L:3d} {name} ms/call: {cells}  |  {ratio}",
                      flush=True)


if __name__ == "__main__":
    main()
