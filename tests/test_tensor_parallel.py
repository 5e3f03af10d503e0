"""Tensor parallelism: tp=2 and tp=4 (and the Pallas backend at tp=4) give the same logits and
greedy tokens as tp=1.

JAX fixes its device count at import, so the comparison runs in a subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (this file's __main__), which prints a JSON
report that the test checks. Models: Llama with 2 KV heads (at tp=4 the KV heads do not divide
and are replicated while the MLP and vocabulary stay sharded) and Qwen2 with 4 KV heads and
biases (every attention weight sharded at tp=4). Tolerance: atol 1e-4 on float32 logits.
"""

import json
import os
import sys

import numpy as np

from conftest import run_with_host_devices

ATOL = 1e-4
TPS = (1, 2, 4)
PALLAS = "4-pallas"  # the Pallas backend (its GPU kernel, interpreted) at tp=4
NEW_TOKENS = 8


def test_tensor_parallel_matches_single_device(make_tiny_checkpoint):
    paths = {"llama-2kv": make_tiny_checkpoint("llama"),
             "qwen2-4kv": make_tiny_checkpoint("qwen2", num_key_value_heads=4)}
    proc = run_with_host_devices(8, [__file__, json.dumps(paths)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, runs in report.items():
        base = runs["1"]
        assert not base["sharded"]
        for tp in TPS[1:]:
            run = runs[str(tp)]
            assert run["devices"] == tp
            assert run["backend"] == "reference"  # XLA cannot partition the native CPU kernels
            for key in ("prefill", "steps"):
                np.testing.assert_allclose(np.array(run[key]), np.array(base[key]), atol=ATOL,
                                           rtol=0, err_msg=f"{name} tp={tp} {key}")
            assert run["tokens"] == base["tokens"], f"{name} tp={tp}"
            assert "layers/0/gate_up" in run["sharded"] and "embed" in run["sharded"]
        # The Pallas backend on 4 devices: its kernel runs per shard of KV heads (shard_map)
        # where they divide (qwen2-4kv), on replicated heads where they do not (llama-2kv).
        pallas = runs[PALLAS]
        assert pallas["backend"] == "pallas" and pallas["devices"] == 4
        for key in ("prefill", "steps"):
            np.testing.assert_allclose(np.array(pallas[key]), np.array(base[key]), atol=ATOL,
                                       rtol=0, err_msg=f"{name} {PALLAS} {key}")
        assert pallas["tokens"] == base["tokens"], f"{name} {PALLAS}"
        # 2 KV heads split over 2 devices but are replicated on 4; 4 KV heads split on both
        kv_sharded = [("layers/0/qkv" in runs[str(tp)]["sharded"]) for tp in TPS[1:]]
        assert kv_sharded == ([True, False] if name == "llama-2kv" else [True, True])


def _child(paths: dict) -> dict:
    """Runs under 8 host devices: each model at each tp; logits, tokens, sharded params."""

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny, sharded_params

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 512, n)] for n in (7, 19)]
    report = {}
    for name, path in paths.items():
        report[name] = {}
        for tp, backend in [(tp, "auto") for tp in TPS] + [(4, "pallas")]:
            model, _, mesh = load_tiny(path, tp=tp, attention_backend=backend)
            sharded = sharded_params(model)
            report[name][PALLAS if backend == "pallas" else str(tp)] = {
                "backend": model.backend.name, "sharded": sharded,
                **greedy_record(model, prompts, NEW_TOKENS)}
    return report


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
