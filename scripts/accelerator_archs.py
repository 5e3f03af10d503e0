"""The archs phase of scripts/accelerator_check.py: this wave's architectures, end to end.

Each new mechanism as a tiny random float32 model, built with the suite's own recipes (the test
modules' configs and checkpoint builders, so the check and the suite test the same models):
multi-head latent attention over the latent cache (DeepSeek-V3), attention sinks with sliding
windows and YaRN (GPT-OSS), chunked local attention with NoPE layers (Llama 4), gated DeltaNet
beside gated attention with the state cache (Qwen3-Next), per-layer-type geometry with
KV-shared layers (Gemma 4). Each runs through the offline engine
(`LLM`: scheduler, the jitted step, the kernels the platform picks), greedy with the sampled
tokens' logprobs, against transformers' greedy decoding of the same weights on the same device.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from accelerator_models import (ROOT, _hf_greedy, load_conftest, optional_imports,
                                summarize_token_rows, torch_device)
from accelerator_phases import Context, _sig, accelerator

PROMPT_LENS = (5, 17, 30)
# Sampled tokens' logprobs, engine against transformers (f32, highest matmul precision).
LOGPROB_TOL = 1e-3


class _Dirs:
    """tmp_path_factory's mktemp, under the phase's work folder."""

    def __init__(self, root: str):
        self.root, self.n = root, 0

    def mktemp(self, name: str) -> str:
        self.n += 1
        path = os.path.join(self.root, f"{name}-{self.n}")
        os.makedirs(path)
        return path


def _save(cf, cfg, path: str, tok, seed: int) -> str:
    """cfg's model with conftest's random weights, saved with the suite's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg.bos_token_id = cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    cf._randomize(model, False, seed=seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def builders(cf, dirs: _Dirs):
    """name -> (what it exercises, a function building its checkpoint folder)."""
    import transformers as tr

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import gemma4_checkpoints
    from gptoss_checkpoints import make_gptoss
    from qwen3_next_checkpoints import make_qwen3_next
    from test_deepseek import V3
    from test_gemma4 import MOE as GEMMA4_MOE
    from test_gemma4 import SHARED as GEMMA4_SHARED
    from test_llama4 import TEXT

    tok = cf._train_tokenizer()

    def deepseek():
        cfg = tr.DeepseekV3Config(**V3)
        cfg.architectures = ["DeepseekV3ForCausalLM"]
        return _save(cf, cfg, dirs.mktemp("deepseek_v3"), tok, seed=1)

    def llama4():
        cfg = tr.Llama4TextConfig(**TEXT)
        cfg.architectures = ["Llama4ForCausalLM"]
        return _save(cf, cfg, dirs.mktemp("llama4"), tok, seed=2)

    return {
        "deepseek_v3": ("MLA, grouped sigmoid routing", deepseek),
        "gpt_oss": ("sinks, sliding window, YaRN, biased experts",
                    lambda: make_gptoss(dirs.mktemp("gpt_oss"))),
        "llama4": ("chunked local attention, NoPE layers, top-1 MoE", llama4),
        "qwen3_next": ("gated DeltaNet state cache, gated attention",
                       lambda: make_qwen3_next(dirs, tok, {})),
        "gemma4": ("per-layer-type head dims, KV-shared layers, per-layer inputs, MoE beside MLP",
                   lambda: gemma4_checkpoints.build(dirs.mktemp("gemma4"), tok,
                                                    **GEMMA4_SHARED, **GEMMA4_MOE)),
    }


def _engine_greedy(path: str, prompts: list[list[int]], n: int, backend: str):
    """(tokens, the sampled tokens' logprobs) per prompt, from one batch through `LLM`."""
    from jaxllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", seed=0, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64, num_gpu_blocks_override=64,
              attention_backend=backend, use_tqdm_on_load=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, logprobs=0,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(toks, o.outputs[0].logprobs)]
                for toks, o in zip(tokens, outs)]
    return tokens, logprobs


def phase_archs(rec, ctx: Context) -> None:
    if not optional_imports(rec, "torch", "transformers"):
        return
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(1)
    cf = load_conftest()
    device = torch_device()
    # The Pallas kernels are what an accelerator runs; on cpu the same backend, interpreted.
    backend = "auto" if accelerator() else "pallas"
    n = 4 if ctx.toy else 24
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, cf.VOCAB, k)] for k in PROMPT_LENS]
    rec.put("setup", {"torch_device": device, "attention_backend": backend, "new_tokens": n})
    table = builders(cf, _Dirs(ctx.workdir))
    longest = 10.0  # an architecture is not started with less time left than one took
    for i, (name, (what, build)) in enumerate(table.items()):
        if rec.out_of_time(longest):
            rec.put("not_run", list(table)[i:])
            return
        t = time.perf_counter()
        try:
            path = build()
            tokens, logprobs = _engine_greedy(path, prompts, n, backend)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
            equal, err = True, 0.0
            for p, toks, lps in zip(prompts, tokens, logprobs):
                _, steps, want = _hf_greedy(hf.eval(), p, n, device)
                equal &= toks == want
                ref = torch.log_softmax(torch.from_numpy(steps), -1).numpy()
                # up to the first differing token: after it the two decode other sequences
                k = next((j for j, (a, b) in enumerate(zip(toks, want)) if a != b), len(want))
                err = max(err, float(np.max(np.abs(
                    np.asarray(lps[:k + 1][:len(want)]) - ref[np.arange(min(k + 1, n)),
                                                               want[:k + 1]]))))
            del hf
        except Exception as e:  # one architecture's failure is its row; the others still run
            rec.check(f"{name} runs", False, error=f"{type(e).__name__}: {str(e)[:600]}")
            jax.clear_caches()
            continue
        jax.clear_caches()
        longest = max(longest, time.perf_counter() - t)
        rec.append("archs", {"arch": name, "exercises": what, "tokens_equal": equal,
                             "max_logprob_err": _sig(err),
                             "seconds": round(time.perf_counter() - t, 1)})
        rec.check(f"{name} greedy tokens equal transformers", equal)
        rec.check(f"{name} logprobs within {LOGPROB_TOL}", err <= LOGPROB_TOL,
                  max_logprob_err=_sig(err))


def summarize_archs(r: dict) -> list[str]:
    lines = summarize_token_rows(r.get("archs", []), "new architectures through LLM",
                                 "max_logprob_err", "logprob")
    if r.get("not_run"):
        lines.append("not run (out of time): " + ", ".join(r["not_run"]))
    return lines
