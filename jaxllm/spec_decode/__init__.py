"""Speculative decoding: the `--speculative-config` dataclass, the proposers (n-gram prompt
lookup on the host, a draft model with its own cache), the speculator choosing who gets drafts,
and acceptance (drafts verified as extra rows of the plain sampler)."""
