"""GPT-OSS MXFP4 experts kept 4-bit vs dequantized: resident weight bytes and decode time.

A random GPT-OSS-shaped model (tests/gptoss_checkpoints.py, sizes below) is saved twice: with
its experts as MXFP4 blocks and scales, and as the float checkpoint of transformers' decoding of
them. Both load with the same backend and dtype; the script prints each one's weight bytes by
dtype (`weight_bytes`) and the median time of a greedy decode step at a few batch sizes
(each step padded to 2 x batch tokens, as tests/conftest.py's PagedRunner pads; after a warm-up
run; the two models alternate, `--rounds` times).

  python scripts/bench_mxfp4.py [--backend cpu] [--dtype bfloat16] [--hidden 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from conftest import PagedRunner, load_tiny
    from gptoss_checkpoints import make_gptoss, make_gptoss_mxfp4
    from jaxllm.loader.loader import describe_weights, weight_bytes

    d = tempfile.mkdtemp()
    E = args.hidden
    f = make_gptoss(os.path.join(d, "float"), hidden_size=E, intermediate_size=E,
                    num_local_experts=args.experts, num_hidden_layers=args.layers,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    q, dq = os.path.join(d, "mxfp4"), os.path.join(d, "dequantized")
    make_gptoss_mxfp4(f, q, dq)
    # "kept" asks for --quantization mxfp4: on CPU the default dequantizes at load.
    models = {name: load_tiny(path, dtype=args.dtype, attention_backend=args.backend, **kw)[0]
              for name, path, kw in (("kept", q, {"quantization": "mxfp4"}),
                                     ("dequantized", dq, {}))}
    for name, model in models.items():
        print(f"{name:12s} {describe_weights(weight_bytes(model))}  "
              f"({sum(weight_bytes(model).values())} bytes)")

    for batch in map(int, args.batches.split(",")):
        runners = {n: PagedRunner(m, 16, batch, args.steps + 2, num_tokens=2 * batch)
                   for n, m in models.items()}
        times = {n: [] for n in models}
        for r in range(args.rounds + 1):  # the first round warms up (compiles)
            for name, runner in runners.items():
                runner.kv_lens[:] = 0  # the sequences start again (one compiled step)
                seqs = list(range(batch))
                out = runner.step(seqs, [[1 + i] for i in seqs])
                tokens = [int(o[-1].argmax()) for o in out]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = runner.step(seqs, [[t] for t in tokens])
                    tokens = [int(o[0].argmax()) for o in out]
                if r:
                    times[name].append((time.perf_counter() - t0) / args.steps)
        kept, deq = (np.median(times[n]) * 1e3 for n in ("kept", "dequantized"))
        print(f"batch {batch:3d}: decode step kept {kept:.2f} ms, dequantized {deq:.2f} ms "
              f"(kept / dequantized {kept / deq:.2f})")


if __name__ == "__main__":
    main()
