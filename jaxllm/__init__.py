"""jaxllm: LLM inference and serving on JAX/XLA with vLLM's API."""

__version__ = "0.1.0"

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
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
