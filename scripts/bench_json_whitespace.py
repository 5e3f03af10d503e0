"""Mask cost per step: the default bounded JSON whitespace against llguidance's flexible one,
64 rows walking the same pretty-printed JSON (SmolLM2 tokenizer), alternating, best of 5.

    python scripts/bench_json_whitespace.py
"""
import dataclasses, json, time
import numpy as np
from jaxllm.config import EngineArgs
from jaxllm.loader.default_model import default_model_path
from jaxllm.tokenizer import get_tokenizer
from jaxllm.structured_output.backend import get_compiler, fill_banned_bits
from jaxllm.structured_output import StructuredOutputsParams as SO
load = dataclasses.replace(EngineArgs().create_engine_config().load, model=default_model_path())
tok = get_tokenizer(load)
comp = get_compiler(tok, None, (tok.eos_token_id,))
schema = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
text = json.dumps({"name": "Tom", "age": 3, "tags": ["a", "b"], "address": {"city": "Paris", "zip": 75001}}, indent=2, sort_keys=True)
ids = tok.encode(text, add_special_tokens=False)
V = comp.mask_vocab_size if hasattr(comp, "mask_vocab_size") else 49152
words = (V + 31) // 32
def run(params):
    ms = [comp.matcher(params) for _ in range(64)]
    bits = np.zeros((64, words), np.uint32)
    t = time.perf_counter()
    for tid in ids:
        fill_banned_bits([(m, i) for i, m in enumerate(ms)], bits)
        for m in ms:
            assert m.accept(tid)
    return (time.perf_counter() - t) / len(ids) * 1e3
res = {"bounded": [], "flexible": []}
for r in range(5):
    for name, p in (("bounded", SO(json=schema)), ("flexible", SO(json=schema, whitespace_pattern=r"[\x20\x0A\x0D\x09]+"))):
        res[name].append(run(p))
b, f = min(res["bounded"]), min(res["flexible"])
print(f"tokens {len(ids)}; ms per step (64 rows), best of 5: bounded {b:.2f}, flexible {f:.2f}, ratio {b/f:.2f}; medians {np.median(res['bounded']):.2f} / {np.median(res['flexible']):.2f}")
