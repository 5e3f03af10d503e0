"""Structured output cost in the engine: N concurrent JSON-schema requests against N
unconstrained ones (same prompts, same token count), and the grammar compile time per new schema.

    python scripts/bench_structured.py --model ~/.cache/jaxllm/bench_models/llama124m
    python scripts/bench_structured.py --model ~/.cache/jaxllm/bench_models/smollm2

The constrained requests use a schema that cannot close within --max-tokens (a JSON string of
at least 2000 characters), so both sides decode exactly N x max_tokens tokens and the difference
is the grammar's: the per-step mask on the host (llguidance), the sampler's bitmask variant, and
single steps instead of async overlap / multi-step bursts. The runs alternate (free, json, free,
json, ...) and the best of --reps is reported, the machine being noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# A top-level string: its forced first byte (") is a token of every vocabulary; the 124M model
# has 32000 logits and SmolLM2's tokenizer, whose `{"` token (forced by an object with a required
# key) lies past them.
LONG_SCHEMA = {"type": "string", "minLength": 2000}


def schema_variant(i: int) -> dict:
    """A realistic schema (nested object, enum, bounds, pattern), new for every i."""
    return {"type": "object", "properties": {
        f"name_{i}": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"]},
        "role": {"enum": ["admin", "user", f"guest{i}"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": [f"name_{i}", "age", "role"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--schemas", type=int, default=20, help="new schemas to time compiling")
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) arguments")
    args = ap.parse_args()

    from jaxllm import LLM, SamplingParams
    from jaxllm.structured_output import StructuredOutputsParams as SO

    llm = LLM(args.model, max_num_seqs=args.num, use_tqdm_on_load=False,
              disable_log_stats=True, **json.loads(args.engine_args))
    llm.llm_engine.wait_for_background_compiles()
    prompts = [f"Request {i}: reply with a JSON object of numbers." for i in range(args.num)]
    common = dict(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"free": [SamplingParams(seed=i, **common) for i in range(args.num)],
             "json": [SamplingParams(seed=i, structured_outputs=SO(json=LONG_SCHEMA,
                                                                   disable_any_whitespace=True),
                                     **common) for i in range(args.num)]}
    llm.generate(prompts[:2], [modes["free"][0], modes["json"][0]], use_tqdm=False)  # warm
    best: dict[str, float] = {}
    for rep in range(args.reps):
        for mode, params in modes.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if mode == "json":
                assert all(o.outputs[0].text.startswith('"') for o in outs)
            rate = tokens / dt
            best[mode] = max(best.get(mode, 0.0), rate)
            print(f"rep {rep} {mode}: {tokens} tokens in {dt:.1f} s = {rate:.1f} output tok/s",
                  flush=True)
    loss = 1 - best["json"] / best["free"]
    print(f"best: free {best['free']:.1f} tok/s, json_schema {best['json']:.1f} tok/s, "
          f"lost {100 * loss:.1f} %")

    grammars = llm.llm_engine.grammars
    grammars.compile(SO(json=schema_variant(-1)))  # the tokenizer's one-time preparation
    first = len(grammars.compile_seconds)
    for i in range(args.schemas):
        grammars.compile(SO(json=schema_variant(i)))
    times = grammars.compile_seconds[first:]
    print(f"compile per new schema: median {1e3 * statistics.median(times):.1f} ms, "
          f"max {1e3 * max(times):.1f} ms over {len(times)} schemas; first constrained "
          f"request of the engine (tokenizer preparation included): "
          f"{1e3 * grammars.compile_seconds[0]:.0f} ms")


if __name__ == "__main__":
    main()
