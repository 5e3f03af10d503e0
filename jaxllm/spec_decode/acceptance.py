"""Verifying drafts with the plain sampler: sample every position, keep the matching prefix.

A request with drafts d_0..d_{n-1} has n + 1 rows in the step: row j is the target's
distribution p_j after the request's tokens plus d_0..d_{j-1}. Each row is sampled by the
plain sampler exactly as it would be without speculation (its own SamplingTensors row: the
penalties and min_tokens see the tokens before that position, and the draw uses the uniform
of output token number len(output) + j). Then x_0..x_a are emitted, a the first j where
x_j != d_j (or n: the bonus token).

Why this is exact for any sampling parameters: a draft is a deterministic guess (a point mass
q = delta(d)). Rejection sampling with such q accepts d with probability min(1, p(d)/1) = p(d)
= P(x == d) and on rejection draws from normalize(max(0, p - q)) = p without d = the law of x
given x != d: the same as drawing x ~ p and accepting iff x == d. By induction over positions
each emitted token has the target's law given the tokens before it. Stronger still, a seeded
request draws the very tokens it draws without speculation, since token i always uses the
uniform of (seed, i) on the same distribution. Greedy rows are the special case p = argmax.
Every proposer (n-gram lookup, a draft model's or the MTP layer's argmax) makes such guesses, so
no general min(1, p/q) rule for a sampling draft is needed.
"""

from __future__ import annotations

import dataclasses

from jaxllm.sequence import Sequence


def draft_views(seq: Sequence, drafts: list[int]) -> list[Sequence]:
    """The sequence as it stands before each of its n + 1 verified positions: itself, then
    with d_0, with d_0 d_1, ... appended (what the sampler's host packing reads per row)."""
    out = seq.output_token_ids
    return [seq] + [dataclasses.replace(seq, output_token_ids=out + drafts[:j])
                    for j in range(1, len(drafts) + 1)]


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """Drafts accepted: the length of the prefix where the sampled tokens equal them."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
