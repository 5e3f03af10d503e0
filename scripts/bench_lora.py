"""What LoRA adapters cost a decode step (issue 46), alternating, as ratios to the plain model.

    python scripts/bench_lora.py [--model FOLDER] [--rank 16] [--adapters 8] [--batch 64]
        [--rounds 3] [--adapter-dir DIR] [--engine jaxllm|vllm]

Makes --adapters peft adapters (all seven projections, random non-zero B) of the model, then
loads it twice in this process: without LoRA, and with --enable-lora (--max-loras = --adapters).
Each round times, in turn, a batch-1 decode (plain; LoRA engine without an adapter; with one)
and a batch of --batch requests (plain; LoRA engine without adapters; with the adapters spread
evenly over the requests). A decode step's time is (time for 72 tokens - time for 8) / 64
(the prompt is prefilled in both); medians over rounds, ratios to the plain engine's.
--engine vllm runs the same through vLLM's LLM (same API; run it with vLLM's interpreter, e.g.
/opt/vllm-venv/bin/python from scripts/install_peers.sh) on adapters made before with
--adapter-dir (peft is not in vLLM's environment).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_MODEL = os.path.expanduser("~/.cache/jaxllm/bench_models/smollm2")
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, n: int, rank: int, folder: str) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES,
                         init_lora_weights=False)
        path = os.path.join(folder, f"a{i}")
        get_peft_model(copy.deepcopy(base), cfg).save_pretrained(path)
        paths.append(path)
    return paths


def step_ms(llm, prompts: list, loras: list, SamplingParams) -> float:
    """Milliseconds per decode step of these requests run together."""

    def run(n: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - t

    return (run(72) - run(8)) / 64 * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-dtype", default="auto")
    p.add_argument("--adapter-dir", help="make the adapters here once, then reuse them")
    p.add_argument("--engine", choices=("jaxllm", "vllm"), default="jaxllm")
    a = p.parse_args(argv)
    import numpy as np

    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        common = dict(max_model_len=512, max_num_seqs=a.batch, dtype="bfloat16")
    else:
        from jaxllm import LLM, LoRARequest, SamplingParams
        common = dict(max_model_len=512, max_num_seqs=a.batch, use_tqdm_on_load=False,
                      disable_log_stats=True)
    folder = a.adapter_dir or tempfile.mkdtemp(prefix="bench_lora_")
    paths = [os.path.join(folder, f"a{i}") for i in range(a.adapters)]
    if not all(os.path.isdir(p) for p in paths):
        paths = make_adapters(a.model, a.adapters, a.rank, folder)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    plain = LLM(a.model, **common)
    lora = LLM(a.model, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank,
               lora_dtype=a.lora_dtype, **common)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, 32).tolist()}
               for _ in range(a.batch)]
    spread = [reqs[i % len(reqs)] for i in range(a.batch)]
    cases = {  # name -> (engine, prompts, adapters)
        "batch 1, plain": (plain, prompts[:1], None),
        "batch 1, LoRA on, no adapter": (lora, prompts[:1], None),
        "batch 1, one adapter": (lora, prompts[:1], reqs[:1]),
        f"batch {a.batch}, plain": (plain, prompts, None),
        f"batch {a.batch}, LoRA on, no adapter": (lora, prompts, None),
        f"batch {a.batch}, {a.adapters} adapters": (lora, prompts, spread),
    }
    for engine, ps, loras in cases.values():  # warm-up: compile and fill the slots
        step_ms(engine, ps, loras, SamplingParams)
    times = {name: [] for name in cases}
    names = list(cases)
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(step_ms(*cases[name], SamplingParams))
    print(f"{a.engine}, {os.path.basename(a.model.rstrip('/'))}, rank {a.rank}, "
          f"{a.adapters} adapters, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'case':<40} {'ms/step':>9} {'vs plain':>9}")
    for name in names:
        med = statistics.median(times[name])
        ref = statistics.median(times[names[0] if name.startswith("batch 1,") else names[3]])
        print(f"{name:<40} {med:9.2f} {med / ref:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
