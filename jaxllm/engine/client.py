"""The two contracts engines keep, so that callers never ask which engine they hold.

`EngineCore` is the synchronous engine a loop drives (vLLM's EngineCore): one engine on a
device mesh (`LLMEngine`, a pipeline included), data-parallel replicas behind a router
(`DataParallelEngine`), a replica on another node (`RemoteReplica`). `LLM` and the async
wrapper drive one of these.

`EngineClient` is what the server talks to (vLLM's EngineClient): the asyncio front of an
`EngineCore` running on its own thread (`AsyncLLMEngine`).

tests/test_engine_client.py checks each implementation against its contract.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Protocol, Union, runtime_checkable

from jaxllm.engine.input_processor import PromptType
from jaxllm.engine.stats import EngineStats
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


@runtime_checkable
class EngineCore(Protocol):
    """The calls; an engine that fronts a model (not a remote replica, which the engine
    holding it fronts) also has model_config, tokenizer, eos_token_ids, generation_defaults,
    startup_times, supported_tasks (vLLM's: generate, or the pooling runner's tasks) and
    classifier (--convert classify's head, else None)."""

    @property
    def alive(self) -> bool:
        """False once the engine can serve no more (a lost remote replica)."""

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> None: ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and validate an adapter (ValueError naming the problem)."""

    def remove_lora(self, lora_int_id: int) -> bool:
        """False for an adapter it does not hold."""

    def list_loras(self) -> set[int]: ...

    def abort_request(self, request_ids: Union[str, list[str]]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def encode(self, request_id: str, prompt: PromptType,
               params: Optional[PoolingParams] = None) -> PoolingRequestOutput: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class EngineClient(Protocol):
    model_config: Any
    generation_defaults: dict
    eos_token_ids: frozenset
    supported_tasks: tuple  # generate, or the pooling runner's tasks (/classify, /score)
    classifier: Any         # --convert classify's head (its labels), else None

    def get_tokenizer(self) -> Any: ...

    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: Optional[LoRARequest] = None
                 ) -> AsyncIterator[RequestOutput]: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...

    async def list_loras(self) -> set[int]: ...

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams,
                     request_id: str) -> PoolingRequestOutput: ...

    async def abort(self, request_id: str) -> None: ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict: ...

    async def wake_up(self, tags: Optional[list[str]] = None) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def update_weights(self, named_tensors) -> None: ...

    def stats(self) -> EngineStats: ...

    def health(self, stall_after: float) -> Optional[str]:
        """None while healthy, else why not."""

    @property
    def is_running(self) -> bool: ...

    def shutdown(self) -> None: ...
