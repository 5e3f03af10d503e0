"""`LoRARequest`: which adapter a request runs with, as vLLM's (`vllm.lora.request`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """A peft adapter folder (`adapter_config.json` + `adapter_model.safetensors`) under a
    name and a positive integer id, both unique among the engine's adapters. As vLLM's, two
    requests are the same adapter when their names are equal."""
    lora_name: str
    lora_int_id: int = field(compare=False)
    lora_path: str = field(default="", compare=False)
    base_model_name: Optional[str] = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
