"""The hybrid models' state slots in the KV cache manager: a sequence takes one with its first
blocks and gives it back when freed; with none free, admission fails and changes nothing."""

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.state_slots import StateSlots
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import Sequence


def _seq(rid: str, n: int = 6) -> Sequence:
    return Sequence(rid, list(range(3, 3 + n)), SamplingParams())


def test_slots_follow_the_sequences_blocks():
    slots = StateSlots(2)
    kv = KVCacheManager(16, 4, enable_prefix_caching=False, state_slots=slots)
    a, b, c = _seq("a"), _seq("b"), _seq("c")
    assert kv.allocate_slots(a, 6) and kv.allocate_slots(b, 6)
    sa, sb = kv.state_slot("a"), kv.state_slot("b")
    assert {sa, sb} == {0, 1}
    assert kv.allocate_slots(a, 1) and kv.state_slot("a") == sa  # a later step: same slot
    free_blocks = kv.num_free_blocks
    assert not kv.allocate_slots(c, 6)  # blocks enough, no slot: refused, nothing taken
    assert kv.num_free_blocks == free_blocks and kv.state_slot("c") == -1
    kv.free(b)  # finished or preempted alike
    assert kv.state_slot("b") == -1 and slots.num_free == 1
    assert kv.allocate_slots(c, 6) and kv.state_slot("c") == sb  # b's slot reused
    kv.free(a)
    kv.free(a)  # twice is safe
    kv.free(c)
    assert slots.num_free == 2 and slots.holders() == frozenset()


def test_without_state_slots_nothing_changes():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    assert kv.allocate_slots(_seq("a"), 6) and kv.state_slot("a") == -1
