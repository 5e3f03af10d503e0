"""The roofline phase of scripts/accelerator_check.py: the device's ceilings measured in the
run (a large device-to-device copy, a large read, a large bf16 matmul), then decode attention
and the step's projections timed against them: the achieved fraction of the limit.

Every timed program loops over distinct per-layer buffers inside one jit (as the model's layer
scan does): dispatch overhead is paid once, and no layer's data is still in the GPU's L2 when
it is read again.
"""

from __future__ import annotations

import sys

import numpy as np

from accelerator_phases import (AttnCase, Context, _sig, accelerator, make_batch, median_time,
                                 quantized_weight)

LLAMA_1B = dict(E=2048, H=32, KV=8, D=64, F=8192, V=128256, L=16)
TOY_MODEL = dict(E=128, H=4, KV=2, D=32, F=256, V=512, L=2)


def measure_ceilings(toy: bool) -> dict:
    import jax
    import jax.numpy as jnp

    n = 2**22 if toy else 2**29  # bf16 elements: 8 MiB / 1 GiB, far past any cache
    x = jnp.ones((n,), jnp.bfloat16)
    reps = 3 if toy else 20
    copy = median_time(jax.jit(lambda x: x + jnp.bfloat16(1)), x, reps=reps)
    read = median_time(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x, reps=reps)
    del x
    m = 256 if toy else 8192
    a = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
    mm = median_time(jax.jit(lambda a, b: a @ b), a, a, reps=reps)
    return {"copy_gbs": _sig(2 * n * 2 / copy / 1e9), "read_gbs": _sig(n * 2 / read / 1e9),
            "bf16_tflops": _sig(2 * m**3 / mm / 1e12), "bytes": n * 2, "matmul_m": m}


def decode_cases(toy: bool) -> list[tuple[str, AttnCase, int, int]]:
    """(name, shape, sequences, context) of the decode attention timed."""
    if toy:
        return [("toy b1 ctx64", AttnCase("t1", "decode", hq=4, hkv=2, d=32), 1, 64),
                ("toy b8 ctx32", AttnCase("t8", "decode", hq=4, hkv=2, d=32), 8, 32)]
    return [("1B b1 ctx1024", AttnCase("a", "decode", hq=32, hkv=8, d=64), 1, 1024),
            ("1B b256 ctx256", AttnCase("b", "decode", hq=32, hkv=8, d=64), 256, 256),
            ("8B b64 ctx2048", AttnCase("c", "decode", hq=32, hkv=8, d=128), 64, 2048)]


def time_decode_attention(rec, ctx, ceil: dict) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import block_sizes, kernel, reference

    accel, layers = accelerator(), 2 if ctx.toy else 4
    for name, c, seqs, length in decode_cases(ctx.toy):
        if rec.out_of_time(10.0):
            return
        q, kc, vc, _, _, meta, n = make_batch(2, [1] * seqs, [length] * seqs,
                                              c, layers=layers, pad_seqs=0, pad_tokens=0,
                                              nan_unowned=False)
        _, *md = meta
        kw = dict(sm_scale=c.d ** -0.5)

        def over_layers(attend):  # every layer in one program, as the model's scan calls it
            def run(q, kc, vc, *md):
                def body(l, acc):
                    return acc + attend(q, kc, vc, l, *md).astype(jnp.float32)
                return jax.lax.fori_loop(0, layers, body, jnp.zeros(q.shape, jnp.float32))
            return jax.jit(run)

        pallas = over_layers(lambda *a: kernel.ragged_paged_attention(
            *a, interpret=not accel, **kw))
        # the tiling the reference backend gives decode-only steps (REFERENCE_TILING)
        xla = over_layers(lambda *a: reference.ragged_paged_attention(
            *a, q_tile=1, tiles_per_group=16, chunk_blocks=max(1, 128 // c.bs), **kw))
        reps = 2 if ctx.toy else 10
        kv_bytes = seqs * length * c.hkv * c.d * 2 * kc.dtype.itemsize
        row = {"case": name, "seqs": seqs, "context": length, "hq": c.hq, "hkv": c.hkv,
               "d": c.d, "kv_bytes_per_layer": kv_bytes}
        for label, fn in (("pallas", pallas), ("xla_reference", xla)):
            if rec.out_of_time(5.0):
                break
            try:
                t = median_time(fn, q, kc, vc, *md, reps=reps) / layers
            except Exception as e:  # the kernels phase has the failure's detail
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            gbs = kv_bytes / t / 1e9
            row[label] = {"us_per_layer": _sig(t * 1e6), "gbs": _sig(gbs),
                          "of_read_bw": _sig(gbs / ceil["read_gbs"])}
        blk = block_sizes.choose(kernel.default_variant(), head_dim=c.d, page_size=c.bs,
                                 group=c.hq // c.hkv, max_q_len=seqs,
                                 table_width=md[1].shape[1])
        row["grid_programs"] = c.hkv * -(-seqs // blk.queries)
        rec.append("decode_attention", row)


def projections(dims: dict) -> dict[str, tuple[int, int]]:
    E, H, KV, D, F = (dims[k] for k in ("E", "H", "KV", "D", "F"))
    return {"qkv": (E, (H + 2 * KV) * D), "o": (H * D, E), "gate_up": (E, 2 * F),
            "down": (F, E)}


def time_projections(rec, ctx, ceil: dict, dims: dict) -> None:
    """Each projection of a decode / prefill step over a stack of L distinct weights (one per
    layer: a single weight would sit in the GPU's L2 and flatter the bandwidth)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.backends.pallas import PallasBackend

    backend, L = PallasBackend(), dims["L"]
    rng = np.random.default_rng(3)
    made = {}  # (k, n, scheme) or "lm_head" -> (stacked weight, bytes of one layer's)
    ms = (1, 8) if ctx.toy else (1, 256, 2048)
    plan = [(p, m, "bf16") for m in ms for p in projections(dims)]
    plan += [("lm_head", m, "bf16") for m in ms]
    plan += [(p, m, s) for s in ("int8", "int4", "fp8") for p in ("gate_up", "down")
             for m in ms[:1 if ctx.toy else 2]]
    for proj, m, scheme in plan:
        if rec.out_of_time(8.0):
            rec.put("projections_not_run", len(plan) - len(rec.data["result"].get(
                "projections", [])))
            return
        if proj == "lm_head":
            k, n = dims["E"], dims["V"]
            if "lm_head" not in made:
                w = jax.random.normal(jax.random.PRNGKey(4), (n, k), jnp.bfloat16)[None]
                made["lm_head"] = w, w.nbytes
            (w, w_bytes), count = made["lm_head"], 1

            def one(x, w, n=n):
                return backend.logits(x, w, n)
        else:
            k, n = projections(dims)[proj]
            if (k, n, scheme) not in made:
                if scheme == "bf16":
                    w = jax.random.normal(jax.random.PRNGKey(5), (L, k, n), jnp.bfloat16)
                    made[k, n, scheme] = w, w.nbytes // L
                else:  # L copies of one weight: as many buffers, the host's work once
                    one_w, _, w_bytes = quantized_weight(rng, k, n, scheme)
                    made[k, n, scheme] = jax.tree.map(
                        lambda a: jnp.stack([a] * L), one_w), w_bytes
            w, w_bytes = made[k, n, scheme]
            count = L

            def one(x, w, n=n):
                return backend.project(x, w, 0, n=n, out_dtype=x.dtype)

        def run(x, w, one=one, count=count):
            def body(l, acc):
                return acc + jnp.sum(one(x, jax.tree.map(lambda a: a[l], w)), dtype=jnp.float32)
            return jax.lax.fori_loop(0, count, body, jnp.float32(0))

        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        try:
            t = median_time(jax.jit(run), x, w, reps=2 if ctx.toy else 10) / count
        except Exception as e:  # recorded; the other shapes still run
            rec.append("projections", {"proj": proj, "m": m, "weight": scheme,
                                       "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        nbytes = w_bytes + 2 * m * (k + n)
        flops = 2 * m * k * n
        bound = max(nbytes / (ceil["read_gbs"] * 1e9), flops / (ceil["bf16_tflops"] * 1e12))
        rec.append("projections", {
            "proj": proj, "m": m, "k": k, "n": n, "weight": scheme, "us": _sig(t * 1e6),
            "gbs": _sig(nbytes / t / 1e9), "tflops": _sig(flops / t / 1e12),
            "of_roofline": _sig(bound / t)})


def phase_roofline(rec, ctx: Context) -> None:
    ceil = measure_ceilings(ctx.toy)
    pub = ctx.earlier("env").get("published")
    if pub:
        ceil["of_published_bw"] = _sig(ceil["read_gbs"] / pub["hbm_gbs"])
        ceil["of_published_bf16"] = _sig(ceil["bf16_tflops"] / pub["bf16_tflops"])
    rec.put("ceilings", ceil)
    rec.check("ceilings measured", ceil["read_gbs"] > 0 and ceil["bf16_tflops"] > 0)
    time_decode_attention(rec, ctx, ceil)
    dims = TOY_MODEL if ctx.toy else LLAMA_1B
    rec.put("model_dims", dims)
    time_projections(rec, ctx, ceil, dims)
    rows = [r for r in rec.data["result"].get("projections", []) if "error" not in r]
    for m in sorted({r["m"] for r in rows}):  # a whole step's bf16 projections at M rows
        step = [r for r in rows if r["m"] == m and r["weight"] == "bf16"]
        if len(step) == len(projections(dims)) + 1:
            us = sum(r["us"] * (1 if r["proj"] == "lm_head" else dims["L"]) for r in step)
            bound = sum(r["us"] * r["of_roofline"] * (1 if r["proj"] == "lm_head" else dims["L"])
                        for r in step)
            rec.append("step_projections", {"m": m, "ms": _sig(us / 1e3),
                                             "of_roofline": _sig(bound / us)})


def summarize_roofline(r: dict) -> list[str]:
    c = r.get("ceilings", {})
    lines = [f"copy {c.get('copy_gbs')} GB/s, read {c.get('read_gbs')} GB/s, bf16 matmul "
             f"{c.get('bf16_tflops')} TFLOP/s" + (f" ({c['of_published_bw']:.0%} / "
                                                  f"{c['of_published_bf16']:.0%} of published)"
                                                  if "of_published_bw" in c else "")]
    for a in r.get("decode_attention", []):
        p, x = a.get("pallas", {}), a.get("xla_reference", {})
        lines.append(f"decode attention {a['case']}: pallas {p.get('us_per_layer')} us/layer "
                     f"({p.get('of_read_bw', 0):.0%} of bw, {a.get('grid_programs')} programs), "
                     f"xla ref {x.get('us_per_layer')} us")
    for s in r.get("step_projections", []):
        lines.append(f"step projections M={s['m']}: {s['ms']} ms, {s['of_roofline']:.0%} of "
                     "roofline")
    quant = [p for p in r.get("projections", [])
             if p["weight"] != "bf16" and p["m"] == 1 and "error" not in p]
    failed = [f"{p['proj']} {p['weight']} M={p['m']}" for p in r.get("projections", [])
              if "error" in p]
    if failed:
        lines.append("failed to run: " + ", ".join(failed))
    if quant:
        lines.append("quantized M=1: " + ", ".join(
            f"{p['proj']} {p['weight']} {p['us']} us ({p['of_roofline']:.0%})" for p in quant))
    return lines


if __name__ == "__main__":
    sys.exit("run scripts/accelerator_check.py")
