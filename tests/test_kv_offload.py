"""KV offloading to host memory (--kv-offloading-size, issue 52): prefix-cache blocks evicted
from the device are saved to a host tier and copied back on a later hit.

The manager's plans are checked against a simulated cache (each block "holds" the tokens
whose KV was computed into it): a block copied back holds exactly what was saved. Through the
engine, a prompt whose blocks were all evicted comes back from host memory (counted) with
the same tokens and logprobs as when it was computed; the copy programs compiled at start-up,
not in those steps."""

from __future__ import annotations

import logging

import jax
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.kv_offload import HostBlock, HostTier
from jaxllm.sampling_params import SamplingParams as SP
from jaxllm.sequence import Sequence


class SimulatedCache:
    """Device blocks and saved copies, moved as the manager's transfers say."""

    def __init__(self):
        self.device, self.saved = {}, {}

    def apply(self, t) -> None:
        for bid, key in t.saves:
            self.saved[key] = self.device.get(bid)
        for key in t.drops:
            self.saved.pop(key, None)
        for key, bid in t.loads:
            self.device[bid] = self.saved.pop(key)


def _run(kv: KVCacheManager, sim: SimulatedCache, seq: Sequence):
    """Admit seq with its prefix hit, apply the plan's transfers, 'compute' the rest."""
    blocks, cached = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - cached, blocks)
    sim.apply(kv.take_transfers())
    ids = kv.get_block_ids(seq.seq_id)
    for i in range(cached // kv.block_size, len(ids)):
        sim.device[ids[i]] = tuple(seq.prompt_token_ids[i * kv.block_size:
                                                        (i + 1) * kv.block_size])
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)
    return blocks, cached


def _seq(rid, tokens):
    return Sequence(rid, list(tokens), SP())


def test_evicted_blocks_come_back_from_the_host_tier():
    kv, sim = KVCacheManager(5, 2, host_tier=HostTier(8)), SimulatedCache()
    a = _seq("a", range(10, 18))  # 4 full blocks
    _run(kv, sim, a)
    kv.free(a)
    b = _seq("b", range(50, 58))  # takes the free block, then evicts a's blocks
    _run(kv, sim, b)
    kv.free(b)
    assert kv.host_tier.saved_blocks == 3 and len(sim.saved) == 3
    again = _seq("a2", range(10, 18))
    blocks, cached = _run(kv, sim, again)
    assert cached == 6 and any(isinstance(x, HostBlock) for x in blocks)
    ids = kv.get_block_ids("a2")
    assert [sim.device[i] for i in ids] == [(10, 11), (12, 13), (14, 15), (16, 17)]
    assert kv.host_tier.hit_blocks >= 1 and kv.prefix_cache_hits == cached
    kv.free(again)
    assert kv.reset_prefix_cache() and len(kv.host_tier) == 0
    sim.apply(kv.take_transfers())
    assert sim.saved == {}  # the reset dropped every saved copy


def test_host_tier_is_bounded_least_recently_saved_first():
    kv, sim = KVCacheManager(3, 2, host_tier=HostTier(2)), SimulatedCache()
    for i in range(4):
        s = _seq(f"s{i}", range(100 * i, 100 * i + 6))
        _run(kv, sim, s)
        kv.free(s)
    assert len(kv.host_tier) == 2 and len(sim.saved) == 2
    assert kv.host_tier.saved_blocks > 2  # others were dropped to stay within 2


PROMPT = list(range(3, 43))  # 40 tokens: 10 blocks of 4
OTHERS = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(2)]
# Steps of at most 64 tokens (max_model_len: a prompt still fits one step), not the default
# 2048: three token buckets to compile instead of eight.
ENGINE = dict(dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=16,
              max_num_seqs=2, max_num_batched_tokens=64, kv_offloading_size=0.01)


def test_engine_prompt_comes_back_from_host_memory(tiny_llama, caplog):
    llm = LLM(tiny_llama, **ENGINE)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        _host_round_trip(llm)
    compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not [m for m in compiled if "_gather" in m or "_scatter" in m], compiled


def _host_round_trip(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(prompt):
        (out,) = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)
        c = out.outputs[0]
        return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]

    first = run(PROMPT)
    for other in OTHERS:  # each needs 11 of the 16 blocks: PROMPT's cached ones go
        run(other)
    stats = llm.llm_engine.stats()
    assert stats.kv_offload_saved_blocks >= 10
    tokens, logprobs = run(PROMPT)
    after = llm.llm_engine.stats()
    assert after.kv_offload_hit_blocks - stats.kv_offload_hit_blocks == 9  # all but the last
    assert after.prefix_cache_hits - stats.prefix_cache_hits == 36
    assert tokens == first[0]
    assert logprobs == pytest.approx(first[1], abs=1e-5)


def test_refusals(tiny_llama):
    for flags, name in ((dict(kv_offloading_size=0), "--kv-offloading-size"),
                        (dict(kv_offloading_size=1, enable_prefix_caching=False),
                         "--enable-prefix-caching"),
                        (dict(kv_offloading_size=1, pipeline_parallel_size=2),
                         "--pipeline-parallel-size")):
        with pytest.raises(ConfigError, match=name):
            EngineArgs(model=tiny_llama, **flags)
    with pytest.raises(ConfigError, match="less than one KV block"):
        LLM(tiny_llama, **{**ENGINE, "kv_offloading_size": 1e-9})


def test_store_moves_more_blocks_than_one_call_takes():
    """A step saving or loading more than MAX_BLOCKS_PER_CALL blocks makes several calls; each
    block comes back where it is loaded, and padded rows write nothing."""
    import numpy as np

    from jaxllm.sequence import KVTransfers
    from jaxllm.worker.kv_transfer import MAX_BLOCKS_PER_CALL, HostKVStore

    n = MAX_BLOCKS_PER_CALL + 6
    rng = np.random.default_rng(0)
    caches = {"k": jax.numpy.asarray(rng.random((2, n + 3, 4), np.float32)),
              "v": jax.numpy.asarray(rng.random((2, n + 3, 4), np.float32))}
    before = jax.tree.map(np.asarray, caches)
    store = HostKVStore()
    caches = store.apply(caches, KVTransfers(saves=tuple((b, 1000 + b) for b in range(n))))
    assert len(store) == n
    zeroed = jax.tree.map(lambda c: c.at[:, :n].set(0), caches)
    back = store.apply(zeroed, KVTransfers(loads=tuple((1000 + b, n - 1 - b) for b in range(n))))
    for name in ("k", "v"):
        got = np.asarray(back[name])
        assert np.array_equal(got[:, :n], before[name][:, :n][:, ::-1])  # reversed places
        assert np.array_equal(got[:, n:], before[name][:, n:])  # untouched
    assert len(store) == 0
