"""The engine's side of speculative decoding without a model: who gets drafts and how many,
the rest after rejected drafts, the KV blocks drafts may take, when steps may overlap, and
--speculative-config refused by name where it cannot be honoured."""

import pytest

from jaxllm import SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.sequence import Sequence, SequenceStatus
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.speculator import Speculator
from test_spec_engine import NGRAM


def seq(seq_id, tokens, out=(), **sp):
    s = Sequence(seq_id, list(tokens), SamplingParams(**sp), status=SequenceStatus.RUNNING)
    s.output_token_ids = list(out)
    s.num_computed_tokens = s.num_tokens - 1
    return s


def test_speculator_limits_and_switch_off():
    cfg = SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 3})
    sp = Speculator(cfg, max_model_len=64)
    rep = [1, 2, 3, 4] * 4
    a, b = seq("a", rep, max_tokens=100), seq("b", rep, out=[1], max_tokens=3)
    c = seq("c", [9, 8, 7, 6])  # nothing to look up
    assert sp.propose([a, b, c]) == {}  # 3 running >= disable_by_batch_size
    assert sp.propose([a, b]) == {"a": [1, 2, 3], "b": [2]}  # b: 1 out + 1 draft + 1 = 3
    assert sp.propose([a, c]) == {"a": [1, 2, 3]}
    long = seq("l", (rep * 4)[:62])  # 62 tokens of max_model_len 64
    assert sp.propose([long]) == {"l": [3]}  # 62 + 1 draft + 1 = 64
    g = seq("g", rep)
    g.grammar = object()  # a grammar's mask would need the drafts fed to its matcher
    pending = seq("p", rep, out=[-1])
    prefill = seq("f", rep)
    prefill.num_computed_tokens = 0
    assert sp.propose([g, pending, prefill]) == {}


def test_drafts_take_only_free_blocks():
    from jaxllm.engine.kv_cache_manager import KVCacheManager
    from jaxllm.engine.scheduler import Scheduler

    sched = Scheduler(KVCacheManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=16, block_size=4)
    a, b = (Sequence(i, [1, 2, 3], SamplingParams(max_tokens=10)) for i in "ab")
    for x in (a, b):
        sched.add_seq(x)
    sched.update_from_output(sched.schedule(), {"a": [7], "b": [8]})  # a block each
    out = sched.schedule({"a": [1, 2, 3, 4, 5, 6], "b": [1, 2]})
    # a's drafts take the two free blocks; b's would need a third: b decodes alone.
    assert [(s.seq.seq_id, s.num_tokens, s.spec_token_ids) for s in out.scheduled] == \
        [("a", 7, [1, 2, 3, 4, 5, 6]), ("b", 1, [])]
    assert out.preempted_ids == [] and sched.kv.num_free_blocks == 0
    sched.update_from_output(out, {"a": [1, 2, 9], "b": [5]})  # a: 2 drafts accepted
    assert a.output_token_ids == [7, 1, 2, 9] and a.num_computed_tokens == 6
    assert b.output_token_ids == [8, 5] and b.num_computed_tokens == 4


def test_rejected_drafts_back_off():
    from jaxllm.sequence import ScheduledSequence, SchedulerOutput

    sp = Speculator(SpeculativeConfig.parse(NGRAM), max_model_len=64)
    a = seq("a", [1, 2, 3, 4] * 4, max_tokens=100)

    def step(accepted: int) -> bool:
        d = sp.propose([a]).get("a")
        if d:
            item = ScheduledSequence(a, 15, 1 + len(d), [], True, spec_token_ids=d)
            sp.record(SchedulerOutput([item]), {"a": [0] * (accepted + 1)})
        return bool(d)

    # Rests of 1, 2, 4, 8 steps after each rejected proposal; an acceptance ends them.
    assert [step(0) for _ in range(12)] == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    assert [step(1) for _ in range(9)] == [0] * 7 + [1, 1]
    assert sp.num_drafts == 6 and sp.num_accepted_tokens == 2


def test_new_requests_start_from_the_engines_rest():
    """Where no request's drafts are accepted, a new request's first rejection rests as long
    as the last rejection did (it does not climb 1, 2, 4, ... again); an accepted draft, any
    request's, resets that."""
    from jaxllm.sequence import ScheduledSequence, SchedulerOutput

    sp = Speculator(SpeculativeConfig.parse(NGRAM), max_model_len=256)

    def step(s, accepted: int) -> bool:
        d = sp.propose([s]).get(s.seq_id)
        if d:
            item = ScheduledSequence(s, 15, 1 + len(d), [], True, spec_token_ids=d)
            sp.record(SchedulerOutput([item]), {s.seq_id: [0] * (accepted + 1)})
        return bool(d)

    a = seq("a", [1, 2, 3, 4] * 4, max_tokens=200)
    assert sum(step(a, 0) for _ in range(15)) == 4  # rests 1, 2, 4, then 8 (from step 15)
    sp.free("a")
    b = seq("b", [1, 2, 3, 4] * 4, max_tokens=200)
    # b probes at once, then rests 8 (a's last rest) and 16
    assert [step(b, 0) for _ in range(11)] == [1] + [0] * 8 + [1, 0]
    assert [step(b, 1) for _ in range(16)] == [0] * 15 + [1]  # accepted: the rests end
    assert step(b, 0)
    sp.free("b")
    c = seq("c", [1, 2, 3, 4] * 4, max_tokens=200)
    assert [step(c, 0) for _ in range(3)] == [1, 0, 1]  # after an acceptance: rest 1 again


def test_verify_steps_have_buckets_of_their_own():
    """b requests with k drafts each are b (1 + k) tokens: below the smallest token bucket
    they get programs of their own (one request with 4 drafts runs 5 rows, not 16)."""
    from jaxllm.worker.input_batch import InputBatcher, bucket

    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, max_model_len=1024,
              enforce_eager=False)
    for decode_programs in (False, True):
        ib = InputBatcher(**kw, decode_programs=decode_programs, num_rows=20,
                          num_speculative_tokens=4)
        assert ib.spec_buckets == [5, 10]
        assert [bucket(n, ib.mixed_buckets) for n in (5, 6, 10, 11)] == [5, 10, 10, 16]
        assert {(5, False), (10, False)} <= set(ib.forward_shapes())
    assert InputBatcher(**kw, decode_programs=False).spec_buckets == []


def test_steps_overlap_unless_someone_may_get_drafts():
    """wants_tokens (read the step in flight before this one?) is True only for a request
    whose last token is in flight and that may get drafts after it: not while it rests, nor
    when lookup cannot match, nor when speculation is disabled by batch size."""
    from jaxllm.sequence import ScheduledSequence, SchedulerOutput

    sp = Speculator(SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 2,
                                             "disable_by_batch_size": 3}), max_model_len=64)
    novel = seq("n", [9, 8, 7, 6], out=[-1])  # 6 never occurred before: no match possible
    rep = seq("r", [1, 2, 3, 4] * 4, out=[-1])
    assert not sp.wants_tokens([novel])
    assert sp.wants_tokens([novel, rep])
    assert not sp.wants_tokens([novel, rep, seq("x", [5, 6])])  # disabled by batch size
    assert not sp.wants_tokens([seq("k", [1, 2, 3, 4] * 4)])  # nothing in flight to wait for
    known = seq("r", [1, 2, 3, 4] * 4)  # r's last step: drafts, all rejected -> rests 1 step
    d = sp.propose([known])["r"]
    sp.record(SchedulerOutput([ScheduledSequence(known, 15, 1 + len(d), [], True,
                                                 spec_token_ids=d)]), {"r": [0]})
    assert not sp.wants_tokens([rep])
    assert sp.propose([rep]) == {}  # the rest counts down even while its token is in flight
    assert sp.wants_tokens([rep])


@pytest.mark.parametrize("value, match", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "foo"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config_is_refused_by_name(value, match):
    with pytest.raises(ConfigError, match=f"--speculative-config.*{match}"):
        EngineArgs(speculative_config=value)


def test_speculative_config_flag_and_combinations():
    from serving.cli.serve import parse_args

    args = EngineArgs.from_cli_args(parse_args(["m", "-sc", '{"model": "ngram", '
                                                '"num_speculative_tokens": 2}']))
    assert args.speculative_config == SpeculativeConfig("ngram", 2, prompt_lookup_max=5,
                                                        prompt_lookup_min=5)
    with pytest.raises(ConfigError, match="--speculative-config.*--num-scheduler-steps"):
        EngineArgs(speculative_config=NGRAM, num_scheduler_steps=4)
    from jaxllm.spec_decode.proposer import make_proposer
    with pytest.raises(ConfigError, match="--speculative-config.*draft_model"):
        make_proposer(SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}))
