"""scripts/compare_peers.py's report: the ratios it states against a peer."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import compare_peers  # noqa: E402


def _run(engine, rep, tok_s):
    return {"model": "m", "dtype": "bfloat16", "workload": "throughput", "engine": engine,
            "rep": rep, "output_tokens_per_s": tok_s, "total_tokens_per_s": 2 * tok_s}


def test_paired_ratio_is_the_median_of_each_repetitions_ratio():
    """A drifting machine: both engines slow down together in rep 1. Best / best and median /
    median mix minutes; the paired ratio compares each repetition's two runs."""
    runs = [_run("jaxllm", 0, 100.0), _run("vllm", 0, 110.0),
            _run("jaxllm", 1, 50.0), _run("vllm", 1, 50.0),
            _run("jaxllm", 2, 90.0), _run("vllm", 2, 200.0),
            _run("vllm", 3, 120.0)]  # a repetition jaxllm did not finish: not paired
    row = compare_peers.summarize(runs, ["jaxllm", "vllm"])[0]
    ratio = row["jaxllm/vllm"]
    assert ratio["best"] == pytest.approx(100 / 200)
    assert ratio["median"] == pytest.approx(90 / 115)
    assert ratio["paired"] == pytest.approx(100 / 110)  # median of 0.909, 1.0, 0.45


def test_worker_model_length_fits_the_runs():
    """A 16 x 1024 -> 64 run: jaxllm's worker default (1024) would leave each prompt room for
    one output token, so the length is raised to 1088; a longer default or an explicit
    --max-model-len stands."""
    import argparse

    import peer_worker

    def args(max_len=None, min_len=0):
        return argparse.Namespace(max_model_len=max_len, min_model_len=min_len)

    assert peer_worker.model_len(args(min_len=1024 + 64), 1024) == 1088
    assert peer_worker.model_len(args(min_len=256), 1024) == 1024
    assert peer_worker.model_len(args(min_len=1088), 2048) == 2048
    assert peer_worker.model_len(args(max_len=512, min_len=1088), 1024) == 512
