"""N-gram prompt lookup (vLLM's "ngram" method) on the host, for a whole batch at once.

For each request, find the most recent earlier occurrence of its last n tokens, n from
prompt_lookup_max down to prompt_lookup_min (the longest match wins; among equally long ones
the most recent), and propose the up to K tokens that followed it. As vLLM's proposer, an
occurrence may overlap the suffix itself, and fewer than K tokens come back when the match
lies near the end. NumPy over a padded [R, L] token array: max_n vectorised comparisons of
the whole batch, no Python loop over requests (256 requests cost a few µs each: see report).
"""

from __future__ import annotations

import numpy as np


def propose(tokens: np.ndarray, lengths: np.ndarray, k: int, min_n: int, max_n: int,
            limit: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """tokens [R, L] (row r's history in tokens[r, :lengths[r]], the rest ignored) ->
    (drafts int32 [R, k], -1 past each row's count; counts int32 [R]). limit [R], optional,
    caps a row's count (e.g. max_model_len or max_tokens minus what it has)."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths, np.int64)
    R, L = tokens.shape
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    ends = np.arange(L)[None, :]  # candidate match ends at i: tokens[i-n+1 .. i] == suffix
    # alive[r, i] after j steps: tokens[r, i-j+1 .. i] equal the row's last j tokens. The sets
    # shrink with j, so the longest match is the largest j whose set is not empty.
    alive = ends < (lengths[:, None] - 1)  # the match must end before the last token
    best = np.zeros(R, np.int64)
    found = np.zeros(R, bool)
    for j in range(max_n):
        want = tokens[np.arange(R), np.clip(lengths - 1 - j, 0, L - 1)]
        same = np.zeros((R, L), bool)  # same[r, i] = tokens[r, i - j] == want[r]
        same[:, j:] = tokens[:, :L - j] == want[:, None]
        alive &= same & (lengths[:, None] - 1 - j >= 0)
        if j + 1 >= min_n:
            last = L - 1 - alive[:, ::-1].argmax(1)  # the most recent end at this length
            hit = alive[np.arange(R), last]
            best = np.where(hit, last, best)
            found |= hit
    start = best + 1
    counts = np.where(found, np.minimum(k, lengths - start), 0)
    if limit is not None:
        counts = np.clip(np.minimum(counts, np.asarray(limit, np.int64)), 0, None)
    offs = np.arange(k)[None, :]
    drafts = tokens[np.arange(R)[:, None], np.clip(start[:, None] + offs, 0, L - 1)]
    drafts = np.where(offs < counts[:, None], drafts, -1).astype(np.int32)
    return drafts, counts.astype(np.int32)
