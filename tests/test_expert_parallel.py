"""Expert parallelism: --enable-expert-parallel shards each MoE layer's experts over the
tensor-parallel devices (2, 4 and 8) and gives the same logits and greedy tokens as one
device; tensor parallelism without it (each expert's FFN split) does too.

As tests/test_tensor_parallel.py: a subprocess with 8 host devices (this file's __main__)
prints a JSON report the test checks. Models: Qwen2-MoE (8 experts, top-2, a shared expert,
one dense layer between two MoE layers) and Mixtral (8 experts, top-2). Tolerance: atol 1e-4
on float32 logits.
"""

import json
import os
import sys

import numpy as np
import pytest

from conftest import run_with_host_devices

ATOL = 1e-4
NEW_TOKENS = 8
# run name -> (tensor-parallel size, expert parallel)
RUNS = {"qwen2_moe": {"1": (1, False), "tp2": (2, False), "ep2": (2, True), "ep4": (4, True),
                      "ep8": (8, True)},
        "mixtral": {"1": (1, False), "tp4": (4, False), "ep8": (8, True)}}


@pytest.mark.slow  # ~3 min alone (8 loads and compiles on 8 virtual devices), 7 under load
def test_expert_parallel_matches_single_device(make_tiny_checkpoint):
    paths = {name: make_tiny_checkpoint(name) for name in RUNS}
    proc = run_with_host_devices(8, [__file__, json.dumps(paths)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, runs in report.items():
        base = runs["1"]
        assert base["experts_spec"] == [None] * 5  # one device: nothing sharded
        for run_name, (tp, ep) in RUNS[name].items():
            run = runs[run_name]
            assert run["devices"] == tp
            for key in ("prefill", "steps"):
                np.testing.assert_allclose(np.array(run[key]), np.array(base[key]), atol=ATOL,
                                           rtol=0, err_msg=f"{name} {run_name} {key}")
            assert run["tokens"] == base["tokens"], f"{name} {run_name}"
            if tp > 1:  # [layers, experts, embed, 2, F]: experts sharded, or their FFN
                want = [None, "model", None, None, None] if ep else [None] * 4 + ["model"]
                assert run["experts_spec"] == want, f"{name} {run_name}"


def test_expert_count_must_divide(make_tiny_checkpoint):
    """8 experts over 3 devices: refused with the numbers (a subprocess with 3 host devices)."""
    path = make_tiny_checkpoint("mixtral")
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import load_tiny\n"
            "from jaxllm.config import ConfigError\n"
            f"try:\n    load_tiny({path!r}, tp=3, enable_expert_parallel=True)\n"
            "except ConfigError as e:\n    print('REFUSED', e)\n")
    proc = run_with_host_devices(3, ["-c", code], timeout=300)
    assert "REFUSED" in proc.stdout, proc.stderr[-2000:]
    assert "8 experts do not divide over 3 devices" in proc.stdout


def _child(paths: dict) -> dict:
    """Runs under 8 host devices: each model at each setting; logits, tokens, expert sharding."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 512, n)] for n in (7, 19)]
    report = {}
    for name, path in paths.items():
        report[name] = {}
        for run_name, (tp, ep) in RUNS[name].items():
            model, _, _ = load_tiny(path, tp=tp, enable_expert_parallel=ep)
            moe = next(g for g, grp in zip(model.layers, model.groups) if grp.kind == "moe")
            spec = moe.experts_gate_up[...].sharding.spec
            report[name][run_name] = {"experts_spec": list(spec) + [None] * (5 - len(spec)),
                                      **greedy_record(model, prompts, NEW_TOKENS)}
    return report


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
