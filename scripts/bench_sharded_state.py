"""Cold start and peak host memory: a model loaded from its checkpoint vs from the
sharded_state folder `jaxllm convert` wrote of it, each in a fresh process, alternating.

    python scripts/bench_sharded_state.py [--model M] [--rounds 3] [--out DIR]

Reports, per round, the engine's weight-load time (start-up's "load" phase), the whole
start-up, and the process's peak resident memory (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import json, resource, sys, time
t = time.perf_counter()
from jaxllm import LLM
llm = LLM(sys.argv[1], max_model_len=512, enforce_eager=True)
total = time.perf_counter() - t
print(json.dumps({"load": llm.llm_engine.startup_times["load"], "total": total,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def run(model: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True,
                          text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from jaxllm.config import DEFAULT_MODEL
    from jaxllm.loader.default_model import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="Where to convert to (default: a temp dir).")
    args = ap.parse_args()
    model = resolve_model(args.model)
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="jaxllm-sharded-"), "model")
    if not os.path.exists(out):
        subprocess.run([sys.executable, "-m", "serving.cli.main", "convert", model, out],
                       env={**os.environ, "PYTHONPATH": ROOT}, check=True,
                       capture_output=True)
    for r in range(args.rounds):
        for name, path in (("checkpoint", model), ("sharded_state", out)):
            m = run(path)
            print(f"round {r} {name:13s} load {m['load']:6.2f} s  start-up {m['total']:6.2f} s"
                  f"  peak RSS {m['peak_rss_gib']:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
