"""The model-level phases of scripts/accelerator_check.py: models, e2e_hf, e2e.

models: tests/conftest.py's tiny random checkpoints of every architecture (its config and
weight recipe, so the check and the suite test the same models), run by jaxllm's paged greedy
driver and by transformers on the same device in float32. e2e_hf builds a Llama-3.2-1B-shaped
random bf16 checkpoint and times transformers' `generate`; e2e times jaxllm's offline LLM on it
and sets both against the roofline bound from the roofline phase's measured ceilings.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import threading
import time

import numpy as np

from accelerator_phases import Context, _sig, accelerator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LENS = (5, 17, 30)
# Logits may differ by summation order; tokens must not. Above this the table says so.
LOGIT_TOL = 1e-3


def load_conftest():
    """tests/conftest.py as a module (its fixtures unused). It sets jax's compilation-cache
    variables for the suite: jax, imported first, has read them already, and they are put back
    so nothing this process starts inherits them."""
    import jax  # noqa: F401  (before conftest: see above)

    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location(
        "jaxllm_tests_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.environ.clear()
    os.environ.update(saved)
    return mod


def torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() and accelerator() else "cpu"


def optional_imports(rec, *mods: str) -> bool:
    """False (and the phase skipped with the reason) when one of mods does not import."""
    for mod in mods:
        try:
            __import__(mod)
        except Exception as e:  # a missing or broken optional piece skips, never crashes
            rec.skip(f"{mod} does not import: {type(e).__name__}: {e}")
            return False
    return True


# --- models: tiny random models against transformers --------------------------------------------

def _hf_greedy(model, prompt: list[int], n: int, device: str):
    """(prefill logits [len, V], the n steps' logits [n, V], n greedy tokens)."""
    import torch
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        prefill = out.logits[0].float().cpu().numpy()
        steps, tokens = [prefill[-1]], [int(prefill[-1].argmax())]
        for _ in range(n - 1):
            out = model(torch.tensor([[tokens[-1]]], device=device),
                        past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[0, -1].float().cpu().numpy())
            tokens.append(int(steps[-1].argmax()))
    return prefill, np.stack(steps), tokens


def phase_models(rec, ctx: Context) -> None:
    if not optional_imports(rec, "torch", "transformers"):
        return
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    # f32 against f32: without it XLA's GPU dots run TF32 and torch's do not.
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(1)  # tiny models: a second thread only fights XLA's (conftest)
    cf = load_conftest()
    device = torch_device()
    # The Pallas kernels are what an accelerator runs; on cpu the same backend, interpreted.
    backend = "auto" if accelerator() else "pallas"
    new_tokens = 8 if ctx.toy else 32
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, cf.VOCAB, n)] for n in PROMPT_LENS]
    rec.put("setup", {"torch_device": device, "attention_backend": backend,
                      "new_tokens": new_tokens, "prompt_lens": list(PROMPT_LENS),
                      "matmul_precision": "highest"})
    for i, arch in enumerate(cf.ARCHS):
        if rec.out_of_time(8.0):
            rec.put("not_run", list(cf.ARCHS[i:]))
            return
        t = time.perf_counter()
        try:
            hf_cfg = cf._hf_config(arch, {})
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32,
                                                  attn_implementation="eager")
            cf._randomize(hf, arch.startswith("gemma"), seed=i)
            path = os.path.join(ctx.workdir, f"tiny_{arch}")
            hf.save_pretrained(path)
            hf = hf.to(device).eval()
            # LongRoPE (phi3): jaxllm picks the factors once by max_model_len, transformers
            # per call by length; these prompts stay in the short range, so the short factors.
            short = getattr(hf_cfg, "original_max_position_embeddings", None)
            model, _, _ = cf.load_tiny(path, dtype="float32", attention_backend=backend,
                                       **({"max_model_len": short} if short else {}))
            prefill, steps, tokens = cf.paged_greedy(model, prompts, new_tokens, block_size=4)
            errs, equal = [], True
            for j, prompt in enumerate(prompts):
                want_prefill, want_steps, want_tokens = _hf_greedy(hf, prompt, new_tokens, device)
                errs += [np.abs(prefill[j] - want_prefill).max(),
                         np.abs(np.stack(steps[j]) - want_steps).max()]
                equal &= tokens[j] == want_tokens
            err = float(np.max(errs))  # NaN if any logit is (Python's max would drop it)
            nan = bool(np.isnan(err))
        except Exception as e:  # one architecture's failure is its row; the others still run
            rec.check(f"{arch} runs", False, error=f"{type(e).__name__}: {str(e)[:600]}")
            jax.clear_caches()
            continue
        rec.append("models", {"arch": arch, "tokens_equal": equal, "max_logit_err": _sig(err),
                              "seconds": round(time.perf_counter() - t, 1)})
        rec.check(f"{arch} greedy tokens equal transformers", equal and not nan)
        rec.check(f"{arch} logits within {LOGIT_TOL}", err <= LOGIT_TOL,
                  max_logit_err=_sig(err))


def summarize_token_rows(rows: list[dict], what: str, err_key: str, err: str) -> list[str]:
    """The table lines of a phase whose rows are architectures against transformers."""
    equal = [m["arch"] for m in rows if m["tokens_equal"]]
    worst = max((m[err_key] for m in rows), default=0.0)
    lines = [f"{len(equal)}/{len(rows)} {what}: greedy tokens equal transformers; worst "
             f"{err} error {worst:.2g}"]
    if len(equal) < len(rows):
        lines.append("tokens differ: " + ", ".join(m["arch"] for m in rows
                                                   if not m["tokens_equal"]))
    return lines


def summarize_models(r: dict) -> list[str]:
    device = r.get("setup", {}).get("torch_device")
    return summarize_token_rows(r.get("models", []), f"architectures ({device})",
                                "max_logit_err", "logit")


# --- e2e: a Llama-3.2-1B-shaped model, transformers and jaxllm ----------------------------------

def workload(toy: bool) -> dict:
    """Sequences x prompt -> generated tokens for throughput; batch-1 decode uses the same
    prompt and output lengths."""
    return dict(batch=8, prompt=16, gen=16) if toy else dict(batch=256, prompt=128, gen=128)


def llama_config(toy: bool):
    from transformers import LlamaConfig
    if toy:
        dims = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:  # Llama-3.2-1B's published config
        dims = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rope_parameters={
                        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                        "rope_theta": 500000.0})
    cfg = LlamaConfig(**dims, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def build_checkpoint(path: str, toy: bool, device: str):
    """The random bf16 checkpoint (transformers' own init), saved to path; the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(toy), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return model.eval()


def prompts(toy: bool, vocab: int) -> np.ndarray:
    w = workload(toy)
    return np.random.default_rng(0).integers(3, vocab, (w["batch"], w["prompt"]))


def phase_e2e_hf(rec, ctx: Context) -> None:
    if not optional_imports(rec, "torch", "transformers"):
        return
    import torch

    device, w = torch_device(), workload(ctx.toy)
    path = os.path.join(ctx.workdir, "llama-1b-shape")
    t = time.perf_counter()
    model = build_checkpoint(path, ctx.toy, device)
    rec.put("checkpoint", path)
    rec.put("build_s", round(time.perf_counter() - t, 1))
    rec.put("torch_device", device)
    ids = torch.tensor(prompts(ctx.toy, model.config.vocab_size), device=device)

    def generate(x, n):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():  # min_new_tokens: exactly n tokens, EOS or not
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, out[:, x.shape[1]:]

    generate(ids[:1], 2)
    generate(ids, 2)  # warm-up: kernels, allocator
    if rec.out_of_time(5.0):
        return
    secs, out = generate(ids, w["gen"])
    rec.put("throughput", {"seconds": round(secs, 3),
                           "output_tokens_per_s": _sig(out.numel() / secs)})
    rec.put("tokens_head", out[:16, :16].tolist())
    one = ids[:1]
    reps = 1 if ctx.toy else 3
    full, first = [], []
    for _ in range(reps):
        if rec.out_of_time(3.0):
            break
        full.append(generate(one, w["gen"])[0])
        first.append(generate(one, 1)[0])
    if full and first:
        per_token = (statistics.median(full) - statistics.median(first)) / (w["gen"] - 1)
        rec.put("batch1", {"seconds": _sig(statistics.median(full)),
                           "decode_ms_per_token": _sig(per_token * 1e3),
                           "decode_tokens_per_s": _sig(1 / per_token)})
    rec.check("transformers generated every token", out.shape == (w["batch"], w["gen"]))


def summarize_e2e_hf(r: dict) -> list[str]:
    tp, b1 = r.get("throughput", {}), r.get("batch1", {})
    return [f"transformers generate ({r.get('torch_device')}): {tp.get('output_tokens_per_s')} "
            f"output tok/s; batch-1 decode {b1.get('decode_tokens_per_s')} tok/s; "
            f"checkpoint built in {r.get('build_s')} s"]


def roofline_bound(dims: dict, weight_bytes: float, w: dict, ceil: dict) -> dict:
    """Seconds a perfect engine needs: each decode step reads every weight and the batch's KV
    (bandwidth) or does 2 x params FLOPs a token (matmul rate), whichever is longer; prefill
    is FLOPs alone. {} where the ceilings are unknown."""
    if not (ceil.get("read_gbs") and ceil.get("bf16_tflops")):
        return {}
    bw, peak = ceil["read_gbs"] * 1e9, ceil["bf16_tflops"] * 1e12
    params = weight_bytes / 2
    kv_token = 2 * dims["L"] * dims["KV"] * dims["D"] * 2
    B, P, G = w["batch"], w["prompt"], w["gen"]

    def step(batch, context):
        return max((weight_bytes + batch * context * kv_token) / bw, 2 * params * batch / peak)

    prefill = max(2 * params * B * P / peak, weight_bytes / bw)
    decode = sum(step(B, P + g) for g in range(1, G))
    one = step(1, P + G // 2)
    return {"throughput_s": _sig(prefill + decode),
            "output_tokens_per_s": _sig(B * G / (prefill + decode)),
            "batch1_tokens_per_s": _sig(1 / one), "source": ceil.get("source")}


def phase_e2e(rec, ctx: Context) -> None:
    import jax

    w = workload(ctx.toy)
    path = ctx.earlier("e2e_hf").get("checkpoint")
    if not path or not os.path.exists(os.path.join(path, "config.json")):
        if not optional_imports(rec, "torch", "transformers"):
            return
        path = os.path.join(ctx.workdir, "llama-1b-shape")
        build_checkpoint(path, ctx.toy, "cpu")  # torch stays off the accelerator jax holds
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.startup import process_age

    os.environ["JAXLLM_CACHE_DIR"] = os.path.join(ctx.workdir, "executables")  # a cold start
    compiles = []

    def listener(event, secs, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((fun_name, secs))
    jax.monitoring.register_event_duration_secs_listener(listener)
    rec.put("workload", w)
    before = process_age()
    t = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, seed=0,
              max_model_len=w["prompt"] + w["gen"], max_num_seqs=w["batch"],
              max_num_batched_tokens=64 if ctx.toy else 2048, use_tqdm_on_load=False)
    engine = llm.llm_engine
    # The steady state, as `jaxllm bench` times it: the sampler variants and multi-step
    # programs compiled in the background, waited for while the runs keep enough time (none
    # at toy sizes, where it would be most of the dry run).
    t_bg = time.perf_counter()
    waiter = threading.Thread(target=engine.wait_for_background_compiles, daemon=True)
    waiter.start()
    waiter.join(timeout=0 if ctx.toy else max(rec.left() - 60.0, 1.0))
    startup = {"before_engine_s": round(before, 1), **{k: round(v, 2) for k, v in
                                                        engine.startup_times.items()},
               "background_compile_s": round(time.perf_counter() - t_bg, 2),
               "background_pending": engine.runner.num_pending_compiles(),
               "engine_s": round(time.perf_counter() - t, 2),
               # set, jax's persistent cache makes these compile times a warm start's
               "jax_cache_dir": jax.config.jax_compilation_cache_dir}
    programs = [{"program": n, "s": round(s, 2)} for n, s in compiles]
    rec.put("startup", startup)
    rec.put("compiles", {"count": len(programs), "sum_s": round(sum(s for _, s in compiles), 1),
                         "slowest": sorted(programs, key=lambda p: -p["s"])[:8]})
    rec.put("weights_gib", {k: round(v / 2**30, 3) for k, v in engine.weight_bytes.items()})
    ids = prompts(ctx.toy, engine.model_config.vocab_size).tolist()

    def generate(batch, n):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n,
                                detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    warm = generate(ids[:min(8, len(ids))], 4)[0]
    rec.put("startup", {**startup, "warm_up_s": round(warm, 2)})
    if rec.out_of_time(5.0):
        return
    secs, outs = generate(ids, w["gen"])
    rec.put("throughput", {"seconds": round(secs, 3),
                           "output_tokens_per_s": _sig(len(ids) * w["gen"] / secs),
                           "total_tokens_per_s": _sig(len(ids) * (w["prompt"] + w["gen"]) / secs)})
    rec.check("jaxllm generated every token", all(len(o) == w["gen"] for o in outs))
    hf = ctx.earlier("e2e_hf").get("tokens_head")
    if hf:  # bf16 on random weights: argmax near-ties split; a broken model agrees on nothing
        first = [a[0] == b[0] for a, b in zip(outs, hf)]
        rec.put("agreement_with_transformers", {"first_token": _sig(np.mean(first)),
                                                "sequences": len(first)})
    full, first_only = [], []
    for _ in range(1 if ctx.toy else 3):
        if rec.out_of_time(3.0):
            break
        full.append(generate(ids[:1], w["gen"])[0])
        first_only.append(generate(ids[:1], 1)[0])
    if full and first_only:
        per_token = (statistics.median(full) - statistics.median(first_only)) / (w["gen"] - 1)
        rec.put("batch1", {"seconds": _sig(statistics.median(full)),
                           "decode_ms_per_token": _sig(per_token * 1e3),
                           "decode_tokens_per_s": _sig(1 / per_token) if per_token > 0 else None})
    rec.put("recompiles", engine.runner.num_recompiles)
    cache = os.environ["JAXLLM_CACHE_DIR"]  # whether this platform's executables serialize
    rec.put("executables_cached", sum(f.endswith(".exe") for _, _, fs in os.walk(cache)
                                      for f in fs))
    c = engine.model_config
    dims = {"L": c.num_layers, "KV": c.num_kv_heads, "D": c.head_dim}
    bound = roofline_bound(dims, float(sum(engine.weight_bytes.values())), w, ctx.ceilings())
    rec.put("roofline_bound", bound)
    mine, peer = rec.data["result"], ctx.earlier("e2e_hf")
    if bound:
        rec.put("of_roofline", {
            "throughput": _sig(mine["throughput"]["output_tokens_per_s"]
                               / bound["output_tokens_per_s"]),
            "batch1": _sig((mine.get("batch1", {}).get("decode_tokens_per_s") or 0)
                           / bound["batch1_tokens_per_s"])})
    if peer.get("throughput"):
        rec.put("vs_transformers", {
            "throughput": _sig(mine["throughput"]["output_tokens_per_s"]
                               / peer["throughput"]["output_tokens_per_s"]),
            "batch1": _sig((mine.get("batch1", {}).get("decode_tokens_per_s") or 0)
                           / ((peer.get("batch1") or {}).get("decode_tokens_per_s") or np.inf))})


def _ratio(x) -> str:
    return "?" if x is None else f"{x:.2f}x"


def _pct(x) -> str:
    return "?" if x is None else f"{x:.0%}"


def summarize_e2e(r: dict) -> list[str]:
    w, tp, b1 = r.get("workload", {}), r.get("throughput", {}), r.get("batch1", {})
    bound, of = r.get("roofline_bound", {}), r.get("of_roofline", {})
    vs, s, c = r.get("vs_transformers", {}), r.get("startup", {}), r.get("compiles", {})
    return [
        f"{w.get('batch')}x{w.get('prompt')}->{w.get('gen')}: {tp.get('output_tokens_per_s')} "
        f"output tok/s = {_ratio(vs.get('throughput'))} transformers, "
        f"{_pct(of.get('throughput'))} of the bound {bound.get('output_tokens_per_s')}",
        f"batch-1 decode: {b1.get('decode_tokens_per_s')} tok/s = "
        f"{_ratio(vs.get('batch1'))} transformers, {_pct(of.get('batch1'))} of the bound "
        f"{bound.get('batch1_tokens_per_s')} ({bound.get('source')} ceilings)",
        f"start-up: load {s.get('load')} s, compile {s.get('compile')} s + background "
        f"{s.get('background_compile_s')} s ({c.get('count')} programs, {c.get('sum_s')} s "
        f"summed, {s.get('background_pending')} left), warm-up {s.get('warm_up_s')} s; "
        f"recompiles {r.get('recompiles')}, executables cached {r.get('executables_cached')}"]
