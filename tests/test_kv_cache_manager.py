"""KVCacheManager: block accounting, prefix-cache hits, chain breaks, LRU eviction, collisions,
and a hypothesis state machine that checks accounting and cached-KV correctness throughout."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.kv_offload import HostBlock, HostTier
from jaxllm.sequence import Sequence, SequenceStatus
from jaxllm.sampling_params import SamplingParams

ALGOS = ["builtin", "sha256"]


def req(rid, prompt, outputs=()):
    return Sequence(rid, list(prompt), SamplingParams(), output_token_ids=list(outputs))


def run(kv, r, num_tokens=None):
    """Admit r with its prefix hit, then 'compute' num_tokens (default: all) as one step."""
    blocks, cached = kv.get_computed_blocks(r)
    n = (r.num_tokens if num_tokens is None else num_tokens) - cached
    assert kv.allocate_slots(r, n, blocks)
    r.num_computed_tokens = cached + n
    kv.cache_blocks(r)
    return blocks, cached


@pytest.mark.parametrize("algo", ALGOS)
def test_allocate_and_free(algo):
    kv = KVCacheManager(10, 16, hash_algo=algo)
    a = req("a", range(35))
    assert kv.allocate_slots(a, 35)
    ids = list(kv.get_block_ids("a"))  # a copy: the manager's list grows in place
    assert len(ids) == 3 and len(set(ids)) == 3
    assert kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    a.num_computed_tokens = 35
    assert kv.allocate_slots(a, 1)          # token 36 still fits in block 3
    assert kv.allocate_slots(a, 14)         # 49 tokens: a 4th block
    assert len(kv.get_block_ids("a")) == 4 and kv.get_block_ids("a")[:3] == ids
    kv.free(a)
    kv.free(a)  # a second free is a no-op, not a double free
    assert kv.num_free_blocks == 10 and kv.usage == 0.0 and kv.get_block_ids("a") == []


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    a, b = req("a", range(12)), req("b", range(8))
    assert kv.allocate_slots(a, 12)
    assert not kv.allocate_slots(b, 8)      # needs 2, only 1 left
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []
    assert kv.allocate_slots(b, 4)
    assert kv.num_free_blocks == 0


def test_hit_blocks_are_not_counted_as_free_for_the_same_allocation():
    kv = KVCacheManager(2, 4)
    a = req("a", range(5))
    run(kv, a)
    kv.free(a)                                # block 0 cached-evictable, block 1 free
    assert kv.allocate_slots(req("c", range(50, 54)), 4)
    b = req("b", range(6))
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 4 and kv.num_free_blocks == 1
    assert not kv.allocate_slots(b, 2, blocks)  # the one evictable block is the hit itself
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []


def test_prefix_computed_twice_at_once_still_caches_the_longer_chain():
    kv = KVCacheManager(10, 4)
    x, y = req("x", range(5)), req("y", range(9))
    assert kv.allocate_slots(x, 5) and kv.allocate_slots(y, 9)  # neither hits the other
    x.num_computed_tokens, y.num_computed_tokens = 5, 9
    kv.cache_blocks(x)
    kv.cache_blocks(y)                        # y's first block duplicates x's
    blocks, cached = kv.get_computed_blocks(req("z", range(10)))
    assert cached == 8
    assert blocks == [kv.get_block_ids("x")[0], kv.get_block_ids("y")[1]]


@pytest.mark.parametrize("algo", ALGOS)
def test_shared_prefix_hits_same_blocks(algo):
    kv = KVCacheManager(20, 16, hash_algo=algo)
    a = req("a", range(40))
    run(kv, a)
    b = req("b", list(range(32)) + [7, 7, 7])
    blocks, cached = kv.get_computed_blocks(b)
    assert blocks == kv.get_block_ids("a")[:2] and cached == 32
    assert kv.allocate_slots(b, b.num_tokens - cached, blocks)
    assert kv.get_block_ids("b")[:2] == blocks and kv.get_block_ids("b")[2] not in blocks
    assert [kv.blocks[i].ref_cnt for i in blocks] == [2, 2]
    kv.free(a)
    assert [kv.blocks[i].ref_cnt for i in blocks] == [1, 1]
    assert kv.prefix_cache_queries == 40 + 35 and kv.prefix_cache_hits == 32


@pytest.mark.parametrize("algo", ALGOS)
def test_differing_token_breaks_chain_at_its_block(algo):
    kv = KVCacheManager(20, 16, hash_algo=algo)
    prompt = list(range(100, 150))
    run(kv, req("a", prompt))
    a_ids = kv.get_block_ids("a")
    for pos, want in [(0, 0), (15, 0), (16, 1), (31, 1), (32, 2), (47, 2)]:
        p = list(prompt)
        p[pos] = 0
        assert kv.get_computed_blocks(req(f"x{pos}", p)) == (a_ids[:want], 16 * want), pos
    # Same second block after a different first block: the chain, not the block, must match.
    assert kv.get_computed_blocks(req("y", [0] * 16 + prompt[16:])) == ([], 0)


def test_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(10, 16)
    run(kv, req("a", range(32)))
    assert kv.get_computed_blocks(req("b", range(32)))[1] == 16   # not 32
    assert kv.get_computed_blocks(req("c", range(33)))[1] == 32
    # Output tokens count as known tokens (a preempted request resumes from them).
    assert kv.get_computed_blocks(req("d", range(20), outputs=range(20, 33)))[1] == 32


def test_blocks_are_cached_only_once_computed():
    kv = KVCacheManager(10, 16)
    a = req("a", range(40))
    assert kv.allocate_slots(a, 40)           # scheduled, but the step has not run
    assert kv.get_computed_blocks(req("b", range(40))) == ([], 0)
    a.num_computed_tokens = 20                # a first chunk ran: block 0 is full
    kv.cache_blocks(a)
    assert kv.get_computed_blocks(req("b", range(40))) == (kv.get_block_ids("a")[:1], 16)
    a.num_computed_tokens = 40
    kv.cache_blocks(a)
    assert kv.get_computed_blocks(req("b", range(40)))[1] == 32


def test_lru_eviction_order_and_free_pool_first():
    kv = KVCacheManager(6, 4)
    a, b = req("a", range(8)), req("b", range(50, 58))
    run(kv, a)
    run(kv, b)
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 6
    # Two never-cached blocks are used before any cached one is evicted.
    c = req("c", range(90, 98))
    assert kv.allocate_slots(c, 8)
    assert kv.get_computed_blocks(req("a2", range(9)))[0] == a_ids
    assert kv.get_computed_blocks(req("b2", range(50, 59)))[0] == b_ids
    # Then least recently released first; within a request the tail goes before its prefix.
    d = req("d", range(200, 204))
    assert kv.allocate_slots(d, 4) and kv.get_block_ids("d") == [a_ids[1]]
    assert kv.get_computed_blocks(req("a2", range(9)))[0] == a_ids[:1]
    # A hit makes a block recently used again: a's first block, released before b's blocks,
    # now outlives them (a3's second block evicts b's tail; e takes it back and b's head).
    a3 = req("a3", range(5))
    run(kv, a3)
    kv.free(a3)
    e = req("e", range(300, 308))
    assert kv.allocate_slots(e, 8) and sorted(kv.get_block_ids("e")) == sorted(b_ids)
    assert kv.get_computed_blocks(req("b2", range(50, 59))) == ([], 0)
    assert kv.get_computed_blocks(req("a2", range(9)))[0] == a_ids[:1]
    assert not kv.allocate_slots(req("f", range(8)), 8)  # only a's first block is left


def test_collisions_never_give_wrong_blocks():
    kv = KVCacheManager(8, 4, hash_fn=lambda parent, tokens: 0)  # every block collides
    run(kv, req("a", range(9)))
    assert kv.get_computed_blocks(req("b", [9, 1, 2, 3, 4, 5, 6, 7, 8])) == ([], 0)
    assert kv.get_computed_blocks(req("c", range(9)))[1] == 4  # only one entry can be cached


def test_collision_through_a_chain_is_caught():
    """Hash ignores a block's first token. A cached child whose parent was evicted must not be
    reached through a different, colliding parent, although hash, tokens and parent hash match."""
    kv = KVCacheManager(5, 4, hash_fn=lambda parent, tokens: hash((parent, tokens[1:])))
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    X, Y = req("X", x + [99]), req("Y", x + y + [98])
    assert kv.allocate_slots(X, 5) and kv.allocate_slots(Y, 9)  # computed side by side
    X.num_computed_tokens, Y.num_computed_tokens = 5, 9
    kv.cache_blocks(X)                        # X's block caches x
    kv.cache_blocks(Y)                        # Y's x is a duplicate; Y's y is cached under it
    kv.free(X)
    z = req("Z", range(8))
    assert kv.allocate_slots(z, 8)            # evicts X's cached x block; Y's y survives
    kv.free(z)
    kv.free(Y)
    x2 = [0, 2, 3, 4]                         # collides with x
    run(kv, req("R", x2 + [96]))
    assert kv.get_computed_blocks(req("Q", x2 + y + [97]))[1] == 4   # not 8
    assert kv.get_computed_blocks(req("Q2", x + y + [97])) == ([], 0)  # x itself was evicted


def test_reset_prefix_cache():
    kv = KVCacheManager(8, 4)
    a = req("a", range(9))
    run(kv, a)
    assert not kv.reset_prefix_cache()        # refused while blocks are held
    kv.free(a)
    assert kv.get_computed_blocks(req("b", range(9)))[1] == 8
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert kv.num_free_blocks == 8


def test_disabled_prefix_caching():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    run(kv, req("a", range(9)))
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert kv.prefix_cache_queries == 0


# --- property test ---------------------------------------------------------------------------
BS = 4
# Shared prefixes; under the "weak" hash [4, 3, 2, 1] collides with [1, 2, 3, 4].
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0, 0, 0], [4, 3, 2, 1, 5, 6, 7, 8],
            [2, 2, 2, 2]]
MAX_TOKENS = 24
# Hashes that only verification makes safe: equal blocks after different prefixes collide, and
# with "weak" so do many different blocks.
WEAK = {"parentless": lambda parent, tokens: hash(tokens),
        "weak": lambda parent, tokens: sum(tokens) % 5}


class KVMachine(RuleBasedStateMachine):
    """Random add/admit/step/finish/preempt/reset. A fake KV cache stores, for each written
    slot, the token prefix it was computed from, so a wrong prefix hit is caught at once.
    With a host tier (--kv-offloading-size), the fake cache also moves slots to and from
    saved copies as each plan's transfers say."""

    @initialize(num_blocks=st.integers(6, 16), algo=st.sampled_from(ALGOS + list(WEAK)),
                host=st.sampled_from([0, 2, 8]))
    def setup(self, num_blocks, algo, host):
        num_blocks = 6 if host else num_blocks  # a small cache evicts, so the tier is used
        self.kv = KVCacheManager(num_blocks, BS, hash_algo="builtin" if algo in WEAK else algo,
                                 hash_fn=WEAK.get(algo), host_tier=HostTier(host) if host else None)
        self.waiting, self.running = {}, {}
        self.slots = {}  # (block, offset) -> token prefix whose KV the slot holds
        self.saved = {}  # host tier: key -> the slots of a saved block
        self.count = 0

    def transfer(self):
        t = self.kv.take_transfers()
        for bid, key in t.saves:
            self.saved[key] = [self.slots.get((bid, o)) for o in range(BS)]
        for key in t.drops:
            self.saved.pop(key, None)
        for key, bid in t.loads:
            for o, held in enumerate(self.saved.pop(key)):
                self.slots[bid, o] = held

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 1), max_size=6))
    def add(self, prefix, tail):
        self.count += 1
        r = req(f"r{self.count}", prefix + tail)
        self.waiting[r.seq_id] = r

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        r = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        free_before = self.kv.num_free_blocks
        blocks, cached = self.kv.get_computed_blocks(r)
        assert cached == len(blocks) * BS < r.num_tokens
        toks = r.all_token_ids
        for p in range(cached):  # the hit holds exactly this request's prefix
            b = blocks[p // BS]
            held = (self.saved[b.uid][p % BS] if isinstance(b, HostBlock)
                    else self.slots[b, p % BS])
            assert held == tuple(toks[:p + 1])
        n = data.draw(st.integers(1, r.num_tokens - cached))
        ok = self.kv.allocate_slots(r, n, blocks)
        self.transfer()
        if ok:
            del self.waiting[r.seq_id]
            self.running[r.seq_id] = r
            r.num_computed_tokens = cached
            self.compute(r, n)
        else:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_ids(r.seq_id) == []

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        r = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        free_before = self.kv.num_free_blocks
        ok = self.kv.allocate_slots(r, n)
        self.transfer()
        if ok:
            self.compute(r, n)
        else:
            assert self.kv.num_free_blocks == free_before

    def compute(self, r, n):
        """What the model step does: write the KV of n tokens, then cache the full blocks."""
        ids, toks = self.kv.get_block_ids(r.seq_id), r.all_token_ids
        assert len(ids) * BS >= r.num_computed_tokens + n
        for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
            assert self.kv.blocks[ids[p // BS]].ref_cnt == 1  # never write a shared block
            self.slots[ids[p // BS], p % BS] = tuple(toks[:p + 1])
        r.num_computed_tokens += n
        self.kv.cache_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= MAX_TOKENS:
                self.finish(r)
            else:
                r.output_token_ids.append(r.num_tokens % 2)

    def finish(self, r):
        self.running.pop(r.seq_id, None)
        self.waiting.pop(r.seq_id, None)
        r.status = SequenceStatus.FINISHED_ABORTED
        self.kv.free(r)

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting) + sorted(self.running)))
        self.finish(self.waiting.get(rid) or self.running[rid])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        r = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(r)
        r.num_computed_tokens = 0
        self.waiting[r.seq_id] = r

    @rule()
    def reset(self):
        assert self.kv.reset_prefix_cache() == (not self.running)
        self.transfer()

    @invariant()
    def blocks_accounted(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        refs = [0] * kv.num_blocks
        for r in self.running.values():
            ids = kv.get_block_ids(r.seq_id)
            assert len(set(ids)) == len(ids)
            assert len(ids) * BS >= r.num_computed_tokens
            for i in ids:
                refs[i] += 1
        assert [b.ref_cnt for b in kv.blocks] == refs
        free, evictable = list(kv.free_block_ids), list(kv.evictable_block_ids)
        in_use = [i for i in range(kv.num_blocks) if refs[i]]
        assert sorted(free + evictable + in_use) == list(range(kv.num_blocks))  # no leak or dup
        assert all(kv.blocks[i].hash is None for i in free)
        assert all(kv.blocks[i].hash is not None for i in evictable)
        cached = [b for b in kv.blocks if b.hash is not None]
        index = kv.cached_blocks
        assert sorted(b.block_id for b in index.values()) == sorted(b.block_id for b in cached)
        for b in cached:  # a cached block is full of the KV of its tokens
            assert index[b.hash] is b
            assert self.slots[b.block_id, BS - 1][-BS:] == b.token_ids
        assert kv.tracked_seq_ids <= set(self.waiting) | set(self.running)  # no per-sequence leak
        if not self.running:
            assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
        if kv.host_tier is not None:  # every saved copy is the tier's, and no other
            assert len(self.saved) == len(kv.host_tier) <= kv.host_tier.capacity_blocks


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
