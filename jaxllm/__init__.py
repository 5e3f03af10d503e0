"""jaxllm: LLM inference and serving on JAX/XLA with vLLM's API."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so `import jaxllm` (e.g. for the CLI's --help) does not import JAX.
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from jaxllm.sampling_params import SamplingParams
        return SamplingParams
    if name in ("StructuredOutputsParams", "GuidedDecodingParams"):
        from jaxllm.structured_output import params
        return getattr(params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxllm import outputs
        return getattr(outputs, name)
    if name == "PoolingParams":
        from jaxllm.pooling_params import PoolingParams
        return PoolingParams
    if name in ("PoolingRequestOutput", "EmbeddingRequestOutput"):
        from jaxllm import outputs
        return getattr(outputs, name)
    if name == "EngineArgs":
        from jaxllm.config import EngineArgs
        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams",
           "RequestOutput", "CompletionOutput", "EngineArgs", "PoolingParams",
           "PoolingRequestOutput", "EmbeddingRequestOutput"]
