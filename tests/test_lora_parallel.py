"""LoRA adapters on a tensor-parallel mesh of virtual CPU devices give what one device gives:
the slots carry their projection's logical axes, so they are sharded as it is (issue 46)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from conftest import run_with_host_devices
from lora_adapters import ADAPTERS, make_adapters

NAMES = [None, *ADAPTERS]


@pytest.mark.slow  # ~50 s: two engines in a subprocess of two virtual devices
def test_lora_tensor_parallel_matches_single_device(tiny_llama, tmp_path):
    adapters = make_adapters(tiny_llama, str(tmp_path))
    paths = {name: adapters[name][0] for name in ADAPTERS}
    proc = run_with_host_devices(2, [__file__, json.dumps([tiny_llama, paths])])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = runs["1"], runs["2"]
    assert two["devices"] == 2 and "layers/0/qkv_lora_b" in two["sharded"], two["sharded"]
    for name, a, b in zip(NAMES, one["outputs"], two["outputs"]):
        assert a["tokens"] == b["tokens"], name
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4, err_msg=str(name))
    # the adapters changed the outputs (else equal outputs would prove little)
    assert len({tuple(o["tokens"]) for o in one["outputs"]}) == len(NAMES)


def _child(base: str, paths: dict) -> dict:
    import jax
    from flax import nnx

    from jaxllm import LLM, LoRARequest, SamplingParams

    reqs = [None] + [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(paths.items())]
    prompt = list(range(30, 45))
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    report = {}
    for tp in (1, 2):
        llm = LLM(base, dtype="float32", tensor_parallel_size=tp, enable_lora=True,
                  max_loras=2, max_lora_rank=16, max_num_seqs=4, max_num_batched_tokens=64,
                  block_size=4, use_tqdm_on_load=False, disable_log_stats=True)
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(reqs), sp, lora_request=reqs,
                            use_tqdm=False)
        state = llm.llm_engine.runner.state
        sharded = sorted("/".join(map(str, p)) for p, v in nnx.to_flat_state(state)
                         if "model" in jax.tree.leaves(tuple(v.get_value().sharding.spec)))
        report[str(tp)] = {
            "devices": len(jax.tree.leaves(state)[0].sharding.device_set), "sharded": sharded,
            "outputs": [{"tokens": list(o.outputs[0].token_ids),
                         "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                     o.outputs[0].token_ids)]}
                        for o in outs]}
    return report


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_child(*json.loads(sys.argv[1]))))
