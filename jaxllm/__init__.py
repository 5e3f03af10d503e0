"""jaxllm: LLM inference and serving on JAX/XLA with vLLM's API."""

import logging

__version__ = "0.1.0"


class _NoTorchAdvisory(logging.Filter):
    """Drops transformers' "PyTorch was not found. Models won't be available ..." line, logged
    when it is imported without torch (the plain install): jaxllm takes only configs,
    tokenizers and chat templates from transformers, never its models, and a new user reads
    the line as fatal. Its other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found.")


logging.getLogger("transformers").addFilter(_NoTorchAdvisory())

# Public name -> the module defining it. Imported on first use (`__getattr__`), so that
# `import jaxllm` (e.g. for the CLI's --help) does not import JAX.
_EXPORTS = {
    "LLM": "jaxllm.entrypoints.llm",
    "EngineArgs": "jaxllm.config",
    "SamplingParams": "jaxllm.sampling_params",
    "BeamSearchParams": "jaxllm.sampling_params",
    "RequestOutputKind": "jaxllm.sampling_params",
    "StructuredOutputsParams": "jaxllm.structured_output.params",
    "GuidedDecodingParams": "jaxllm.structured_output.params",
    "PoolingParams": "jaxllm.pooling_params",
    "RequestOutput": "jaxllm.outputs",
    "CompletionOutput": "jaxllm.outputs",
    "PoolingRequestOutput": "jaxllm.outputs",
    "EmbeddingRequestOutput": "jaxllm.outputs",
    "ClassificationRequestOutput": "jaxllm.outputs",
    "ScoringRequestOutput": "jaxllm.outputs",
    "LoRARequest": "jaxllm.lora.request",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
