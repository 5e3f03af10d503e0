"""Quantized checkpoints on a tensor-parallel (and expert-parallel) mesh of virtual CPU devices
give what one device gives (issue 45): the quantized values, scales and zero points are
sharded with their projection's logical axes."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from conftest import run_with_host_devices
from quant_checkpoints import write_quantized

ATOL = 1e-4
RUNS = {"dense": [(1, False), (2, False)], "moe": [(1, False), (2, False), (2, True)]}


def test_quantized_tensor_parallel_matches_single_device(make_tiny_checkpoint, tmp_path):
    paths = {"dense": write_quantized(make_tiny_checkpoint("llama"), str(tmp_path / "dense"),
                                      "w4a16", group_size=16, symmetric=False),
             "moe": write_quantized(make_tiny_checkpoint("qwen2_moe"), str(tmp_path / "moe"),
                                    "w8a16")}
    proc = run_with_host_devices(2, [__file__, json.dumps(paths)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, runs in report.items():
        base = runs["1"]
        for key, run in runs.items():
            if key == "1":
                continue
            assert run["devices"] == 2
            for field in ("prefill", "steps"):
                np.testing.assert_allclose(np.array(run[field]), np.array(base[field]),
                                           atol=ATOL, rtol=0, err_msg=f"{name} {key} {field}")
            assert run["tokens"] == base["tokens"], f"{name} {key}"
        sharded = runs["2"]["sharded"]
        # The quantized MLP values are split over the devices as the float ones are.
        assert "layers/0/gate_up" in sharded and "layers/0/gate_up_scale" in sharded, sharded
        if name == "dense":
            assert "layers/0/gate_up_zero" in sharded
        else:  # experts split by FFN (TP) or by expert (EP)
            assert "layers/0/experts_gate_up" in sharded
            assert "layers/0/experts_gate_up" in runs["2-ep"]["sharded"]


def _child(paths: dict) -> dict:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny, sharded_params

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 512, n)] for n in (7, 19)]
    report = {}
    for name, path in paths.items():
        report[name] = {}
        for tp, ep in RUNS[name]:
            model, cfg, _ = load_tiny(path, tp=tp, enable_expert_parallel=ep)
            assert cfg.quant is not None
            sharded = sharded_params(model)
            report[name][f"{tp}-ep" if ep else str(tp)] = {
                "sharded": sharded, **greedy_record(model, prompts, 6)}
    return report


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
