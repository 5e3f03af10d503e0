"""Multi-LoRA serving: the request type (host only, importable from every layer). The adapter
reader is jaxllm/loader/lora.py, the math jaxllm/layers/lora.py, the slots on the device
jaxllm/engine/lora_slots.py."""
