"""The n-gram prompt-lookup proposer (jaxllm/spec_decode/ngram.py) against a plain-Python
oracle of vLLM's rule, on hand-made cases and random batches, plus its cost."""

import time

import numpy as np
import pytest

from jaxllm.spec_decode.ngram import propose


def oracle(h, k, lo, hi):
    """Longest n in [lo, hi] whose last-n suffix occurs earlier (ending before the last
    token); the most recent such occurrence; the up to k tokens after it."""
    for n in range(hi, lo - 1, -1):
        if n > len(h) - 1:
            continue
        suffix = h[-n:]
        for end in range(len(h) - 2, n - 2, -1):
            if h[end - n + 1:end + 1] == suffix:
                return h[end + 1:end + 1 + k]
    return []


def run(histories, k, lo, hi, limit=None):
    L = max(len(h) for h in histories) + 3  # padding past each length must be ignored
    tokens = np.full((len(histories), L), 7, np.int32)
    for r, h in enumerate(histories):
        tokens[r, :len(h)] = h
    drafts, counts = propose(tokens, [len(h) for h in histories], k, lo, hi, limit)
    assert ((drafts == -1) == (np.arange(k)[None] >= counts[:, None])).all()
    return [list(drafts[r, :counts[r]]) for r in range(len(histories))]


def test_hand_cases():
    assert run([[1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3]], 3, 1, 3) == [[9, 9, 1]]  # most recent
    assert run([[5, 6, 7, 8]], 3, 1, 3) == [[]]                                # no match
    assert run([[1, 2, 5, 1, 2, 6, 2]], 2, 1, 3) == [[6, 2]]                   # n=1 fallback
    assert run([[1, 2, 5, 1, 2, 6, 2]], 2, 2, 3) == [[]]                       # min_n forbids it
    # The longest match wins over a more recent shorter one: "4 1 2" -> 8, not "1 2" -> 9.
    assert run([[4, 1, 2, 8, 3, 1, 2, 9, 4, 1, 2]], 1, 1, 3) == [[8]]
    assert run([[4, 1, 2, 8, 3, 1, 2, 9, 4, 1, 2]], 1, 1, 2) == [[9]]          # max_n caps n
    assert run([[3, 3, 3, 3]], 4, 1, 2) == [[3]]      # overlapping the suffix; cut at the end
    assert run([[1, 2, 3, 1, 2]], 4, 1, 2) == [[3, 1, 2]]
    assert run([[1, 2, 3, 1, 2]], 4, 1, 2, limit=[1]) == [[3]]
    assert run([[9]], 3, 1, 1) == [[]]


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_random_batches_match_the_oracle(lo, hi):
    rng = np.random.default_rng(lo * 10 + hi)
    hists = [list(rng.integers(0, 4, rng.integers(1, 40))) for _ in range(200)]
    got = run(hists, 5, lo, hi)
    assert got == [oracle(h, 5, lo, hi) for h in hists]
    assert sum(map(bool, got)) > 20  # matches were found, not only empty proposals


def test_cost_per_request_is_far_below_a_millisecond():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, (256, 2048)).astype(np.int32)
    lengths = rng.integers(1024, 2048, 256)
    best = min(_timed(tokens, lengths) for _ in range(3))
    assert best / 256 < 200e-6, f"{best / 256 * 1e6:.0f} µs per request"


def test_bad_window_refused():
    with pytest.raises(ValueError, match="min_n"):
        propose(np.zeros((1, 4), np.int32), [4], 2, 3, 2)


def _timed(tokens, lengths):
    t0 = time.perf_counter()
    propose(tokens, lengths, 4, 1, 5)
    return time.perf_counter() - t0


@pytest.mark.parametrize("lo, hi", [(1, 3), (2, 4), (3, 3)])
def test_may_propose_is_false_only_where_lookup_finds_nothing(lo, hi):
    """NgramProposer.may_propose, asked while a sequence's last token is in flight: False must
    mean that lookup finds nothing whatever that token turns out to be (the engine then keeps
    the overlap); it must also say False often enough to matter on text that rarely repeats."""
    from jaxllm.sampling_params import SamplingParams
    from jaxllm.sequence import PENDING, Sequence
    from jaxllm.spec_decode.proposer import NgramProposer

    rng = np.random.default_rng(lo * 10 + hi)
    p = NgramProposer(lo, hi)
    outcomes = set()
    for _ in range(300):
        h = rng.integers(0, 8, size=int(rng.integers(2, 14))).tolist()
        s = Sequence("s", h[:1], SamplingParams())
        s.output_token_ids = h[1:-1] + [PENDING]
        may = bool(p.may_propose([s])[0])
        s.output_token_ids[-1] = h[-1]
        found = int(p.propose([s], 3, np.array([3]))[1][0]) > 0
        assert found == bool(oracle(h, 3, lo, hi))
        assert may or not found
        outcomes.add((may, found))
    assert (True, True) in outcomes
    assert ((False, False) in outcomes) == (lo > 1)  # min_n = 1: any last token may match
