"""The cost of custom logits processors (jaxllm/logits_processor.py): the same greedy batch on
two engines in one process, one started with a processor that changes nothing, so what is
measured is the processed sampler's path (the logits to the host and back, a second program).

    PYTHONPATH=. python scripts/bench_logits_processors.py [--model PATH] [--batch 16]
                                                           [--max-tokens 64] [--reps 4]

Alternating which engine goes first; prints each one's median time and output tok/s and the
median of the paired ratios (processor / plain).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.logits_processor import LogitsProcessor


class NoOp(LogitsProcessor):
    """Changes nothing: the cost of the processed path alone."""

    def __init__(self, config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return False  # so it runs on greedy batches too

    def update_state(self, update) -> None:
        pass

    def apply(self, logits):
        return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/root/.cache/jaxllm/bench_models/llama124m",
                    help="a model folder (scripts/make_bench_models.py builds llama124m)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 30000, a.input_len).tolist()}
               for _ in range(a.batch)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    engines = {name: LLM(a.model, dtype=a.dtype, max_num_seqs=max(32, a.batch), seed=0, **kw)
               for name, kw in (("plain", {}), ("processor", {"logits_processors": [NoOp]}))}
    for llm in engines.values():  # compile every program the timed runs use
        llm.generate(prompts, sp, use_tqdm=False)
    times = {name: [] for name in engines}
    for rep in range(a.reps):
        for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
            t = time.perf_counter()
            engines[name].generate(prompts, sp, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:9s} median {med:.3f} s, {a.batch * a.max_tokens / med:.1f} output tok/s")
    ratio = statistics.median(p / q for q, p in zip(times["plain"], times["processor"]))
    print(f"processor / plain (median of paired ratios): {ratio:.3f}")


if __name__ == "__main__":
    main()
