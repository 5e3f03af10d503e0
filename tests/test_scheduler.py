"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption by recompute, priority,
abort, token-level stops and prefix-cache hits, driven by a fake model (no JAX)."""

import logging
import random

import pytest

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.sequence import PENDING, Sequence, SequenceStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.sampling_params import SamplingParams

BS = 4
EOS = 0
VOCAB = 50


def make(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=128, chunked=True,
         policy="fcfs", prefix_caching=True, block_size=BS):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy,
                     block_size=block_size)


def req(rid, prompt, arrival=0.0, priority=0, **params):
    params.setdefault("ignore_eos", True)
    return Sequence(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival, priority=priority)


class FakeModel:
    """Stands in for the runner. A token's 'KV' is a hash of the previous position's KV, read
    back through the block table, and of the token; the sampled token comes from the last one.
    A wrong block table, start or prefix hit therefore changes the output."""

    def __init__(self, sched):
        self.kv, self.cache = sched.kv, {}

    def __call__(self, out, in_flight=None):
        """in_flight: the previous step's sampled tokens, which stand for PENDING inputs."""
        sampled, bs = {}, self.kv.block_size
        for s in out.scheduled:
            toks, ids = s.seq.all_token_ids, s.block_ids
            if toks[-1] == PENDING:
                toks[-1] = in_flight[s.seq.seq_id][0]
            assert len(ids) * bs >= s.start + s.num_tokens
            for p in range(s.start, s.start + s.num_tokens):
                assert self.kv.blocks[ids[p // bs]].ref_cnt == 1  # never write a shared block
                prev = self.cache[ids[(p - 1) // bs], (p - 1) % bs] if p else 0
                self.cache[ids[p // bs], p % bs] = hash((prev, toks[p]))
            if s.sample:
                last = s.start + s.num_tokens - 1
                # 1..VOCAB: never EOS, so only explicit scripts stop on it
                sampled[s.seq.seq_id] = [1 + self.cache[ids[last // bs], last % bs] % VOCAB]
        return sampled


def step(sched, model):
    """Step once; returns the schedule and the requests it finished."""
    out = sched.schedule()
    sched.update_from_output(out, model(out))
    return out, [s.seq for s in out.scheduled if s.seq.is_finished]


def scripted(sched, tokens):
    """Step once, sampling tokens[request_id] for every request that samples."""
    out = sched.schedule()
    sched.update_from_output(
        out, {s.seq.seq_id: [tokens[s.seq.seq_id]] for s in out.scheduled
              if s.sample})
    return out, [s.seq for s in out.scheduled if s.seq.is_finished]


def plan(out):
    return [(s.seq.seq_id, s.start, s.num_tokens, s.sample) for s in out.scheduled]


def run_to_end(sched, reqs, max_steps=10_000):
    model = FakeModel(sched)
    for r in reqs:
        sched.add_seq(r)
    for _ in range(max_steps):
        if not sched.has_unfinished_seqs():
            return {r.seq_id: r.output_token_ids for r in reqs}
        out, _ = step(sched, model)
        assert out.total_num_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
    raise AssertionError("requests did not finish")


def test_chunked_prefill_splits_a_long_prompt():
    sched = make(budget=16)
    model = FakeModel(sched)
    sched.add_seq(req("a", range(1, 41), max_tokens=2))
    plans = [plan(step(sched, model)[0]) for _ in range(4)]
    assert plans == [[("a", 0, 16, False)], [("a", 16, 16, False)], [("a", 32, 8, True)],
                     [("a", 40, 1, True)]]
    assert not sched.has_unfinished_seqs()


def test_decodes_and_prefill_chunks_share_a_step():
    sched = make(budget=16)
    model = FakeModel(sched)
    sched.add_seq(req("a", range(1, 5), max_tokens=10))
    assert plan(step(sched, model)[0]) == [("a", 0, 4, True)]
    sched.add_seq(req("b", range(100, 140)))
    assert plan(step(sched, model)[0]) == [("a", 4, 1, True), ("b", 0, 15, False)]
    assert plan(step(sched, model)[0]) == [("a", 5, 1, True), ("b", 15, 15, False)]
    assert plan(step(sched, model)[0]) == [("a", 6, 1, True), ("b", 30, 10, True)]


def test_without_chunked_prefill_prompts_are_scheduled_whole():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(budget=32, max_model_len=48, chunked=False)
    sched = make(budget=48, max_model_len=48, chunked=False)
    model = FakeModel(sched)
    sched.add_seq(req("a", range(1, 11), max_tokens=3))
    sched.add_seq(req("b", range(100, 148), arrival=1))
    sched.add_seq(req("c", range(200, 202), arrival=2))
    assert plan(step(sched, model)[0]) == [("a", 0, 10, True)]  # b (48) does not fit in 38
    assert plan(step(sched, model)[0]) == [("a", 10, 1, True)]  # nor in 47; c waits behind b
    out, finished = step(sched, model)
    assert plan(out) == [("a", 11, 1, True)] and finished[0].seq_id == "a"
    assert plan(step(sched, model)[0]) == [("b", 0, 48, True)]


def test_max_num_seqs():
    sched = make(max_num_seqs=2)
    model = FakeModel(sched)
    for i, n in enumerate([1, 3, 3]):
        sched.add_seq(req(f"r{i}", range(10 * i + 1, 10 * i + 6), arrival=i, max_tokens=n))
    out, finished = step(sched, model)
    assert [s.seq.seq_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.seq_id for r in finished] == ["r0"]  # max_tokens=1
    assert sched.num_running == 1 and sched.num_waiting == 1
    out, _ = step(sched, model)
    assert plan(out) == [("r1", 5, 1, True), ("r2", 0, 5, True)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_by_recompute_gives_the_same_output(policy, caplog):
    def three():
        return [req("b", range(100, 106), arrival=0, priority=1, max_tokens=12),
                req("a", range(200, 207), arrival=1, priority=0, max_tokens=12),
                req("w", range(300, 303), arrival=2, priority=0, max_tokens=12)]

    want = run_to_end(make(), three())
    sched = make(num_blocks=6, max_num_seqs=2, max_model_len=24, policy=policy)
    model = FakeModel(sched)
    b, a, w = three()
    sched.add_seq(b)
    step(sched, model)
    sched.add_seq(a)
    sched.add_seq(w)  # waits: max_num_seqs
    caplog.set_level(logging.WARNING)
    while not sched.num_preemptions:
        before = {r.seq_id: list(r.output_token_ids) for r in (a, b)}
        out, _ = step(sched, model)
    # fcfs evicts the last admitted (a); priority the lowest priority (b, admitted first).
    victim, other = (a, b) if policy == "fcfs" else (b, a)
    assert out.preempted_ids == [victim.seq_id]
    assert victim.status == SequenceStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.num_computed_tokens == 0
    assert victim.output_token_ids == before[victim.seq_id] != []  # outputs kept
    assert "preempted" in caplog.text and victim.seq_id in caplog.text
    # Nobody is admitted in a step that preempted, though w would fit now.
    assert plan(out) == [(other.seq_id, other.num_computed_tokens - 1, 1, True)]
    # fcfs: the victim goes back ahead of w; priority: by (priority, arrival), so after w.
    queue = [r.seq_id for _, r in sorted(sched.waiting, key=lambda x: x[0])]
    assert queue == (["a", "w"] if policy == "fcfs" else ["w", "b"])
    out, _ = step(sched, model)
    assert ("w" in [s.seq.seq_id for s in out.scheduled]) == (policy == "priority")
    while sched.has_unfinished_seqs():
        step(sched, model)
    assert {r.seq_id: r.output_token_ids for r in (a, b, w)} == want
    assert sched.kv.num_free_blocks == 6


def test_priority_preemption_unschedules_a_victim_already_in_the_step():
    sched = make(num_blocks=9, budget=3, max_model_len=36, policy="priority")
    model = FakeModel(sched)
    b = req("b", range(100, 103), arrival=0, priority=1, max_tokens=30)
    sched.add_seq(b)
    step(sched, model)
    sched.add_seq(req("a", range(200, 204), arrival=1, max_tokens=30))
    sched.add_seq(req("c", range(300, 310), arrival=2, max_tokens=30))
    while not sched.num_preemptions:
        out, _ = step(sched, model)
    # b went first (admitted first) but is evicted when a needs a block; its token goes back to
    # the budget, and c's prefill chunk uses it.
    assert out.preempted_ids == ["b"] and b.num_computed_tokens == 0
    assert plan(out) == [("a", 12, 1, True), ("c", 8, 2, True)]


def test_priority_orders_the_waiting_queue():
    sched = make(max_num_seqs=1, policy="priority")
    model = FakeModel(sched)
    for rid, arrival, prio in [("low", 0, 5), ("high2", 2, 0), ("high1", 1, 0), ("mid", 3, 1)]:
        sched.add_seq(req(rid, range(1, 4), arrival=arrival, priority=prio, max_tokens=1))
    order = [step(sched, model)[1][0].seq_id for _ in range(4)]
    assert order == ["high1", "high2", "mid", "low"]
    fcfs = make(max_num_seqs=1)
    for rid, arrival, prio in [("low", 0, 5), ("high", 1, 0)]:
        fcfs.add_seq(req(rid, range(1, 4), arrival=arrival, priority=prio, max_tokens=1))
    assert step(fcfs, FakeModel(fcfs))[1][0].seq_id == "low"


def test_abort_frees_blocks_at_once():
    sched = make(num_blocks=16, max_model_len=64)
    model = FakeModel(sched)
    a, b, c = req("a", range(1, 20)), req("b", range(30, 40)), req("c", range(50, 60))
    for r in (a, b, c):
        sched.add_seq(r)
    out = sched.schedule()
    model(out)
    assert sched.kv.num_free_blocks == 16 - 5 - 3 - 3
    sched.abort_seqs(["a", "unknown"])  # between schedule() and update_from_output()
    assert a.status == SequenceStatus.FINISHED_ABORTED and a.status.finish_reason == "abort"
    assert sched.kv.num_free_blocks == 16 - 6 and sched.num_running == 2
    kept = sched.update_from_output(out, {"b": [7], "c": [7]})
    assert kept == {"b": 1, "c": 1} and a.output_token_ids == [] and b.output_token_ids == [7]
    sched.add_seq(req("d", range(1, 5)))
    sched.abort_seqs(["d"])  # still waiting
    assert sched.num_waiting == 0
    sched.finish_seqs(["b"], SequenceStatus.FINISHED_STOPPED)  # a stop string
    assert b.status.finish_reason == "stop" and sched.num_running == 1
    sched.abort_seqs(["c"])
    assert not sched.has_unfinished_seqs() and sched.kv.num_free_blocks == 16
    assert sched.schedule().scheduled == []


def test_eos_and_stop_token_ids_wait_for_min_tokens():
    sched = make()
    r = req("r", range(1, 5), ignore_eos=False, min_tokens=3, stop_token_ids=[9])
    sched.add_seq(r)
    for tok in (EOS, 9):
        assert scripted(sched, {"r": tok})[1] == []
    assert scripted(sched, {"r": EOS})[1] == [r]
    assert r.status == SequenceStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.output_token_ids == [EOS, 9, EOS] and sched.kv.num_free_blocks == 64


def test_stop_token_id_sets_stop_reason_and_multiple_eos_ids():
    sched = make()
    r = req("r", range(1, 5), ignore_eos=False, stop_token_ids=[9, 11])
    s = Sequence("s", [1, 2], SamplingParams(), eos_token_ids=frozenset({5, 6}))
    sched.add_seq(r)
    sched.add_seq(s)
    assert scripted(sched, {"r": 3, "s": 4})[1] == []
    assert scripted(sched, {"r": 11, "s": 6})[1] == [r, s]
    assert r.stop_reason == 11 and r.status.finish_reason == "stop"
    assert s.stop_reason is None and s.status.finish_reason == "stop"


def test_ignore_eos_and_max_tokens():
    sched = make()
    r = req("r", range(1, 5), ignore_eos=True, max_tokens=3)
    sched.add_seq(r)
    assert scripted(sched, {"r": EOS})[1] == [] and scripted(sched, {"r": EOS})[1] == []
    assert scripted(sched, {"r": EOS})[1] == [r]
    assert r.status == SequenceStatus.FINISHED_LENGTH and r.output_token_ids == [EOS] * 3


def test_max_model_len_stops():
    sched = make(max_model_len=12)
    r = req("r", range(1, 11), max_tokens=None)
    sched.add_seq(r)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_seq(req("long", range(1, 14)))
    assert scripted(sched, {"r": 3})[1] == []
    assert scripted(sched, {"r": 3})[1] == [r]
    assert r.status == SequenceStatus.FINISHED_LENGTH and r.num_tokens == 12


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefix_schedules_only_uncached_tokens(prefix_caching):
    sched = make(block_size=16, budget=128, prefix_caching=prefix_caching)
    model = FakeModel(sched)
    shared = list(range(1, 33))
    a = req("a", shared + [40] * 8, max_tokens=3)
    sched.add_seq(a)
    step(sched, model)
    b = req("b", shared + [41] * 10)
    c = req("c", shared)  # all cached: the last token is still computed
    sched.add_seq(b)
    sched.add_seq(c)
    out, _ = step(sched, model)
    if prefix_caching:
        assert plan(out) == [("a", 40, 1, True), ("b", 32, 10, True), ("c", 16, 16, True)]
        assert (b.num_cached_tokens, c.num_cached_tokens) == (32, 16)
        ids = sched.kv.get_block_ids
        assert ids("b")[:2] == ids("a")[:2] and ids("c")[:1] == ids("a")[:1]
    else:
        assert plan(out) == [("a", 40, 1, True), ("b", 0, 42, True), ("c", 0, 32, True)]
        assert b.num_cached_tokens == 0


@pytest.mark.parametrize("policy,chunked,seed", [("fcfs", True, 0), ("fcfs", False, 1),
                                                 ("priority", True, 2), ("priority", False, 3)])
def test_tight_memory_and_budget_give_the_same_outputs(policy, chunked, seed):
    """Many requests with shared prefixes on a cache that forces preemptions: outputs equal a
    roomy run without prefix caching, nothing leaks, limits hold every step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(3)]

    def workload():
        rng2 = random.Random(seed)
        return [req(f"r{i}", rng2.choice(prefixes) + [rng2.randrange(1, VOCAB)
                                                      for _ in range(rng2.randrange(1, 12))],
                    arrival=i, priority=rng2.randrange(3), max_tokens=rng2.randrange(1, 30),
                    ignore_eos=False, stop_token_ids=[7])
                for i in range(24)]

    want = run_to_end(make(num_blocks=400, max_num_seqs=32, budget=512, max_model_len=64,
                           prefix_caching=False), workload())
    tight = make(num_blocks=18, max_num_seqs=6, budget=64 if not chunked else 13,
                 max_model_len=64, chunked=chunked, policy=policy)
    assert run_to_end(tight, workload()) == want
    assert tight.num_preemptions > 0 and tight.kv.prefix_cache_hits > 0
    assert tight.kv.num_free_blocks == 18
    assert not tight.kv.tracked_seq_ids  # no per-sequence state left


def run_to_end_async(sched, reqs, max_steps=10_000):
    """As the engine with async scheduling: step N+1 is scheduled and run (its PENDING inputs
    taken from step N's tokens, as the device does) before step N's tokens are read."""
    model = FakeModel(sched)
    for r in reqs:
        sched.add_seq(r)
    prev = None
    for _ in range(max_steps):
        if not sched.has_unfinished_seqs() and prev is None:
            return {r.seq_id: r.output_token_ids for r in reqs}
        out = sched.schedule()
        tokens = model(out, prev[1] if prev else None) if out.scheduled else None
        if prev is not None:
            sched.resolve(*prev)
        prev = None
        if out.scheduled:
            sched.advance(out)
            prev = (out, tokens)
        assert out.total_num_tokens <= sched.max_num_batched_tokens
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("policy,chunked,seed", [("fcfs", True, 4), ("priority", False, 5)])
def test_async_scheduling_gives_the_same_outputs(policy, chunked, seed):
    """One step of lookahead (placeholders, length stops at dispatch, token stops a step later,
    preemption of a request whose token is in flight) changes no output and leaks nothing."""
    def workload():
        rng = random.Random(seed)
        return [req(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))],
                    arrival=i, priority=i % 3, max_tokens=rng.randrange(1, 30),
                    ignore_eos=False, stop_token_ids=[7], min_tokens=rng.randrange(3))
                for i in range(24)]

    want = run_to_end(make(num_blocks=400, max_num_seqs=32, budget=512, max_model_len=64),
                      workload())
    tight = make(num_blocks=18, max_num_seqs=6, budget=64 if not chunked else 13,
                 max_model_len=64, chunked=chunked, policy=policy)
    got = run_to_end_async(tight, workload())
    assert got == want
    assert any(t[-1] == 7 for t in want.values())  # token stops happened
    assert tight.num_preemptions > 0 and tight.kv.num_free_blocks == 18


def test_async_token_stop_drops_the_token_in_flight():
    sched = make()
    a = req("a", range(1, 5), max_tokens=10, stop_token_ids=[9])
    sched.add_seq(a)
    out1 = sched.schedule()
    sched.advance(out1)
    assert a.output_token_ids == [-1] and a.has_pending
    out2 = sched.schedule()  # scheduled on the placeholder
    assert plan(out2) == [("a", 4, 1, True)]
    sched.advance(out2)
    assert a.output_token_ids == [-1, -1]
    assert sched.resolve(out1, {"a": [9]}) == {"a": 1}  # a stop token: step 2 is void
    assert a.output_token_ids == [9] and a.status.finish_reason == "stop"
    assert sched.resolve(out2, {"a": [3]}) == {} and a.output_token_ids == [9]
    assert sched.kv.num_free_blocks == 64 and not sched.has_unfinished_seqs()


def test_pipeline_depth_schedules_disjoint_sequences_in_flight():
    """With pipeline_depth 2 (pipeline parallelism, 2 steps in flight), a step takes at most
    half the sequences and leaves out those whose token is still in flight; once the tokens
    are back they run again."""
    s = make()
    s.pipeline_depth = 2
    for i in range(4):
        s.add_seq(req(f"r{i}", [1, 2, 3], max_tokens=5))
    first = s.schedule()
    s.advance(first)
    second = s.schedule()
    s.advance(second)
    ids = lambda out: {it.seq.seq_id for it in out.scheduled}  # noqa: E731
    assert ids(first) == {"r0", "r1"} and ids(second) == {"r2", "r3"}
    assert not s.schedule().scheduled  # every token is in flight
    s.resolve(first, {"r0": [7], "r1": [8]})
    third = s.schedule()
    assert ids(third) == {"r0", "r1"}
    assert [it.seq.all_token_ids[-1] for it in third.scheduled] == [7, 8]
