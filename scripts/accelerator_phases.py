"""The device-level phases of scripts/accelerator_check.py: env, kernels, quant (roofline:
accelerator_roofline.py; models and end to end: accelerator_models.py).

Each `phase_<name>(rec, ctx)` records into `rec` (accelerator_check.Recorder) as it goes and
stops between cases when its deadline nears; `summarize_<name>(result)` gives the end table's
lines. Sizes come in two sets: full (an accelerator) and toy (--dry-run, or a cpu backend, where
the Pallas kernels run interpreted).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import platform
import shutil
import subprocess
import sys
import time
from typing import Optional

import numpy as np

# Vendors' published figures, (HBM GB/s, dense bf16 TFLOP/s, HBM GB, source): the ceilings a
# run is compared with when it measured none. NVIDIA quotes bf16 "with sparsity" (2x dense).
PUBLISHED = {
    "H100 SXM": (3350, 989, 80, "NVIDIA H100 datasheet (SXM5)"),
    "H100 PCIe": (2000, 756, 80, "NVIDIA H100 datasheet (PCIe)"),
    "H200": (4800, 989, 141, "NVIDIA H200 datasheet (SXM)"),
    "TPU v5e": (819, 197, 16, "Google Cloud TPU v5e documentation"),
    "TPU v6e": (1638, 918, 32, "Google Cloud TPU v6e documentation"),
}
DISTS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
         "jax-cuda12-pjrt", "libtpu", "flax", "transformers", "torch", "triton", "numpy",
         "ml_dtypes", "safetensors", "tokenizers", "huggingface_hub", "gguf", "llguidance",
         "fastapi", "pydantic", "uvicorn", "orbax-checkpoint")
# Imported one by one so a missing optional piece is a line in the report, not a crash.
MODULES = ("jax.experimental.pallas", "jax.experimental.pallas.triton",
           "jax.experimental.pallas.tpu", "pallas_kernels.ragged_paged_attention.kernel",
           "jaxllm.layers.backends.pallas", "jaxllm.entrypoints.llm", "transformers", "torch")


def published_for(kind: str) -> Optional[dict]:
    """The PUBLISHED row for a jax device_kind ('NVIDIA H100 80GB HBM3', 'TPU v6 lite')."""
    k = kind.lower()
    name = ("H200" if "h200" in k else "H100 PCIe" if "h100" in k and "pcie" in k
            else "H100 SXM" if "h100" in k else "TPU v5e" if "v5 lite" in k or "v5e" in k
            else "TPU v6e" if "v6 lite" in k or "v6e" in k else None)
    if name is None:
        return None
    bw, tflops, gb, source = PUBLISHED[name]
    return {"name": name, "hbm_gbs": bw, "bf16_tflops": tflops, "hbm_gb": gb, "source": source}


@dataclasses.dataclass
class Context:
    toy: bool
    report: dict
    workdir: str

    def earlier(self, phase: str) -> dict:
        return (self.report.get("phases", {}).get(phase) or {}).get("result") or {}

    def ceilings(self) -> dict:
        """Bandwidth (GB/s) and bf16 matmul rate (TFLOP/s) of this device: measured by the
        roofline phase when it ran, else the vendor's figures, else None."""
        measured = self.earlier("roofline").get("ceilings") or {}
        pub = self.earlier("env").get("published") or {}
        return {"read_gbs": measured.get("read_gbs") or pub.get("hbm_gbs"),
                "bf16_tflops": measured.get("bf16_tflops") or pub.get("bf16_tflops"),
                "source": "measured" if measured.get("read_gbs") else
                ("published" if pub else None)}


def accelerator() -> bool:
    import jax
    return jax.default_backend() != "cpu"


def median_time(fn, *args, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn(*args), each call waited for; warm-up calls compile."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


# --- env ----------------------------------------------------------------------------------------

def phase_env(rec, ctx: Context) -> None:
    versions = {}
    for dist in DISTS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    rec.put("python", platform.python_version())
    rec.put("versions", versions)
    imports = {}
    for mod in MODULES:
        try:
            importlib.import_module(mod)
            imports[mod] = "ok"
        except Exception as e:  # any failure of an optional piece is a fact to report
            imports[mod] = f"{type(e).__name__}: {str(e)[:200]}"
    rec.put("imports", imports)
    import jax
    devices = []
    for d in jax.devices():
        stats = {}
        try:
            stats = d.memory_stats() or {}
        except Exception:  # not every platform has memory stats
            pass
        devices.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                        "cores": getattr(d, "core_count", None),
                        "memory_gib": round(stats.get("bytes_limit", 0) / 2**30, 2) or None})
    rec.put("backend", jax.default_backend())
    rec.put("devices", devices)
    kind = devices[0]["kind"]
    rec.put("device", f"{jax.default_backend()}: {kind} x{len(devices)}")
    rec.put("published", published_for(kind))
    if "torch" in versions:
        try:
            import torch
            rec.put("torch_cuda", {"available": torch.cuda.is_available(),
                                   "device": torch.cuda.get_device_name(0)
                                   if torch.cuda.is_available() else None,
                                   "cuda": torch.version.cuda})
        except Exception as e:  # torch's CUDA build may not load beside jax's
            rec.put("torch_cuda", f"{type(e).__name__}: {e}")
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.max.sm,clocks.max.mem,power.limit", "--format=csv"],
                           capture_output=True, text=True, timeout=30)
        rec.put("nvidia_smi", r.stdout.strip() or r.stderr.strip())
    for mod in ("jax.experimental.pallas", "pallas_kernels.ragged_paged_attention.kernel",
                "jaxllm.layers.backends.pallas", "jaxllm.entrypoints.llm"):
        rec.check(f"import {mod}", imports[mod] == "ok", error=imports[mod])
    rec.check("jax sees devices", len(devices) > 0)


def summarize_env(r: dict) -> list[str]:
    v = r.get("versions", {})
    plugin = next((f"{k} {v[k]}" for k in v if k.startswith(("jax-cuda", "libtpu"))), "no plugin")
    mem = (r.get("devices") or [{}])[0].get("memory_gib")
    lines = [f"{r.get('device')}{f', {mem} GiB' if mem else ''}; python {r.get('python')}",
             f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, {plugin}, flax {v.get('flax')}, "
             f"transformers {v.get('transformers')}, torch {v.get('torch')}"]
    bad = [m for m, s in r.get("imports", {}).items() if s != "ok"]
    if bad:
        lines.append("not importable: " + ", ".join(bad))
    return lines


# --- kernels: Pallas ragged paged attention against the reference -------------------------------

@dataclasses.dataclass(frozen=True)
class AttnCase:
    name: str
    kind: str            # decode | prefill | mixed
    dtype: str = "bfloat16"         # q's
    cache: str = ""                 # the cache's ('' = q's)
    hq: int = 32
    hkv: int = 8
    d: int = 128
    bs: int = 16
    window: Optional[int] = None
    cap: Optional[float] = None
    scale: Optional[float] = None   # fp8 caches hold x / scale
    variant: Optional[str] = None   # None = the device's
    sinks: bool = False             # GPT-OSS: a learned logit per head in the denominator
    chunk: Optional[int] = None     # Llama 4: attention within chunks of this many tokens


def attention_cases(toy: bool, interpret: bool = False) -> list[AttnCase]:
    """Most telling first (a phase out of time drops the tail): the serving dtype on the three
    batch kinds, then each feature, then f32 and the other shapes. Interpreted, the other
    platform's variant runs too."""
    C = AttnCase
    cases = [C(f"{kind}_bfloat16", kind) for kind in ("decode", "mixed", "prefill")]
    cases += [C("decode_fp8_e4m3", "decode", cache="float8_e4m3fn", scale=0.05),
              C("mixed_window_softcap_d256", "mixed", hq=8, hkv=4, d=256,
                window=8 if toy else 300, cap=50.0),
              C("mixed_group3_d64", "mixed", hq=9, hkv=3, d=64), C("decode_gqa8", "decode", hkv=4),
              C("mixed_sinks_window", "mixed", d=64, window=8 if toy else 128, sinks=True),
              C("mixed_chunked", "mixed", chunk=8 if toy else 256),
              C("mixed_page128", "mixed", bs=128), C("mixed_d64", "mixed", d=64)]
    cases += [C(f"{kind}_float32", kind, "float32") for kind in ("decode", "mixed", "prefill")]
    cases += [C("mixed_mha", "mixed", hq=8, hkv=8), C("mixed_page32", "mixed", bs=32),
              C("mixed_page64", "mixed", bs=64), C("mixed_d256", "mixed", hq=8, hkv=4, d=256),
              C("mixed_window", "mixed", window=8 if toy else 200),
              C("mixed_softcap", "mixed", cap=30.0),
              C("mixed_fp8_e5m2_f32q", "mixed", "float32", cache="float8_e5m2", scale=0.02)]
    if toy:  # each feature once, fewer heads (same GQA group): the interpreter is slow
        keep = ("prefill_bfloat16", "decode_fp8_e4m3", "mixed_window_softcap_d256",
                "mixed_sinks_window", "mixed_chunked",
                "mixed_group3_d64", "mixed_page128", "decode_float32", "mixed_float32")
        cases = [dataclasses.replace(c, hkv=h, hq=h * (c.hq // c.hkv))
                 for c in cases if c.name in keep for h in [1 if c.hq > c.hkv else 2]]
    if interpret:
        cases.append(C("mixed_tpu_variant", "mixed", "float32", hq=4, hkv=2, d=64, variant="tpu"))
    return cases


def _lengths(rng, kind: str, toy: bool) -> tuple[list[int], list[int]]:
    """Random ragged (q_lens, kv_lens): decode 1 token on a context; prefill whole prompts;
    mixed both plus chunked prefills (a chunk on an existing prefix)."""
    n, ctx, prompt = (4, 40, 12) if toy else (32, 1024, 256)
    if kind == "prefill":
        q = list(rng.integers(1, prompt + 1, max(n // 8, 2)))
        return q, q
    if kind == "decode":
        return [1] * n, list(rng.integers(1, ctx + 1, n))
    q, kv = [], []
    for i in range(max(n // 2, 3)):
        pick = i % 3
        if pick == 0:
            q.append(1), kv.append(int(rng.integers(1, ctx + 1)))
        elif pick == 1:
            p = int(rng.integers(1, prompt + 1))
            q.append(p), kv.append(p)
        else:
            c = int(rng.integers(1, prompt + 1))
            q.append(c), kv.append(c + int(rng.integers(1, ctx + 1)))
    return q, kv


def make_batch(seed: int, q_lens, kv_lens, c: AttnCase, layers: int = 2, pad_seqs: int = 1,
               pad_tokens: int = 3, nan_unowned: bool = True):
    """(q, k_kernel, v_kernel, k_ref, v_ref, meta, live tokens), built on the device. The
    kernel's cache holds NaN in every slot no sequence owns (a leak shows as NaN), the
    reference's zeros; fp8 caches hold x / scale on both sides."""
    import jax
    import jax.numpy as jnp

    S, n = len(q_lens), int(sum(q_lens))
    pages = [-(-k // c.bs) for k in kv_lens]
    nb, width = sum(pages) + 3, max(pages) + 1
    rng = np.random.default_rng(seed)
    tables = rng.integers(0, nb, (S + pad_seqs, width)).astype(np.int32)
    live = np.zeros((nb, c.bs), bool)
    perm, used = rng.permutation(nb), 0
    for s, kl in enumerate(kv_lens):
        tables[s, :pages[s]] = perm[used:used + pages[s]]
        used += pages[s]
        flat = np.zeros(pages[s] * c.bs, bool)
        flat[:kl] = True
        live[tables[s, :pages[s]]] = flat.reshape(pages[s], c.bs)
    kk, vk, kr, vr, q = _random_batch()(
        jax.random.key(seed, impl="rbg"), jnp.asarray(live), shape=(layers, nb, c.hkv, c.bs, c.d),
        q_shape=(n + pad_tokens, c.hq, c.d), q_dtype=c.dtype, cache_dtype=c.cache or c.dtype,
        scale=c.scale or 1.0, nan_unowned=nan_unowned)
    cu = np.concatenate([[0], np.cumsum(q_lens), [n] * pad_seqs]).astype(np.int32)
    kvl = np.array(list(kv_lens) + [10_000] * pad_seqs, np.int32)  # padding: garbage
    meta = (1, jnp.asarray(kvl), jnp.asarray(tables), jnp.asarray(cu),
            jnp.asarray([S], jnp.int32))
    return q, kk, vk, kr, vr, meta, n


@functools.lru_cache(maxsize=None)
def _random_batch():
    """One program per case (op by op, jax compiled every op once per shape), on rbg keys
    (threefry's program took 3 to 4 times longer to compile)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnames=("shape", "q_shape", "q_dtype", "cache_dtype",
                                                 "scale", "nan_unowned"))
    def make(key, live, *, shape, q_shape, q_dtype, cache_dtype, scale, nan_unowned):
        kq, kk, kv = jax.random.split(key, 3)
        mask = live[None, :, None, :, None]
        out = []
        for k in (kk, kv):
            x = jax.random.normal(k, shape, jnp.float32) / scale
            out += [jnp.where(mask, x, jnp.nan if nan_unowned else 0.0).astype(cache_dtype),
                    jnp.where(mask, x, 0.0).astype(cache_dtype)]
        q = jax.random.normal(kq, q_shape, jnp.float32).astype(q_dtype)
        return out[0], out[2], out[1], out[3], q
    return make


# Tolerance (atol = rtol) by q's dtype. cpu: the interpreted kernel's f32 equals the
# reference's up to summation order. Accelerators may run f32 dots as TF32 (GPU) or bf16
# passes (TPU); a masking or paging bug is an O(1) error, far above either.
TOL = {"cpu": {"float32": 1e-5, "bfloat16": 2e-2}, "accel": {"float32": 1e-2, "bfloat16": 2e-2}}


def phase_kernels(rec, ctx: Context) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import block_sizes, kernel, reference

    accel = accelerator()
    default_variant = kernel.default_variant()
    ref = jax.jit(reference.ragged_paged_attention, static_argnames=(
        "sm_scale", "soft_cap", "k_scale", "v_scale"))
    cores = getattr(jax.devices()[0], "core_count", None)
    rec.put("variant", default_variant)
    rec.put("interpret", not accel)
    rec.put("cores", cores)
    cases = attention_cases(ctx.toy, interpret=not accel)
    for i, c in enumerate(cases):
        if rec.out_of_time(5.0):
            rec.put("not_run", [x.name for x in cases[i:]])
            return
        variant = c.variant or default_variant
        q_lens, kv_lens = _lengths(np.random.default_rng(i), c.kind, ctx.toy)
        q, kk, vk, kr, vr, meta, n = make_batch(i, q_lens, kv_lens, c)
        kw = dict(sm_scale=c.d ** -0.5, soft_cap=c.cap, k_scale=c.scale, v_scale=c.scale)
        if c.sinks:
            kw["sinks"] = jnp.asarray(np.random.default_rng(i).normal(0, 2, c.hq), jnp.float32)
        if c.chunk:
            kw["attention_chunk"] = c.chunk
        step = "reference"
        try:
            with jax.default_matmul_precision("highest"):  # an exact f32 reference
                want = ref(q, kr, vr, *meta, sliding_window=c.window, **kw)
            step, t = "kernel", time.perf_counter()
            out = jax.block_until_ready(kernel.ragged_paged_attention(
                q, kk, vk, *meta, sliding_window=c.window, variant=variant,
                interpret=not accel, **kw))
        except Exception as e:  # a lowering or compile failure is this case's result
            rec.check(f"kernel {c.name}", False,
                      error=f"{step}: {type(e).__name__}: {str(e)[:600]}")
            jax.clear_caches()  # a failed trace stays cached otherwise
            continue
        first_s = time.perf_counter() - t
        o = np.asarray(out.astype(jnp.float32))
        w = np.asarray(want.astype(jnp.float32))
        tol = TOL["accel" if accel else "cpu"][c.dtype]
        err = np.abs(o[:n] - w[:n])
        within = bool(np.all(err <= tol + tol * np.abs(w[:n])))
        nans = int(np.isnan(o).sum())
        pad_zero = bool(np.all(o[n:] == 0))
        blk = block_sizes.choose(variant, head_dim=c.d, page_size=c.bs, group=c.hq // c.hkv,
                                 max_q_len=q.shape[0], table_width=meta[2].shape[1])
        rec.append("cases", {
            **dataclasses.asdict(c), "variant": variant, "seqs": len(q_lens), "tokens": n,
            "max_kv": int(max(kv_lens)), "max_abs_err": _sig(float(err.max(initial=0))),
            "tol": tol, "nan": nans, "padding_zero": pad_zero,
            "grid": [c.hkv, -(-q.shape[0] // blk.queries)], "blocks": list(blk),
            "first_call_s": round(first_s, 3)})
        rec.check(f"kernel {c.name}", within and nans == 0 and pad_zero,
                  max_abs_err=_sig(float(err.max(initial=0))), tol=tol, nan=nans)


def summarize_kernels(r: dict) -> list[str]:
    cases = r.get("cases", [])
    ok = [c for c in cases if c["nan"] == 0 and c["padding_zero"]]
    worst = {}
    for c in cases:
        worst[c["dtype"]] = max(worst.get(c["dtype"], 0.0), c["max_abs_err"])
    mode = "interpreted" if r.get("interpret") else "compiled"
    lines = [f"{len(cases)} cases ({r.get('variant')} variant, {mode}); no NaN/leak in "
             f"{len(ok)}; worst error " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items())]
    if r.get("not_run"):
        lines.append(f"not run (time): {len(r['not_run'])}")
    return lines


# --- quant: QuantizedWeight through the backend's project ---------------------------------------

def quantized_weight(rng, k: int, n: int, scheme: str):
    """(QuantizedWeight, the float64 weight it means [k, n], stored bytes) for one scheme:
    int8 (per channel, symmetric), int4 (group 32 asymmetric, or per channel), fp8 e4m3."""
    import jax.numpy as jnp
    from jaxllm.layers.quantization import QuantizedWeight, QuantSpec, pack_int4, quantize_rows

    if scheme == "int4_g32_asym":
        g = k // 32
        q = rng.integers(-8, 8, (k, n)).astype(np.int8)
        zero = rng.integers(-3, 4, (g, n)).astype(np.float32)
        scale = rng.uniform(0.005, 0.02, (g, n)).astype(np.float32)
        w64 = ((q.reshape(g, k // g, n) - zero[:, None]) * scale[:, None]).reshape(k, n)
        w = QuantizedWeight(jnp.asarray(pack_int4(q)), jnp.asarray(scale), jnp.asarray(zero))
        return w, w64.astype(np.float64), w.q.nbytes + scale.nbytes + zero.nbytes
    dtype = {"int8": "int8", "int4": "int4", "fp8": "float8_e4m3fn"}[scheme]
    x = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    q, scale = quantize_rows(x, QuantSpec(method="check", weight_dtype=dtype))  # [n, k], [n, g]
    qt, st = np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T)
    w64 = qt.astype(np.float64) * st.astype(np.float64).reshape(-1, 1, n).repeat(
        k // st.shape[0], axis=1).reshape(k, n)
    stored = pack_int4(qt) if scheme == "int4" else qt
    w = QuantizedWeight(jnp.asarray(stored), jnp.asarray(st))
    return w, w64, stored.nbytes + st.nbytes


QUANT_SCHEMES = ("int8", "int4", "int4_g32_asym", "fp8")


def phase_quant(rec, ctx: Context) -> None:
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.backends import resolve_backend
    from jaxllm.layers.backends.pallas import PallasBackend

    backend = PallasBackend()  # what an accelerator runs; `project` is XLA on every platform
    if accelerator():  # on cpu resolving builds the C++ kernels: not this phase's business
        rec.put("auto_backend", resolve_backend("auto"))
    k, n = (128, 256) if ctx.toy else (2048, 8192)
    rng = np.random.default_rng(0)
    tol = TOL["accel" if accelerator() else "cpu"]
    for scheme in QUANT_SCHEMES:
        w, w64, _ = quantized_weight(rng, k, n, scheme)
        for dtype in ("bfloat16", "float32"):
            for m in ((1, 8) if ctx.toy else (1, 256)):
                if rec.out_of_time(3.0):
                    return
                name = f"{scheme} x {dtype} M={m}"
                x = jnp.asarray(rng.standard_normal((m, k)), dtype)
                fn = jax.jit(lambda x, w: backend.project(x, w, 0, n=n, out_dtype=jnp.float32))
                try:
                    y = np.asarray(fn(x, w), np.float64)
                except Exception as e:  # a compile failure is this case's result
                    rec.check(name, False, error=f"{type(e).__name__}: {str(e)[:600]}")
                    continue
                want = np.asarray(x.astype(jnp.float32), np.float64) @ w64
                err = float(np.abs(y - want).max() / np.abs(want).max())
                nan = int(np.isnan(y).sum())
                rec.append("cases", {"scheme": scheme, "dtype": dtype, "m": m, "k": k, "n": n,
                                     "rel_err": _sig(err), "tol": tol[dtype], "nan": nan})
                rec.check(name, err <= tol[dtype] and nan == 0, rel_err=_sig(err))


def summarize_quant(r: dict) -> list[str]:
    cases = r.get("cases", [])
    worst = max((c["rel_err"] for c in cases), default=0.0)
    return [f"{len(cases)} projections ({', '.join(QUANT_SCHEMES)}; bf16/f32 x) vs float64; "
            f"worst error {worst:.2g} of max |y|"]


if __name__ == "__main__":
    sys.exit("run scripts/accelerator_check.py")
