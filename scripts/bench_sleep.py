"""Sleep mode's cost: device memory freed by each level, the time to sleep and to wake, against
the engine's own start-up, and that the answers after waking are the same.

    python scripts/bench_sleep.py [--model M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from jaxllm import LLM, SamplingParams
from jaxllm.config import DEFAULT_MODEL

PROMPT = "The capital of France is"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, enable_sleep_mode=True, max_model_len=512)
    start = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    want = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].text
    runner = llm.llm_engine.runner
    held = runner.device_bytes()
    print(f"start-up {start:.2f} s; device memory held {held / 2**30:.3f} GiB")
    for level in (1, 2):
        for r in range(args.rounds):
            t = time.perf_counter()
            llm.sleep(level)
            slept = time.perf_counter() - t
            freed = held - runner.device_bytes()
            t = time.perf_counter()
            llm.wake_up()
            woke = time.perf_counter() - t
            t = time.perf_counter()
            same = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].text == want
            first = time.perf_counter() - t
            print(f"level {level} round {r}: freed {freed / held:.1%} in {slept:.3f} s, "
                  f"woke in {woke:.3f} s ({woke / start:.2f}x start-up), first request "
                  f"{first:.3f} s, same answer: {same}")


if __name__ == "__main__":
    main()
