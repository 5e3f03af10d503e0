"""Time to first token of a one-image prompt on a small random Qwen2.5-VL-shaped model (text:
hidden 512, 4 layers; vision: hidden 256, 4 blocks; a 448x448 image = 1024 patches = 256
image tokens), jaxllm against transformers (float32, CPU), alternating, each image new (no
prefix-cache or encoder-cache hit); and the encoder step's share of jaxllm's TTFT.

    python scripts/bench_vlm_ttft.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout, and its test models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    import vlm_checkpoints as vc
    from jaxllm import LLM, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    path = tempfile.mkdtemp(prefix="bench_vlm_")
    tok = vc.tokenizer()
    text = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 12, 12]})
    cfg = vc.config(tok, text, depth=4, hidden_size=256, intermediate_size=512, num_heads=4,
                    out_hidden_size=512, window_size=112, fullatt_block_indexes=[1, 3])
    hf = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    proc = vc.image_processor()
    proc.max_pixels = 448 * 448
    proc.save_pretrained(path)
    llm = LLM(path, dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=512)
    encoder = llm.llm_engine.runner.encoder
    encode_s = []
    inner = encoder._embeddings

    def timed(*a):
        t0 = time.perf_counter()
        out = inner(*a)
        encode_s.append(time.perf_counter() - t0)
        return out

    encoder._embeddings = timed
    one = SamplingParams(max_tokens=1, temperature=0.0)
    ours, theirs = [], []
    for r in range(args.rounds + 1):  # round 0 compiles
        image = vc.image(100 + r, 448, 448)
        t0 = time.perf_counter()
        llm.generate({"prompt": vc.PROMPT, "multi_modal_data": {"image": image}}, one,
                     use_tqdm=False)
        dt = time.perf_counter() - t0
        px = proc(images=[image], return_tensors="np")
        ids = vc.expand(tok.encode(vc.PROMPT), px["image_grid_thw"], cfg.image_token_id)
        t0 = time.perf_counter()
        vc.hf_generate(hf, ids, px["pixel_values"], px["image_grid_thw"], 1)
        if r:
            ours.append(dt)
            theirs.append(time.perf_counter() - t0)
    share = statistics.median(encode_s[1:]) / statistics.median(ours)
    print(f"image tokens {len(ids) - len(tok.encode(vc.PROMPT)) + 1}, prompt {len(ids)} "
          f"tokens; TTFT median: jaxllm {statistics.median(ours) * 1e3:.1f} ms, transformers "
          f"{statistics.median(theirs) * 1e3:.1f} ms (transformers' TTFT excludes its image "
          f"preprocessing), ratio {statistics.median(theirs) / statistics.median(ours):.2f}x; "
          f"encoder step {share * 100:.0f}% of jaxllm's TTFT "
          f"({np.median(encode_s[1:]) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
