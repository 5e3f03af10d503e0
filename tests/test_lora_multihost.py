"""LoRA across hosts (--nnodes 2): two processes on loopback, one CPU device each, joined by
jax.distributed as tests/test_multihost.py runs them. Rank 0 reads the adapters and writes
each slot through the step channel, so the follower (which is never given the adapter
folders) writes the same slots of its devices: with tensor parallelism over both hosts, and
with a pipeline stage on each (each host writing its own stage's share). Three adapters and
the base model over two slots in one batch: rank 0's greedy tokens and logprobs equal one
process on one device.

Every process is a subprocess of this file's __main__; each wait is bounded.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from test_multihost import _finish, _free_port, _report, _start

NEW = 6


@pytest.fixture(scope="module")
def adapter_paths(tiny_llama, tmp_path_factory) -> dict:
    from lora_adapters import ADAPTERS, make_adapters

    adapters = make_adapters(tiny_llama, str(tmp_path_factory.mktemp("lora_hosts")))
    return {name: adapters[name][0] for name in ADAPTERS}


@pytest.mark.slow  # three processes compiling on the same cores (minutes)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(pipeline_parallel_size=2)], ids=["tp", "pp"])
def test_lora_on_two_hosts_matches_one_process(tiny_llama, adapter_paths, layout):
    port = _free_port()
    one, *hosts = _finish([
        _start("leader", tiny_llama, 1, script=__file__, paths=adapter_paths),
        _start("leader", tiny_llama, 1, script=__file__, paths=adapter_paths, nnodes=2,
               node_rank=0, master_port=port, **layout),
        _start("follower", tiny_llama, 1, script=__file__, nnodes=2, node_rank=1,
               master_port=port, headless=True, **layout)])
    assert [r[0] for r in hosts] == [0, 0], "\n".join(
        f"rank {i} (exit {r[0]}): {r[2][-1500:]}" for i, r in enumerate(hosts))
    one, two = _report(one), _report(hosts[0])
    assert two["processes"] == 2 and one["processes"] == 1
    for i, (a, b) in enumerate(zip(two["outputs"], one["outputs"])):
        assert a["tokens"] == b["tokens"], (i, a["adapter"])
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4, err_msg=str(i))
    # the adapters change the outputs: one prompt under the base and each adapter
    assert len({tuple(o["tokens"]) for o in one["outputs"][-4:]}) == 4
    # slots were written on both hosts as calls of the step channel
    assert two["lora_writes"] > 2  # more adapters than slots: slots refilled
    assert int(hosts[1][1].strip().splitlines()[-1]) == two["channel_calls"] > 0


def _engine_args(kw: dict) -> dict:
    return {**dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                   max_num_seqs=4, max_num_batched_tokens=32, block_size=4, max_model_len=64,
                   use_tqdm_on_load=False, seed=0, disable_log_stats=True,
                   attention_backend="reference"), **kw}


def _leader(path: str, kw: dict) -> dict:
    import jax

    from jaxllm import LLM, LoRARequest, SamplingParams

    paths = kw.pop("paths")
    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(paths.items())}
    names = [None, *paths] * 3
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(4, 20))).tolist() for _ in names]
    prompts[-4:] = [prompts[-1]] * 4
    llm = LLM(path, **_engine_args(kw))
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                        lora_request=[reqs.get(n) for n in names], use_tqdm=False)
    leader = engine.step_leader
    return {"processes": jax.process_count(), "lora_writes": engine.lora_slots.num_writes,
            "channel_calls": leader.calls if leader else 0,
            "outputs": [{"adapter": n, "tokens": list(o.outputs[0].token_ids),
                         "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                     o.outputs[0].token_ids)]}
                        for n, o in zip(names, outs)]}


def _follower(path: str, kw: dict) -> int:
    from jaxllm.config import EngineArgs
    from jaxllm.deploy.follower import run_headless
    return run_headless(EngineArgs(model=path, **_engine_args(kw)))


if __name__ == "__main__":
    role, model, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(json.dumps(_leader(model, extra) if role == "leader" else _follower(model, extra)),
          flush=True)
