"""Decode cost against context length on small random Qwen3-Next-shaped models: the median
decode step of 4 sequences at 256 and at 4096 tokens of context, for Qwen3-Next's mix of 3
gated DeltaNet layers to 1 full-attention layer ("hybrid", 8 layers) and the same model with
every layer full attention ("full"), the same widths otherwise (hidden 256, float32, CPU): the
full model's step grows with context in all 8 layers, the hybrid's in 2 (a model of linear
layers only is refused at start-up: the KV cache is sized over full-attention layers). Each
model's two contexts alternate --rounds times in one process.

    python scripts/bench_gdn_decode.py [--rounds 3] [--backend auto] [--mode engine|step]

--mode engine (default) times `LLMEngine.step` (scheduling, the forward, sampling, outputs);
--mode step times the jitted forward alone (tests/qwen3_next_checkpoints.py's StateRunner, 8
token rows: 4 sequences and padding), which isolates the model from the engine's own costs.
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout, and its test helpers

CONTEXTS = (256, 4096)
SEQS, DECODE = 4, 24
LAYERS = {"hybrid": (["linear_attention"] * 3 + ["full_attention"]) * 2,
          "full": ["full_attention"] * 8}


def build(kind: str, folder: str) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    import vlm_checkpoints as vc
    tok = vc.tokenizer()
    cfg = Qwen3NextConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=0, layer_types=LAYERS[kind],
        max_position_embeddings=8192, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(0)
    Qwen3NextForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)


def decode_step_ms(llm, context: int, rng) -> float:
    """The median step while all SEQS sequences decode (their prompts of `context` tokens)."""
    from jaxllm import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True)
    vocab = llm.llm_engine.model_config.vocab_size
    for i in range(SEQS):
        eng.add_request(f"r{context}-{i}-{time.monotonic_ns()}",
                        {"prompt_token_ids": [int(t) for t in rng.integers(10, vocab, context)]},
                        params)
    started, steps = set(), []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if len(started) == SEQS and all(o.outputs and not o.finished for o in outs):
            steps.append(dt)
        started |= {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids}
    return 1e3 * statistics.median(steps)


def forward_step_ms(folder: str, backend: str, rounds: int) -> dict[int, float]:
    """The median jitted decode forward of 4 sequences at each context (prefilled in chunks of
    240 tokens each), the contexts alternating `rounds` times."""
    from conftest import load_tiny
    from qwen3_next_checkpoints import StateRunner

    model, _, _ = load_tiny(folder, attention_backend=backend)
    runner = StateRunner(model, 16, SEQS, max(CONTEXTS) + 64, 1024)
    seqs = list(range(SEQS))
    times = {c: [] for c in CONTEXTS}
    for r in range(rounds + 1):
        for c in CONTEXTS:
            for s in seqs:
                runner.reset(s)
            runner.num_tokens, done = 1024, 0
            while done < c:
                n = min(240, c - done)
                runner.step(seqs, [[7] * n] * SEQS)
                done += n
            runner.num_tokens, steps = 8, []
            for _ in range(12):
                t0 = time.perf_counter()
                runner.step(seqs, [[9]] * SEQS)
                steps.append(time.perf_counter() - t0)
            if r:  # round 0 compiles
                times[c].append(1e3 * statistics.median(steps[2:]))
    return {c: statistics.median(v) for c, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kinds", default=",".join(LAYERS))
    ap.add_argument("--mode", choices=("engine", "step"), default="engine")
    args = ap.parse_args()
    from jaxllm import LLM
    from jaxllm.layers.backends import resolve_backend

    rng = np.random.default_rng(0)
    report = {}
    for kind in args.kinds.split(","):
        folder = tempfile.mkdtemp(prefix=f"bench_gdn_{kind}_")
        build(kind, folder)
        if args.mode == "step":
            med = forward_step_ms(folder, args.backend, args.rounds)
            report[kind] = {"ms": {str(c): round(m, 2) for c, m in med.items()},
                            "ratio": round(med[CONTEXTS[1]] / med[CONTEXTS[0]], 2),
                            "backend": resolve_backend(args.backend), "mode": "step"}
            print(kind, json.dumps(report[kind]), flush=True)
            continue
        llm = LLM(folder, dtype="float32", max_model_len=max(CONTEXTS) + DECODE + 8,
                  max_num_seqs=SEQS, max_num_batched_tokens=1024,
                  attention_backend=args.backend)
        times = {c: [] for c in CONTEXTS}
        decode_step_ms(llm, CONTEXTS[0], rng)  # warm-up: compiles
        for _ in range(args.rounds):
            for c in CONTEXTS:
                times[c].append(decode_step_ms(llm, c, rng))
        med = {c: statistics.median(v) for c, v in times.items()}
        report[kind] = {"ms": {str(c): round(m, 2) for c, m in med.items()},
                        "ratio": round(med[CONTEXTS[1]] / med[CONTEXTS[0]], 2),
                        "backend": resolve_backend(args.backend)}
        print(kind, json.dumps(report[kind]), flush=True)
        del llm
    print(json.dumps(report))


if __name__ == "__main__":
    main()
