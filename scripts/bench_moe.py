"""Times the expert implementations of `jaxllm.layers.experts` on this machine, per batch
size, for one MoE layer of a Mixtral-ish tiny model (hidden 512, FFN 1024, 8 experts, top-2),
and the CPU backend's (`cpu`: the native grouped matmul on packed experts) where it builds.

    python scripts/bench_moe.py [--dtype bfloat16] [--tokens 1 8 64 512]

Prints the best-of-N milliseconds per layer call of each implementation; the backends'
per-batch-size choice (`ReferenceBackend.moe_impl`, `CpuBackend.moe_impl`) is read off this
table.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.activation.reference import silu_and_mul
from jaxllm.layers.backends.cpu import CpuBackend, pack_native
from jaxllm.layers.experts import EXPERT_IMPLS


def cpu_backend_impl(w_gu, w_down, dtype):
    """The CPU backend's experts as an EXPERT_IMPLS entry: its packed copy of the weights (one
    layer) read in place; None if its kernels do not build here."""
    cpu = CpuBackend.create()
    if not cpu.native_matmul:
        return None
    X, E, _, F = w_gu.shape
    cfg = type("Cfg", (), {"hidden_size": E})()
    packed = pack_native({"layers": {"g": {"experts_gate_up": w_gu[None] + 0,
                                           "experts_down": w_down[None] + 0}}},
                         cfg)["layers"]["g"]

    def cpu_experts(x, ids, weights, _gu, _down, act):
        return cpu.moe(x, ids, weights, packed["experts_gate_up"], packed["experts_down"], 0,
                       experts=X, ffn=F, activation="silu", dtype=dtype, expert_parallel=False)
    return cpu_experts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    dt = jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    X, E, F, k = a.experts, a.hidden, a.ffn, a.top_k
    w_gu = jnp.asarray(rng.normal(size=(X, E, 2, F)) * 0.05, dt)
    w_down = jnp.asarray(rng.normal(size=(X, F, E)) * 0.05, dt)
    act = lambda gu: silu_and_mul(gu, dt)  # noqa: E731
    impls = dict(EXPERT_IMPLS)
    cpu = cpu_backend_impl(w_gu, w_down, dt)
    if cpu is not None:
        impls["cpu"] = cpu
    print(f"{'T':>5} " + " ".join(f"{n:>9}" for n in impls) + "   (ms, best of "
          f"{a.repeats}; {a.dtype}, E={E} F={F} X={X} k={k})")
    for T in a.tokens:
        x = jnp.asarray(rng.normal(size=(T, E)), dt)
        ids = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(T)]),
                          jnp.int32)
        w = jnp.asarray(rng.random((T, k)), jnp.float32)
        times, outs = [], []
        for impl in impls.values():
            f = jax.jit(lambda x, i, w, g, d, impl=impl: impl(x, i, w, g, d, act))
            try:
                outs.append(np.asarray(f(x, ids, w, w_gu, w_down)))
            except jax.errors.JaxRuntimeError as e:  # XLA:CPU lacks some bf16 batched dots
                print(f"  T={T}: {impl.__name__} fails: {str(e)[:90]}")
                times.append(float("nan"))
                continue
            best = float("inf")
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                f(x, ids, w, w_gu, w_down).block_until_ready()
                best = min(best, time.perf_counter() - t0)
            times.append(best * 1e3)
        for o in outs[1:]:  # the same sum, whatever the implementation
            np.testing.assert_allclose(o, outs[0], rtol=2e-2, atol=2e-2 * np.abs(outs[0]).max())
        print(f"{T:>5} " + " ".join(f"{t:>9.3f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
