"""What KV offloading's copies cost the other requests: a decoding request's time per output
token (TPOT) while long prompts run beside it and evict each other's blocks, with
--kv-offloading-size (every eviction is a copy to host memory) and without, the two engines
alternating.

    python scripts/bench_kv_offload_tpot.py [--model M] [--prompt-len 2000] [--rounds 2]

Phases, each step timed: request D decodes throughout; prompts P, Q1, Q2 (the "evicting"
phase: each evicts the one before, so the offloading engine copies blocks out on these
steps), then P again (the "hit" phase: the offloading engine copies P back instead of
computing it). Reported: D's median TPOT per phase and engine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.config import DEFAULT_MODEL


def run_phases(llm, n: int, rng) -> dict[str, list[float]]:
    eng = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    p, q1, q2 = ([int(t) for t in rng.integers(100, 20000, n)] for _ in range(3))
    eng.add_request("D", {"prompt_token_ids": [int(t) for t in rng.integers(100, 20000, 32)]},
                    decode)
    tpot: dict[str, list[float]] = {}
    last = None

    def steps_until(rid: str, phase: str) -> None:
        nonlocal last
        done = False
        while not done:
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == "D":
                    if last is not None:
                        tpot.setdefault(phase, []).append(now - last)
                    last = now
                done |= o.request_id == rid and o.finished

    for _ in range(8):  # D is decoding
        eng.step()
    for rid, prompt, phase in (("P", p, "warm-up"), ("Q1", q1, "evicting"),
                               ("Q2", q2, "evicting"), ("P2", p, "hit")):
        eng.add_request(rid, {"prompt_token_ids": prompt}, one)
        steps_until(rid, phase)
    eng.abort_request("D")
    while eng.has_unfinished_requests():
        eng.step()
    return tpot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n = args.prompt_len
    # About two prompts' blocks (16 tokens each) besides D's: a third prompt evicts the first's.
    common = dict(max_model_len=n + 256, max_num_seqs=4, num_gpu_blocks_override=5 * n // 32 + 8,
                  max_num_batched_tokens=512)
    engines = {name: LLM(args.model, **common, **extra)
               for name, extra in (("recompute", {}),
                                   ("host tier", {"kv_offloading_size": 1.0}))}
    for r in range(args.rounds):
        for name, llm in engines.items():
            tpot = run_phases(llm, n, np.random.default_rng(r))
            s = llm.llm_engine.stats()
            cells = ", ".join(f"{phase} {statistics.median(v) * 1e3:7.1f} ms ({len(v)} tokens)"
                              for phase, v in tpot.items() if phase != "warm-up")
            print(f"round {r} {name:9s}: D's median TPOT: {cells}; host blocks saved "
                  f"{s.kv_offload_saved_blocks}, hit {s.kv_offload_hit_blocks}", flush=True)


if __name__ == "__main__":
    main()
