"""Structured output (vLLM's guided decoding): request spellings -> StructuredOutputsParams
(params.py), and the grammar engine that turns them into per-step banned-token masks
(backend.py)."""

from jaxllm.structured_output.params import (GuidedDecodingParams, ReasoningGate,
                                             StructuredOutputsParams, from_request)

__all__ = ["GuidedDecodingParams", "ReasoningGate", "StructuredOutputsParams", "from_request"]
