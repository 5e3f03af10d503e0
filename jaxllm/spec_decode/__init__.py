"""Speculative decoding building blocks (issue 27): the `--speculative-config` dataclass, the
n-gram prompt-lookup proposer (host) and the jitted rejection sampler that verifies drafts."""
