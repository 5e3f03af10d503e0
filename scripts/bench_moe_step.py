"""Time the engine's jitted decode step (the forward program, without the LM head and sampler,
which are the same for every variant) of a mixture-of-experts model against a dense model with
the same ACTIVE parameters, alternating, on dummy weights.

    python scripts/bench_moe_step.py [--dtype bfloat16] [--batch 64] [--context 192] [--reps 5]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_moe_step.py \
        --engine-args '{"tensor_parallel_size": 8}' --variants moe moe-ep --batch 1

Variants (all hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 32000, as make_bench_models.py):
  moe        Mixtral: 8 experts of FFN 1024, top-2 (2 x 1024 = 2048 active FFN columns)
  moe+count  the same with --enable-expert-load-metrics (what counting costs on the hot path)
  moe-ep     the same with --enable-expert-parallel (experts sharded, tokens replicated; with
             --engine-args '{"tensor_parallel_size": N}' against `moe`'s experts' FFNs split)
  dense      Llama with FFN 2048 (the same active parameters, no router)
Each of the `batch` sequences decodes one token at position `context` - 1 over a paged cache
holding `context` tokens. Prints the best and median milliseconds per step of each variant and
the ratios to dense; --variants picks some.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_bench_models import random_config  # noqa: E402

VARIANTS = ("moe", "moe+count", "moe-ep", "dense")


def dense_twin(moe_config):
    """A Llama with the Mixtral's attention and one FFN as wide as its active experts."""
    import transformers as tr

    c = moe_config
    return tr.LlamaConfig(hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                          num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_key_value_heads,
                          intermediate_size=c.intermediate_size * c.num_experts_per_tok,
                          vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                          max_position_embeddings=c.max_position_embeddings,
                          tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


class StepTimer:
    """One variant's runner (dummy weights) and a decode step of `batch` sequences."""

    def __init__(self, config, folder: str, dtype: str, batch: int, context: int, **engine):
        from jaxllm.config import EngineArgs
        from jaxllm.engine.startup import build_engine_parts
        from jaxllm.layers.attention import AttentionMetadata

        config.save_pretrained(folder)
        bs = 16
        per_seq = -(-context // bs)
        args = EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True,
                          dtype=dtype, enforce_eager=True, max_num_seqs=batch, block_size=bs,
                          num_gpu_blocks_override=batch * per_seq + 1, max_model_len=context,
                          use_tqdm_on_load=False, disable_log_stats=True, **engine)
        self.runner = r = build_engine_parts(args.create_engine_config()).runner
        ib = r.input_batch
        tables = np.zeros((batch, ib.blocks_per_seq), np.int32)
        tables[:, :per_seq] = np.arange(batch * per_seq).reshape(batch, per_seq)
        pos = np.full(batch, context - 1, np.int32)
        slots = tables[:, (context - 1) // bs] * bs + (context - 1) % bs
        md = AttentionMetadata(slots.astype(np.int32), np.full(batch, context, np.int32), tables,
                               np.arange(batch + 1, dtype=np.int32),
                               np.array([batch], np.int32), decode_only=ib.decode_programs)
        tokens = np.random.default_rng(0).integers(3, 32000, batch).astype(np.int32)
        self.inputs = (tokens, pos, md, np.arange(batch, dtype=np.int32),
                       r._no_prev_tokens, np.full(batch, -1, np.int32))
        self.step()  # compile

    def step(self) -> float:
        r = self.runner
        t0 = time.perf_counter()
        out = r._forward(r.state, r.kv_cache, *self.inputs)
        r.kv_cache = out[2]
        out[0].block_until_ready()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--reps", type=int, default=5, help="rounds over all variants")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS,
                    default=["moe", "moe+count", "dense"])
    ap.add_argument("--engine-args", type=json.loads, default={},
                    help="JSON engine arguments for every variant")
    ap.add_argument("--output-json")
    a = ap.parse_args()
    moe = random_config("mixtral-tiny")
    configs = {"moe": (moe, {}), "moe+count": (moe, {"enable_expert_load_metrics": True}),
               "moe-ep": (moe, {"enable_expert_parallel": True}), "dense": (dense_twin(moe), {})}
    with tempfile.TemporaryDirectory() as tmp:
        timers = {v: StepTimer(configs[v][0], os.path.join(tmp, v), a.dtype, a.batch,
                               a.context, **a.engine_args, **configs[v][1])
                  for v in a.variants}
        times = {v: [] for v in a.variants}
        for rep in range(a.reps):
            order = a.variants[rep % len(a.variants):] + a.variants[:rep % len(a.variants)]
            for v in order:  # rotating, so slow minutes of a shared machine spread over all
                times[v] += [timers[v].step() for _ in range(a.steps)]
    load = os.getloadavg()[0]
    result = {v: {"best_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t)}
              for v, t in times.items()}
    print(f"decode step, batch {a.batch}, context {a.context}, {a.dtype}, {a.engine_args}, "
          f"load avg {load:.1f} ({a.reps} rounds x {a.steps} steps)")
    for v, r in result.items():
        ratio = ("" if "dense" not in result or v == "dense" else
                 f"   x{r['best_ms'] / result['dense']['best_ms']:.2f} best, "
                 f"x{r['median_ms'] / result['dense']['median_ms']:.2f} median vs dense")
        print(f"  {v:>10}: best {r['best_ms']:8.2f} ms  median {r['median_ms']:8.2f} ms{ratio}")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"args": vars(a), "load_avg": load, "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
