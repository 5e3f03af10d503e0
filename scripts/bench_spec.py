"""Batch-1 decode speed with and without speculative decoding, alternating runs.

    python scripts/bench_spec.py --workload repeat            # SmolLM2 (the default model)
    python scripts/bench_spec.py --model ~/.cache/jaxllm/bench_models/llama124m --workload novel
    python scripts/bench_spec.py --model ~/.cache/jaxllm/bench_models/llama124m \
        --draft ~/.cache/jaxllm/bench_models/llama124m-draft2      # a draft model, not n-gram

Two engines with the same arguments, one with --speculative-config; each round runs one
request on each (the order alternates), greedy with ignore_eos so both produce the same
tokens. Decode tokens/s = (max_tokens - 1) / (time of the request - time of its prefill, a
max_tokens=1 run). Workloads: "repeat" asks the chat model to repeat a paragraph (lookup
finds the continuation in the prompt); "novel" is random token ids (nothing to look up);
"copy" is "novel" with repetition_penalty 0.2 (a random model then repeats itself). The
machine is shared and noisy: medians of several rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a language model "
    "check several guessed tokens in one step, so a step that reads every weight once can "
    "produce more than one token. Prompt lookup guesses the next tokens by finding the last "
    "few tokens earlier in the text, which works well when the answer repeats the question, "
    "as in editing, summarising with quotes, or code completion.")


def requests(llm, workload: str, seed: int):
    if workload == "repeat":
        msgs = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PARAGRAPH}"}]
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        vocab = llm.llm_engine.model_config.vocab_size  # the 124M model borrows a larger
        ids = [i for i in tok.encode(text, add_special_tokens=False) if i < vocab]  # tokenizer
        return {"prompt_token_ids": ids}, {}
    rng = np.random.default_rng(seed)
    vocab = min(llm.llm_engine.model_config.vocab_size, 32000)
    ids = rng.integers(100, vocab, size=64).tolist()
    return {"prompt_token_ids": ids}, ({"repetition_penalty": 0.2} if workload == "copy" else {})


def timed(llm, prompt, max_tokens: int, extra: dict) -> float:
    from jaxllm import SamplingParams

    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **extra)
    t = time.perf_counter()
    out = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == max_tokens
    return time.perf_counter() - t, out.token_ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--workload", choices=("repeat", "novel", "copy"), default="repeat")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="both engines overlap host and device work where they can")
    ap.add_argument("--draft", default=None,
                    help="a draft model's folder: method draft_model instead of ngram")
    args = ap.parse_args()

    from jaxllm import LLM

    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
              disable_log_stats=True, use_tqdm_on_load=False, dtype=args.dtype,
              async_scheduling=args.async_scheduling)
    if args.model:
        kw["model"] = args.model
    spec_cfg = ({"method": "ngram", "num_speculative_tokens": args.k,
                 "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
                if args.draft is None else
                {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k})
    engines = {"plain": LLM(**kw), "spec": LLM(**kw, speculative_config=spec_cfg)}
    prompt, extra = requests(engines["plain"], args.workload, seed=0)
    rates = {name: [] for name in engines}
    outputs = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in (list(engines) if r % 2 else list(engines)[::-1]):
            llm = engines[name]
            prefill, _ = timed(llm, prompt, 1, extra)
            total, outputs[name] = timed(llm, prompt, args.max_tokens, extra)
            if r:
                rates[name].append((args.max_tokens - 1) / (total - prefill))
    stats = engines["spec"].llm_engine.stats()
    from jaxllm.benchmarks.offline import spec_decode_summary
    med = {name: float(np.median(v)) for name, v in rates.items()}
    print(json.dumps({
        "model": args.model or "SmolLM2-135M-Instruct", "workload": args.workload,
        "dtype": args.dtype, "async_scheduling": args.async_scheduling,
        "load_average": os.getloadavg()[0],
        "speculative_config": spec_cfg, "prompt_tokens": len(prompt["prompt_token_ids"]),
        "max_tokens": args.max_tokens, "same_tokens": outputs["plain"] == outputs["spec"],
        "decode_tokens_per_s": {n: [round(x, 1) for x in v] for n, v in rates.items()},
        "median": {n: round(v, 1) for n, v in med.items()},
        "speedup": round(med["spec"] / med["plain"], 3),
        **spec_decode_summary(stats)}, indent=1))


if __name__ == "__main__":
    main()
