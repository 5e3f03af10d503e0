"""KV offloading's worth: time to first token of a long prompt seen before but evicted from
the device prefix cache, with --kv-offloading-size (its blocks copied back from host memory)
and without (computed again), the two engines alternating.

    python scripts/bench_kv_offload.py [--model M] [--prompt-len 4000] [--rounds 2]

Each round: prompt P once (cold), two other prompts of the same length (they evict P's blocks
from a KV cache sized for about two prompts), then P again, timed (max_tokens 1).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.config import DEFAULT_MODEL


def ttft(llm, prompt) -> float:
    t = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n = args.prompt_len
    # About two prompts' blocks (16 tokens each): a third prompt evicts the first's.
    common = dict(max_model_len=n + 64, max_num_seqs=4, num_gpu_blocks_override=5 * n // 32)
    engines = {name: LLM(args.model, **common, **extra)
               for name, extra in (("recompute", {}),
                                   ("host tier", {"kv_offloading_size": 1.0}))}
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        for name, llm in engines.items():
            p, q1, q2 = ([int(t) for t in rng.integers(100, 20000, n)] for _ in range(3))
            cold = ttft(llm, p)
            ttft(llm, q1)
            ttft(llm, q2)
            again = ttft(llm, p)
            s = llm.llm_engine.stats()
            print(f"round {r} {name:9s}: cold {cold:6.2f} s, after eviction {again:6.2f} s "
                  f"({again / cold:.2f}x cold); host hits {s.kv_offload_hit_blocks} blocks",
                  flush=True)


if __name__ == "__main__":
    main()
