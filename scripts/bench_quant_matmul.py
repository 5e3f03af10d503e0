"""Microbenchmark of the native CPU matmul on quantized weights (int8, int4) against the native
bf16 kernel and against XLA's dequantize-then-dot, on a model's layer projections.

Each variant is one jitted program that runs the four projections (qkv, o, gate_up gated with
silu, down) over every layer of a stack (30 for SmolLM2-135M: the weights do not stay in cache),
each projection a `lax.scan` over the layer index, on `--rows` activation rows. The variants
alternate in rounds; the table gives the median ms per pass and the speed relative to the bf16
kernel (bf16 time / variant time: above 1 is faster). The load average printed before and
after tells whether other work shared the cores.

    python scripts/bench_quant_matmul.py --rows 1 4 16 64
    JAXLLM_CPU_MARCH=x86-64-v3 python scripts/bench_quant_matmul.py   # the AVX2 build

The kernels are built at first use for $JAXLLM_CPU_MARCH (pallas_kernels/cpu_ffi.py).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.quantization import QuantizedWeight, dequantize, pack_int4
from pallas_kernels.activation.reference import silu_and_mul
from pallas_kernels.matmul import kernel_cpu

DIMS = {  # hidden, FFN, q + k + v width, layers
    "smollm2": (576, 1536, 960, 30),
    "llama124m": (768, 2048, 1280, 12),
}


def quantize(w: np.ndarray, bits: int, group: int | None, zero: bool, rng) -> QuantizedWeight:
    """Min-max quantization of float [L, K, N] weights (random zero points with `zero`)."""
    L, K, N = w.shape
    if group is not None and K % group:
        raise SystemExit(f"{K} inputs do not divide into groups of {group}")
    G = 1 if group is None else K // group
    top = 2 ** (bits - 1) - 1
    g = w.reshape(L, G, K // G, N)
    scale = np.maximum(np.abs(g).max(axis=2), 1e-8) / top  # [L, G, N]
    z = rng.integers(-2, 3, scale.shape).astype(np.float32) if zero else np.zeros_like(scale)
    q = np.clip(np.round(g / scale[:, :, None] + z[:, :, None]), -top - 1, top)
    q = q.reshape(L, K, N).astype(np.int8)
    return QuantizedWeight(jnp.asarray(pack_int4(q) if bits == 4 else q),
                           jnp.asarray(scale, jnp.float32),
                           jnp.asarray(z, jnp.float32) if zero else None)


def program(project, widths):
    """One pass: each projection (the third gated) over every layer (a scan), its results
    summed so that every layer's product is used; the last one's input widened to its K."""
    def run(x, weights):
        total = jnp.float32(0)
        wide = jnp.tile(x, (1, -(-widths[2] // x.shape[1])))[:, :widths[2]]
        for i, (w, n) in enumerate(zip(weights, widths)):
            def body(acc, layer, w=w, n=n, a=wide if i == 3 else x, gated=i == 2):
                return acc + project(a, w, layer, n, gated).astype(jnp.float32).sum(), None

            layers = jax.tree_util.tree_leaves(w)[0].shape[0]
            total = total + jax.lax.scan(body, jnp.float32(0), jnp.arange(layers))[0]
        return total
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", choices=DIMS, default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--x-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--int8-group", type=int, default=0, help="inputs per scale; 0: per channel")
    p.add_argument("--int4-group", type=int, default=64, help="inputs per scale; 0: per channel")
    p.add_argument("--zero", action="store_true", help="asymmetric: with zero points")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-xla", action="store_true", help="skip XLA's dequantize-then-dot")
    args = p.parse_args()
    if not kernel_cpu.available():
        raise SystemExit("the CPU matmul kernel could not be built (see the log)")
    E, F, QKV, L = DIMS[args.dims]
    rng = np.random.default_rng(0)
    shapes = [(L, E, QKV), (L, E, E), (L, E, 2 * F), (L, F, E)]
    widths = [QKV, E, F, E]  # gate_up: F gated columns of 2 F
    floats = [rng.standard_normal(s, np.float32) * 0.05 for s in shapes]
    bf16 = [kernel_cpu.pack(jax.lax.bitcast_convert_type(jnp.asarray(w, jnp.bfloat16), jnp.uint16))
            for w in floats]
    quant = {bits: [quantize(w, bits, group or None, args.zero, rng) for w in floats]
             for bits, group in ((8, args.int8_group), (4, args.int4_group))}
    packed = {bits: [kernel_cpu.pack_quantized(*w) for w in ws] for bits, ws in quant.items()}
    dtype = jnp.dtype(args.x_dtype)

    def native(x, w, layer, n, gated):
        return kernel_cpu.matmul(x, w, layer, n=n, out_dtype=dtype, gated=gated)

    def native_quant(x, w, layer, n, gated):
        return kernel_cpu.matmul_quantized(x, w, layer, n=n, out_dtype=dtype, gated=gated)

    def xla(x, w, layer, n, gated):  # as the reference backend: the layer's weights dequantized
        w = jax.tree_util.tree_map(lambda a: a[layer], w)
        y = jnp.dot(x, dequantize(w, x.shape[1], w.scale.shape[-1], x.dtype),
                    preferred_element_type=jnp.float32)
        return silu_and_mul(y.reshape(-1, 2, n), dtype) if gated else y.astype(dtype)

    runs = {"bf16": (native, bf16), "int8": (native_quant, packed[8]),
            "int4": (native_quant, packed[4])}
    if not args.no_xla:
        runs.update({"xla-int8": (xla, quant[8]), "xla-int4": (xla, quant[4])})
    runs = {k: (jax.jit(program(f, widths)), w) for k, (f, w) in runs.items()}
    nbytes = {"bf16": sum(w.nbytes for w in bf16)}
    for bits in (8, 4):
        nbytes[f"int{bits}"] = sum(sum(a.nbytes for a in w) for w in packed[bits])
    kind = "asymmetric" if args.zero else "symmetric"
    print(f"{args.dims}, {L} layers, x {args.x_dtype}; int8 group {args.int8_group or 'channel'},"
          f" int4 group {args.int4_group or 'channel'}, {kind}; -march="
          f"{os.environ.get('JAXLLM_CPU_MARCH') or 'native'}; {os.cpu_count()} CPUs; weights MB: "
          + ", ".join(f"{k} {v / 1e6:.0f}" for k, v in nbytes.items())
          + f"; load average {os.getloadavg()[0]:.2f}")
    print(f"{'rows':>5s} " + " ".join(f"{k:>17s}" for k in runs))
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, E), np.float32), dtype)
        for f, w in runs.values():  # compile
            jax.block_until_ready(f(x, w))
        times = {k: [] for k in runs}
        for r in range(args.rounds):
            order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
            for k in order:
                f, w = runs[k]
                t = time.perf_counter()
                jax.block_until_ready(f(x, w))
                times[k].append(time.perf_counter() - t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(f"{rows:5d} " + " ".join(f"{med[k] * 1e3:7.2f} ms {med['bf16'] / med[k]:5.2f}x"
                                       for k in runs))
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
