"""peft adapters for the LoRA tests, made from a tiny checkpoint with random non-zero B
(init_lora_weights=False, so each changes the output), and their transformers oracle."""

from __future__ import annotations

import copy
import os

from jaxllm import LoRARequest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft LoraConfig arguments: ranks 8, 4 (rsLoRA), 16; all modules, q/v, o/up/down.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "oud": dict(r=16, lora_alpha=8, target_modules=["o_proj", "up_proj", "down_proj"]),
}


def make_adapters(base_path: str, folder: str) -> dict:
    """{name: (adapter folder, the peft model: its oracle)}, and {None: (None, the base)}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    out = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **kw))
        path = os.path.join(folder, name)
        model.save_pretrained(path)
        out[name] = (path, model.eval())
    out[None] = (None, base)
    return out


def requests(adapters: dict) -> dict:
    """{name: LoRARequest} of `make_adapters`' adapters, ids 1, 2, ..."""
    return {name: LoRARequest(name, i + 1, adapters[name][0])
            for i, name in enumerate(ADAPTERS)}


def oracle(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, the whole sequence recomputed each token."""
    import torch

    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids[len(prompt):], lps
