"""GGUF kept quantized (issue 45): Q8_0, Q4_0 and Q4_1 projections become int8/int4 values
with a scale (and zero point) per block of 32 inputs, exactly what the `gguf` package's own
dequantization gives; the default SmolLM2 (Q4_1) runs so, its projections int4 on the device."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.loader.gguf_quant import decode


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_decode_to_what_gguf_dequantizes(kind):
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    x[1, :32] = 0.5  # a constant block: Q4_1's scale is 0 there
    blocks = quants.quantize(x, getattr(GGMLQuantizationType, kind))
    want = quants.dequantize(blocks, getattr(GGMLQuantizationType, kind))
    q, scale, zero = decode(blocks, kind, 6, 96)
    assert q.dtype == np.int8 and scale.shape == (6, 3)
    assert q.min() >= (-128 if kind == "Q8_0" else -8) and q.max() <= (127 if kind == "Q8_0"
                                                                        else 7)
    z = 0.0 if zero is None else np.repeat(zero, 32, axis=1)
    got = (q - z) * np.repeat(scale, 32, axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_default_model_kept_quantized():
    from jaxllm.config import DEFAULT_MODEL
    from jaxllm.loader.default_model import resolve_model
    from jaxllm.loader.gguf import gguf_hf_config, iter_gguf_tensors

    path = resolve_model(DEFAULT_MODEL)
    assert gguf_hf_config(path).quantization_config == {"quant_method": "gguf",
                                                         "weight_type": "Q4_1"}
    floats = {}
    for name, w in iter_gguf_tensors(path):
        if name.startswith("model.layers.0.") and name.endswith("proj.weight"):
            floats[name] = w
        elif floats and not name.startswith("model.layers.0."):
            break
    kept = {}
    for name, a in iter_gguf_tensors(path, "Q4_1"):
        if name.startswith("model.layers.0."):
            kept[name] = a
        elif kept and not name.startswith("model.layers.0."):
            break
    assert len(floats) == 7  # q, k (both un-permuted as the float ones are), v, o, MLP
    for name, w in floats.items():
        base = name[:-len(".weight")]
        q, scale, zero = kept[name], kept[base + ".weight_scale"], kept[base + ".weight_zero"]
        got = (q - np.repeat(zero, 32, axis=1)) * np.repeat(scale, 32, axis=1)
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-6 * np.abs(w).max(), err_msg=name)


def test_default_model_runs_int4_and_answers():
    from jaxllm import LLM, SamplingParams

    llm = LLM(use_tqdm_on_load=False, max_model_len=512, max_num_seqs=4,
              disable_log_stats=True)
    engine = llm.llm_engine
    assert engine.model_config.quant.describe().startswith("gguf: int4 weights, group 32")
    assert engine.weight_bytes["int4"] > 0.9 * 135e6 / 2 * 0.75  # the projections, 4 bits
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
