"""The gdn phase of scripts/accelerator_check.py: the Pallas gated DeltaNet kernels (Qwen3-Next,
Qwen3.5) compiled for the platform, against the pure-JAX reference on the same device.

Both forms the model runs: the chunked one (prefill and mixed batches: ragged sequences across
64-token chunk boundaries, fresh and continuing from their state slots, a length-1 sequence,
padding) and the recurrent one (one decode row per sequence); float32 and bfloat16 inputs;
decays near 0 and near 1. Each case: the outputs' and the states' largest error relative to
the reference's largest value, NaN counts, and (on an accelerator) the kernel's and the
reference's median time. On cpu (--dry-run) the kernels run in Pallas' interpreter.
"""

from __future__ import annotations

import sys

import numpy as np

from accelerator_phases import Context, _sig, accelerator, median_time

# Largest error / the reference's largest |value|: both sides compute in float32 (bf16 inputs
# are read the same); an accelerator's matmul passes may round differently (TF32 on GPU).
TOL = {"float32": 1e-3, "bfloat16": 3e-2}


def _case(rng, lens, fresh, dims, dtype, rows, g_scale=1.0, g_shift=0.0):
    import jax.numpy as jnp

    hk, hv, dk, dv, slots_n, seqs = dims
    q, k = (rng.standard_normal((rows, hk, dk)) for _ in range(2))
    v = rng.standard_normal((rows, hv, dv))
    g = -np.abs(rng.standard_normal((rows, hv))) * g_scale + g_shift
    beta = 1 / (1 + np.exp(-rng.standard_normal((rows, hv))))
    state = rng.standard_normal((slots_n, hv, dk, dv)) * 0.5
    cu = np.zeros(seqs + 1, np.int32)
    cu[1:len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1:] = cu[len(lens)]
    slots = rng.permutation(slots_n)[:seqs].astype(np.int32)
    slots[len(lens):] = -1  # padding sequences
    fresh = np.array(list(fresh) + [False] * (seqs - len(fresh)))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
            jnp.asarray(state, jnp.float32), jnp.asarray(slots), jnp.asarray(fresh),
            jnp.asarray(cu), jnp.asarray([len(lens)], jnp.int32))


def gdn_cases(toy: bool) -> list[dict]:
    """(name, form, lengths, fresh flags, decay shape) of each case; toy: small heads."""
    long = (130, 65, 1, 64) if toy else (2048, 1100, 1, 640, 300)
    return [dict(name="prefill_chunks", form="chunked", lens=long, fresh=(True,) * len(long)),
            dict(name="mixed_continuing", form="chunked", lens=(70, 1, 1, 33),
                 fresh=(False, False, True, False)),
            dict(name="decay_near_0", form="chunked", lens=(96, 40), fresh=(True, False),
                 g_scale=8.0),
            dict(name="decay_near_1", form="chunked", lens=(96, 40), fresh=(True, False),
                 g_scale=1e-3),
            dict(name="decode", form="recurrent", lens=(1,) * (4 if toy else 64),
                 fresh=(False,) * (4 if toy else 64))]


def phase_gdn(rec, ctx: Context) -> None:
    import jax

    from pallas_kernels.gated_delta_rule import ops
    from pallas_kernels.gated_delta_rule import reference as ref

    on_accel = accelerator()
    variant = "tpu" if jax.default_backend() == "tpu" else "gpu"
    interpret = not on_accel
    # Qwen3-Next's per-shard geometry (16 key heads, 32 value heads, 128 x 128) or a toy one
    # whose v head dim is no power of 2 (the GPU variant pads it).
    dims = (2, 4, 16, 12, 8, 6) if ctx.toy else (16, 32, 128, 128, 96, 72)
    rec.put("variant", variant)
    rec.put("interpret", interpret)
    rec.put("dims", dict(zip(("hk", "hv", "dk", "dv", "slots", "seqs"), dims)))
    forms = {"chunked": (ref.gated_delta_rule_chunked, ops.gated_delta_rule_chunked),
             "recurrent": (ref.gated_delta_rule_recurrent, ops.gated_delta_rule_recurrent)}
    jitted = {f: (jax.jit(r), jax.jit(k, static_argnames=("variant", "interpret")))
              for f, (r, k) in forms.items()}
    rng = np.random.default_rng(0)
    for c in gdn_cases(ctx.toy):
        for dtype in ("float32", "bfloat16"):
            name = f"{c['name']} {dtype}"
            if rec.out_of_time(5.0):
                rec.append("not_run", name)
                continue
            rows = 1 << (sum(c["lens"]) - 1).bit_length()
            args = _case(rng, c["lens"], c["fresh"], dims, dtype, rows,
                         c.get("g_scale", 1.0), c.get("g_shift", 0.0))
            reference, kernel = jitted[c["form"]]
            try:
                want = jax.device_get(reference(*args))
                got = jax.device_get(kernel(*args, variant=variant, interpret=interpret))
            except Exception as e:  # a compile failure is this case's result
                rec.check(name, False, error=f"{type(e).__name__}: {str(e)[:600]}")
                continue
            row = {"case": c["name"], "form": c["form"], "dtype": dtype, "rows": rows,
                   "tol": TOL[dtype]}
            for part, w, g in (("out", want[0], got[0]), ("state", want[1], got[1])):
                w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
                row[f"{part}_rel_err"] = _sig(float(np.abs(g - w).max() / np.abs(w).max()))
                row[f"{part}_nan"] = int(np.isnan(g).sum())
            if on_accel:
                row["kernel_ms"] = _sig(1e3 * median_time(
                    lambda *a: kernel(*a, variant=variant, interpret=False), *args, reps=10))
                row["reference_ms"] = _sig(1e3 * median_time(reference, *args, reps=10))
            rec.append("cases", row)
            rec.check(name, row["out_nan"] == row["state_nan"] == 0
                      and max(row["out_rel_err"], row["state_rel_err"]) <= row["tol"],
                      out_rel_err=row["out_rel_err"], state_rel_err=row["state_rel_err"])


def summarize_gdn(r: dict) -> list[str]:
    cases = r.get("cases", [])
    worst = max((max(c["out_rel_err"], c["state_rel_err"]) for c in cases), default=0.0)
    timed = [c for c in cases if "kernel_ms" in c]
    lines = [f"{len(cases)} gated DeltaNet cases ({r.get('variant')} kernels"
             f"{', interpreted' if r.get('interpret') else ''}) vs the reference; worst error "
             f"{worst:.2g} of max |ref|"]
    if timed:
        lines.append("  " + ", ".join(f"{c['case']} {c['dtype']}: {c['kernel_ms']} ms "
                                      f"(ref {c['reference_ms']})" for c in timed[:4]))
    return lines


if __name__ == "__main__":
    sys.exit("run scripts/accelerator_check.py")
