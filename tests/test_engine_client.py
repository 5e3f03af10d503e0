"""Every engine keeps its contract (jaxllm/engine/client.py): the calls exist with the
contract's parameters, and stats() returns the typed EngineStats, on the classes and on a
running engine."""

import inspect

import pytest

from jaxllm import LLM, SamplingParams

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine.client import EngineClient, EngineCore
from jaxllm.deploy.data_parallel import DataParallelEngine
from jaxllm.deploy.remote_replica import RemoteReplica
from jaxllm.engine.engine import LLMEngine
from jaxllm.engine.stats import EngineStats, SpecDecodeStats, sum_stats


def _members(protocol) -> dict:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


@pytest.mark.parametrize("protocol,cls", [
    (EngineCore, LLMEngine), (EngineCore, DataParallelEngine), (EngineCore, RemoteReplica),
    (EngineClient, AsyncLLMEngine)])
def test_class_keeps_the_contract(protocol, cls):
    members = _members(protocol)
    assert members, protocol
    for name, want in members.items():
        have = getattr(cls, name, None)
        assert have is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            continue
        if isinstance(have, property):
            pytest.fail(f"{cls.__name__}.{name} is a property; the contract calls it")
        wanted = list(inspect.signature(want).parameters)
        got = list(inspect.signature(have).parameters)
        assert got[:len(wanted)] == wanted, (cls.__name__, name, got, wanted)


def test_running_engine_is_an_engine_core(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=64, max_num_seqs=4, enforce_eager=True,
              kv_cache_memory_bytes=1 << 20)
    engine = llm.llm_engine
    assert isinstance(engine, EngineCore)
    before = engine.stats()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
    s = engine.stats()
    assert isinstance(s, EngineStats) and s.num_total_blocks > 0 and s.spec_decode is None
    assert s.generation_tokens_total - before.generation_tokens_total == 3
    assert s.prompt_tokens_total - before.prompt_tokens_total == 3
    assert len(out[0].outputs[0].token_ids) == 3 and s.num_running == 0


def test_stats_travel_and_add_up():
    a = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.5, num_total_blocks=10,
                    prefix_cache_queries=4, prefix_cache_hits=1, expert_load={3: [1, 2]},
                    spec_decode=SpecDecodeStats(2, 4, 3, (2, 1), 5))
    b = EngineStats(num_running=3, kv_cache_usage=0.0, num_total_blocks=30,
                    expert_load={3: [10, 0]}, spec_decode=None)
    assert EngineStats.from_dict(a.to_dict()) == a
    total = sum_stats([a, b], prefix_affinity_hits=7)
    assert (total.num_running, total.num_waiting, total.num_total_blocks) == (4, 2, 40)
    assert total.kv_cache_usage == pytest.approx(5 / 40)
    assert list(total.expert_load[3]) == [11, 2]
    assert total.replicas == (a, b) and total.prefix_affinity_hits == 7
    assert a.prefix_cache_hit_rate == 0.25 and b.prefix_cache_hit_rate == 0.0
    assert EngineStats.from_dict(total.to_dict()).replicas == (a, b)
