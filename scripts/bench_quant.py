"""Quantized checkpoints against their float model, alternating, as ratios (issue 45).

    python scripts/bench_quant.py --base BF16_FOLDER --variant w8a16=FOLDER --variant
        w4a16=FOLDER [--variant fp8=BF16_FOLDER:--quantization=fp8] [--rounds 3]

Each round runs every model once through `jaxllm bench latency` (batch 1: decode tokens/s) and
`jaxllm bench throughput` (--num-prompts prompts at once), each in a fresh process, in turn;
the table gives each variant's medians and its ratio to the base's, with the weights resident
per device. Extra engine flags of a variant follow its folder after ':' (comma-separated).
The quantized folders can be written with tests/quant_checkpoints.py (write_quantized).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

FLAGS = ["--max-model-len", "512", "--disable-log-stats"]


def run(kind: str, folder: str, extra: list[str], args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        shape = (["--batch-size", "1", "--input-len", str(args.input_len), "--output-len",
                  str(args.output_len), "--num-iters", "3", "--num-iters-warmup", "1"]
                 if kind == "latency" else
                 ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                  "--output-len", str(args.output_len)])
        cmd = [sys.executable, "-m", "serving.cli.main", "bench", kind, "--model", folder,
               *shape, *FLAGS, *extra, "--output-json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FOLDER[:FLAGS]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--json", help="also write the raw results")
    a = p.parse_args(argv)
    models = {"base": (a.base, [])}
    for v in a.variant:
        name, spec = v.split("=", 1)
        folder, _, flags = spec.partition(":")
        models[name] = (folder, [f for f in flags.split(",") if f])
    results = {name: {"decode": [], "throughput": [], "weights": {}} for name in models}
    for r in range(a.rounds):
        for name, (folder, extra) in models.items():
            lat = run("latency", folder, extra, a)
            thr = run("throughput", folder, extra, a)
            results[name]["decode"].append(lat["decode_tokens_per_s"])
            results[name]["throughput"].append(thr["output_tokens_per_s"])
            results[name]["weights"] = lat.get("weights_gib", {})
            print(f"round {r + 1} {name}: decode {lat['decode_tokens_per_s']:.1f} tok/s, "
                  f"throughput {thr['output_tokens_per_s']:.1f} tok/s", flush=True)
    base = {k: statistics.median(results["base"][k]) for k in ("decode", "throughput")}
    print(f"\n{'model':<10} {'weights GiB':>12} {'decode b1':>10} {'ratio':>6} "
          f"{'thr b' + str(a.num_prompts):>10} {'ratio':>6}")
    for name, res in results.items():
        d, t = (statistics.median(res[k]) for k in ("decode", "throughput"))
        w = sum(res["weights"].values())
        print(f"{name:<10} {w:>12.3f} {d:>10.1f} {d / base['decode']:>6.2f} {t:>10.1f} "
              f"{t / base['throughput']:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
