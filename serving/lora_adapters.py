"""The LoRA adapters a server serves under their own model names (vLLM's OpenAIServingModels,
its LoRA half): registered at start-up from --lora-modules, loaded and unloaded at run time
through /v1/load_lora_adapter and /v1/unload_lora_adapter when $VLLM_ALLOW_RUNTIME_LORA_UPDATING
is true, and looked up by the `model` field of every generation request.

Each adapter gets the next integer id (1, 2, ...; ids are never reused, so a reloaded name is a
new adapter to the engine). The engine reads and validates the adapter when it is registered
(`add_lora`), so a bad path fails its load, not a later request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

from jaxllm.lora.request import LoRARequest
from serving.errors import APIError

logger = logging.getLogger("jaxllm.serving")
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(environ=os.environ) -> bool:
    """$VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it: "1" or "true", any case."""
    return environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


class LoRAAdapters:
    """Adapter name -> its LoRARequest, for one server."""

    def __init__(self, base_model_names: list[str], runtime_updating: bool = False):
        self.base_model_names = list(base_model_names)
        self.runtime_updating = runtime_updating
        self.requests: dict[str, LoRARequest] = {}
        self._last_id = 0
        self._lock: Optional[asyncio.Lock] = None  # made on the serving loop, when first used

    def get(self, name: Optional[str]) -> Optional[LoRARequest]:
        return self.requests.get(name) if name else None

    def _next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def _serialized(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def load(self, engine: Any, lora_name: str, lora_path: str,
                   base_model_name: Optional[str] = None) -> str:
        """Register an adapter with the engine (which reads and validates it); vLLM's success
        text, or an APIError: 400 for a missing field, a name in use or an adapter the engine
        refuses."""
        if not lora_name or not lora_path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_name" if not lora_name else "lora_path")
        async with self._serialized():
            if lora_name in self.requests:
                raise APIError(f"The lora adapter '{lora_name}' has already been loaded.",
                               param="lora_name")
            if lora_name in self.base_model_names:
                raise APIError(f"'{lora_name}' is the name of a served model; choose another "
                               f"name for the adapter.", param="lora_name")
            request = LoRARequest(lora_name, self._next_id(), lora_path,
                                  base_model_name or self.base_model_names[0])
            try:
                await engine.add_lora(request)
            except (ValueError, OSError) as e:  # the engine names what is wrong with it
                raise APIError(f"Cannot load the lora adapter '{lora_name}' from "
                               f"'{lora_path}': {e}", param="lora_path") from None
            self.requests[lora_name] = request
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", lora_name, lora_path)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload(self, engine: Any, lora_name: str, lora_int_id: Optional[int] = None) -> str:
        """Remove an adapter (requests already running with it finish with it); 404 for a
        name not loaded, 400 for a `lora_int_id` that is not its id."""
        if not lora_name:
            raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.",
                           param="lora_name")
        async with self._serialized():
            request = self.requests.get(lora_name)
            if request is None:
                raise APIError(f"The lora adapter '{lora_name}' cannot be found.", 404,
                               param="lora_name")
            if lora_int_id is not None and lora_int_id != request.lora_int_id:
                raise APIError(f"lora_int_id {lora_int_id} is not the id of the lora adapter "
                               f"'{lora_name}' ({request.lora_int_id}).", param="lora_int_id")
            if not await engine.remove_lora(request.lora_int_id):
                raise APIError(f"Failed to remove lora adapter '{lora_name}' from the engine.",
                               500)
            del self.requests[lora_name]
        logger.info("Removed LoRA adapter: name '%s'", lora_name)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    async def register(self, engine: Any, modules: list) -> None:
        """The --lora-modules, in order (ids 1, 2, ...); a ValueError names the module that
        cannot be loaded."""
        for m in modules:
            try:
                await self.load(engine, m.name, m.path, m.base_model_name)
            except APIError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from None
