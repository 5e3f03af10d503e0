"""Qwen3-Next at tensor parallel 2 (virtual CPU devices, in a subprocess as
tests/test_tensor_parallel.py): the model-level ragged prefill + decode logits and greedy tokens
equal one device's, the linear-attention recurrent state is split over the devices by its value
heads, and the engine at --tensor-parallel-size 2 gives one device's greedy tokens."""

import json
import os
import sys

import numpy as np
import pytest

from conftest import run_with_host_devices

ATOL = 1e-4
STEPS = 8


@pytest.mark.slow  # a subprocess loading and compiling the model twice and two engines (~4 min on a busy machine)
def test_tensor_parallel_2_matches_one_device(make_tiny_checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer

    from qwen3_next_checkpoints import make_qwen3_next
    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    path = make_qwen3_next(tmp_path_factory, tok, {})
    proc = run_with_host_devices(2, [__file__, path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = report["1"], report["2"]
    assert two["devices"] == 2 and one["devices"] == 1
    assert two["state_spec"][2] == "model"  # [layers, slots, value heads, Dk, Dv]
    np.testing.assert_allclose(np.array(two["logits"]), np.array(one["logits"]), atol=ATOL,
                               rtol=0)
    assert two["tokens"] == one["tokens"]
    assert two["engine_tokens"] == one["engine_tokens"]


def _child(path: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import load_tiny
    from qwen3_next_checkpoints import StateRunner
    from test_engine import GREEDY, small_llm, token_ids

    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, 512, n)] for n in (7, 70)]
    report = {}
    for tp in (1, 2):
        model, _, _ = load_tiny(path, tp=tp)
        runner = StateRunner(model, 4, len(prompts), 128, 128)
        out = runner.step([0, 1], prompts)
        logits = [o[-1] for o in out]
        last = [int(o[-1].argmax()) for o in out]
        tokens = [last]
        for _ in range(STEPS):
            out = runner.step([0, 1], [[t] for t in last])
            logits += [o[0] for o in out]
            last = [int(o[0].argmax()) for o in out]
            tokens.append(last)
        spec = runner.cache[0].v.sharding.spec
        llm = small_llm(path, tensor_parallel_size=tp, max_num_seqs=2,
                        max_num_batched_tokens=16, max_model_len=128)
        engine_tokens = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               GREEDY, use_tqdm=False))
        report[str(tp)] = {"devices": len(model.embed[...].sharding.device_set),
                           "logits": np.stack(logits).tolist(), "tokens": tokens,
                           "state_spec": [s if isinstance(s, str) or s is None else list(s)
                                          for s in tuple(spec) + (None,) * 5][:5],
                           "engine_tokens": engine_tokens}
    return report


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
