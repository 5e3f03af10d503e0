"""Microbenchmark of the native CPU matmul against XLA's dot on a model's layer projections.

One jitted `lax.scan` over the layers runs the four projections (qkv, o, gate_up, down) of a
Llama-shaped model on `--rows` activation rows, once with the packed kernel
(`pallas_kernels/matmul`) and once with `jnp.dot` on the row-major weights (XLA slices each
layer's weights out of the scan), alternating, best of `--reps`. Prints ms per pass, weight
bandwidth and GFLOP/s for each. With --dtype bfloat16, XLA converts every weight to f32 on every
call, and the native pass measures slower next to it than alone (SmolLM2, 1 row: 15-18 ms against
10.7 alone): compare bf16 in the engine (`scripts/compare_peers.py`) instead.

    python scripts/bench_matmul.py --dims smollm2 --dtype bfloat16 --rows 1 4 64 512
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import kernel_cpu

DIMS = {  # hidden, FFN, q + k + v width, layers
    "smollm2": (576, 1536, 960, 30),
    "llama124m": (768, 2048, 1280, 12),
}


def chain(matmul, E: int, F: int):
    """The layer scan: h -> qkv -> o -> gate_up -> down, each output cut to the next input and
    cast to h's dtype (a bf16 model's activations are bf16)."""
    def run(h, ws):
        def body(h, layer):
            a = matmul(h, ws, 0, layer)[:, :E].astype(h.dtype)
            b = matmul(a, ws, 1, layer)
            c = (matmul((b * 1e-2).astype(h.dtype), ws, 2, layer)[:, :F] * 1e-2).astype(h.dtype)
            return (h + 1e-2 * matmul(c, ws, 3, layer)).astype(h.dtype), None

        return jax.lax.scan(body, h, jnp.arange(ws[0].shape[0], dtype=jnp.int32))[0]
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", choices=DIMS, default="smollm2")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    if not kernel_cpu.available():
        raise SystemExit("the CPU matmul kernel could not be built (see the log)")
    E, F, QKV, L = DIMS[args.dims]
    rng = np.random.default_rng(0)
    shapes = [(L, E, QKV), (L, E, E), (L, E, 2 * F), (L, F, E)]
    ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.05, args.dtype) for s in shapes]
    # bf16 as its bits, as the engine stores it: XLA:CPU converts a bf16 array that enters a
    # loop to f32, whole, on every call
    packed = [kernel_cpu.pack(w if w.dtype == jnp.float32
                              else jax.lax.bitcast_convert_type(w, jnp.uint16)) for w in ws]
    widths = (QKV, E, 2 * F, E)
    nbytes = sum(w.nbytes for w in ws)

    def native(x, ws, i, layer):
        return kernel_cpu.matmul(x, ws[i], layer, n=widths[i])

    def xla(x, ws, i, layer):  # XLA slices the layer's weights out of the stack
        return jnp.dot(x, ws[i][layer].astype(jnp.float32), preferred_element_type=jnp.float32)

    runs = {"native": (jax.jit(chain(native, E, F)), packed),
            "xla": (jax.jit(chain(xla, E, F)), ws)}
    for rows in args.rows:
        h = jnp.asarray(rng.standard_normal((rows, E), np.float32), args.dtype)
        outs = {k: np.asarray(f(h, w), np.float32) for k, (f, w) in runs.items()}  # compile; compare
        err = np.abs(outs["native"] - outs["xla"]).max() / np.abs(outs["xla"]).max()
        best = {k: float("inf") for k in runs}
        for _ in range(args.reps):
            for k, (f, w) in runs.items():
                jax.block_until_ready(f(h, w))  # untimed: after the other variant's big writes
                t = time.perf_counter()
                jax.block_until_ready(f(h, w))
                best[k] = min(best[k], time.perf_counter() - t)
        flops = 2 * rows * nbytes / ws[0].itemsize
        for k, t in best.items():
            print(f"{args.dims} {args.dtype} rows {rows:5d} {k:6s}: {t * 1e3:8.2f} ms  "
                  f"{nbytes / t / 1e9:5.1f} GB/s  {flops / t / 1e9:6.1f} GFLOP/s")
        print(f"  native / xla time: {best['native'] / best['xla']:.2f} (relative difference of "
              f"the outputs {err:.1e})")


if __name__ == "__main__":
    main()
