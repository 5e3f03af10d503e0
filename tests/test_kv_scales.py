"""fp8 KV cache with per-layer scales (issue 45): checkpoint scales, --calculate-kv-scales, the
1.0 default's warning, and the scales reaching every attention path.

The checkpoint (tests/kv_scale_checkpoints.py) is the tiny random Llama with each layer's k/v
stretched beyond float8 e4m3's range (x60 in layer 0, x600 in layer 1) and q/o shrunk to match,
so the float model computes the same function. Logits are compared with the same model run
with a float32 cache, by the root mean square of their difference. Tolerance: what a float8
cache costs this model whatever the scales, i.e. the unstretched model's own fp8-cache error
(its k/v fit e4m3 unscaled), times 1.5. e4m3 keeps 3 mantissa bits (each cached value within
2^-4 of itself), which this random model's wide weights carry to logit errors of about a tenth
(logits of a few units); which values round which way differs with the scale, hence the 1.5:
the bound says the scales lose nothing beyond the format itself. Scales of 1.0 saturate every
k/v beyond 448, and layer 0's scales in layer 1 saturate layer 1's: each is checked to be at
least 4x worse.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kv_scale_checkpoints import add_scales, stretched_checkpoint

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.loader.weights import CheckpointError

PROMPT = [5, 17, 42, 99, 3, 250, 77, 8, 140, 66, 23, 300, 12, 9, 480, 31, 200, 7, 61, 88]
FP8 = jnp.float8_e4m3fn


@functools.partial(jax.jit, static_argnums=0)
def _run(graphdef, state, caches, ids, positions, md):
    m = nnx.merge(graphdef, state)
    hidden, caches = m(caches, ids, positions, md)
    return m.compute_logits(hidden), caches


def prefill(model, cache_dtype, kv_scales=None, ids=PROMPT):
    """(the model's prefill logits of `ids` [len, V], its caches) on a cache of `cache_dtype`
    (kv_scales: set the model's [layers, 2] scales first). One compiled program per model
    structure and cache dtype: the scales are part of the state."""
    if kv_scales is not None:
        set_kv_scales(model, kv_scales)
    T, n, bs = 32, len(ids), 16
    graphdef, state = nnx.split(model)
    state = model.backend.relayout(jax.tree.map(jnp.copy, state), model.cfg)
    caches = tuple(KVCache(jnp.zeros(s, cache_dtype), jnp.zeros(s, cache_dtype))
                   for s in model.kv_cache_shapes(T // bs, bs))
    padded = np.zeros(T, np.int32)
    padded[:n] = ids
    slots = np.where(np.arange(T) < n, np.arange(T), -1).astype(np.int32)
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray([n, 0], jnp.int32),
                           jnp.asarray([[0, 1], [0, 0]], jnp.int32),
                           jnp.asarray([0, n, n], jnp.int32), jnp.asarray([1], jnp.int32))
    logits, caches = _run(graphdef, state, caches, jnp.asarray(padded),
                          jnp.arange(T, dtype=jnp.int32), md)
    return np.asarray(logits)[:n], caches


def amax_scales(caches, top: float = 448.0) -> np.ndarray:
    """amax / top of each layer's k and v in float caches (after RoPE, as attention caches
    them): [layers, 2]."""
    out = []
    for c in caches:
        k, v = (np.abs(np.asarray(x, np.float32)).reshape(x.shape[0], -1).max(1)
                for x in (c.k, c.v))
        out.append(np.stack([k, v], axis=1))
    return np.concatenate(out) / top


def kv_scales_of(model) -> np.ndarray:
    state = nnx.state(model)
    return np.concatenate([np.asarray(state["layers"][i]["kv_scales"].get_value())
                           for i in range(len(model.groups))])


def set_kv_scales(model, scales) -> None:
    state = nnx.state(model)
    (var,) = [state["layers"][i]["kv_scales"] for i in range(len(model.groups))]
    var.set_value(jnp.asarray(scales, jnp.float32))
    nnx.update(model, state)


def err(a, b) -> float:
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(np.sqrt(np.mean(d * d)))


@pytest.fixture(scope="module")
def ckpt(tiny_llama, load, tmp_path_factory):
    """(stretched checkpoint without scales, the same with kv_cache_scheme scales, the
    scales [layers, 2], the float model's prefill logits [len, V], the tolerance)."""
    bare = stretched_checkpoint(tiny_llama, str(tmp_path_factory.mktemp("kv") / "bare"))
    model, _, _ = load(bare)
    want, caches = prefill(model, jnp.float32)
    scales = amax_scales(caches) * 1.25  # headroom, as for prompts other than the calibration
    scaled = add_scales(stretched_checkpoint(tiny_llama,
                                             str(tmp_path_factory.mktemp("kv") / "ct")), scales)
    unstretched, _, _ = load(tiny_llama, kv_cache_dtype="fp8")
    limit = 1.5 * err(prefill(unstretched, FP8)[0], want)
    return bare, scaled, scales, want, limit


def check_scaled_logits(model, scales, want, limit) -> None:
    """With `scales` the logits are within `limit`; with 1.0, or layer 0's in every layer,
    they are at least 4x worse and past it."""
    got = err(prefill(model, FP8, scales)[0], want)
    assert got < limit, (got, limit)
    ones = err(prefill(model, FP8, np.ones_like(scales))[0], want)
    first = err(prefill(model, FP8, np.broadcast_to(scales[:1], scales.shape))[0], want)
    assert ones > 4 * got and ones > limit, (ones, got)
    assert first > 4 * got and first > limit, (first, got)


def test_checkpoint_scales_are_read_per_layer(ckpt, load, caplog):
    _, scaled, scales, _, _ = ckpt
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        model, cfg, _ = load(scaled, kv_cache_dtype="fp8")
    assert cfg.kv_scales == "checkpoint" and cfg.quant is None  # kv_cache_scheme only
    np.testing.assert_allclose(kv_scales_of(model), scales, rtol=1e-6)
    assert scales[1, 0] > 5 * scales[0, 0] and scales[1, 1] > 5 * scales[0, 1]
    assert "KV cache scaling factor 1.0" not in caplog.text


@pytest.mark.parametrize("backend", ["cpu", pytest.param("reference", marks=pytest.mark.slow),
                                     pytest.param("pallas", marks=pytest.mark.slow)])
def test_fp8_logits_match_the_float_model_with_scales(ckpt, load, backend):
    """Checkpoint scales on each backend (the CPU backend's float8 cache runs its native
    attention kernel, the scales a run-time operand; Pallas: the GPU kernel interpreted)."""
    _, scaled, scales, want, limit = ckpt
    model, _, _ = load(scaled, kv_cache_dtype="fp8", attention_backend=backend)
    assert model.attention_backend == backend
    check_scaled_logits(model, scales, want, limit)


@pytest.mark.slow
@pytest.mark.parametrize("names", ["output_scale", "kv_scale"])
def test_other_checkpoint_names(ckpt, load, tmp_path, names):
    """The older k_proj/v_proj.output_scale names, and one kv_scale for both (the larger)."""
    bare, _, scales, _, _ = ckpt
    import shutil
    path = add_scales(shutil.copytree(bare, str(tmp_path / names)), scales, names)
    model, _, _ = load(path, kv_cache_dtype="fp8")
    want = scales if names == "output_scale" else np.repeat(scales.max(1, keepdims=True), 2, 1)
    np.testing.assert_allclose(kv_scales_of(model), want, rtol=1e-6)


def test_no_scales_warn_once_and_use_one(ckpt, load, caplog):
    bare = ckpt[0]
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        model, cfg, _ = load(bare, kv_cache_dtype="fp8_e4m3")
    assert cfg.kv_scales == "checkpoint"
    assert caplog.text.count("using KV cache scaling factor 1.0") == 1
    np.testing.assert_array_equal(kv_scales_of(model), np.ones((2, 2), np.float32))


def test_scales_ignored_without_an_fp8_cache(ckpt, load):
    """vLLM ignores a checkpoint's KV scales for an 'auto' cache: the model holds none."""
    model, cfg, _ = load(ckpt[1])
    assert cfg.kv_scales is None
    assert "kv_scales" not in nnx.state(model)["layers"][0]


@pytest.mark.parametrize("bad", [0.0, float("nan"), pytest.param(-1.0, marks=pytest.mark.slow),
                                 pytest.param(float("inf"), marks=pytest.mark.slow)])
def test_bad_scale_is_refused_naming_the_tensor(ckpt, load, tmp_path, bad):
    import shutil
    _, _, scales, _, _ = ckpt
    scales = scales.copy()
    scales[1, 1] = bad
    path = add_scales(shutil.copytree(ckpt[0], str(tmp_path / "bad")), scales)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_scale.*"
                                              "positive finite"):
        load(path, kv_cache_dtype="fp8")


def test_calculate_kv_scales_flag_is_checked():
    with pytest.raises(ConfigError, match="--calculate-kv-scales.*fp8"):
        EngineArgs(model="m", calculate_kv_scales=True)
    with pytest.raises(ConfigError, match="--calculate-kv-scales.*sleep"):
        EngineArgs(model="m", calculate_kv_scales=True, kv_cache_dtype="fp8",
                   enable_sleep_mode=True)


def test_models_without_per_layer_scales(caplog):
    """Latent-attention, hybrid and Gemma 4 layers take no scales: their fp8 cache stays
    unscaled with a warning, and --calculate-kv-scales is refused naming the architecture."""
    from jaxllm.engine_config import ModelOptions
    from jaxllm.models.kv_scales import kv_scales_wanted

    fields = {"architecture": "DeepseekV3ForCausalLM", "kv_lora_rank": 512}
    assert kv_scales_wanted(fields, ModelOptions()) is None
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        assert kv_scales_wanted(fields, ModelOptions(kv_cache_dtype="fp8")) is None
    assert "DeepseekV3ForCausalLM's attention layers take no per-layer KV scales" in caplog.text
    with pytest.raises(ConfigError, match="--calculate-kv-scales: DeepseekV3ForCausalLM"):
        kv_scales_wanted(fields, ModelOptions(kv_cache_dtype="fp8", calculate_kv_scales=True))
    dense = {"architecture": "LlamaForCausalLM"}
    assert kv_scales_wanted(dense, ModelOptions(kv_cache_dtype="fp8_e5m2")) == "checkpoint"


@pytest.mark.slow
def test_calculate_kv_scales(ckpt, load, caplog):
    """--calculate-kv-scales: each layer's scale is its k/v amax over the calibration prefill
    / 448 (measured here from a float cache over the same ids), the checkpoint's scales are
    not read, and the logits of another prompt are as close as with checkpoint scales."""
    from jaxllm.engine.kv_calibration import calculate_kv_scales, calibration_ids
    from jaxllm.tokenizer import get_tokenizer

    bare, scaled, _, want, limit = ckpt
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        model, cfg, _ = load(scaled, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert cfg.kv_scales == "calculate" and "scaling factor 1.0" not in caplog.text
    np.testing.assert_array_equal(kv_scales_of(model), np.ones((2, 2)))  # not read
    tok = get_tokenizer(EngineArgs(model=bare).create_engine_config().load)
    ids = calibration_ids(tok, cfg.vocab_size)
    assert len(ids) > 40  # the calibration text, tokenized
    float_model, _, _ = load(bare)
    T = 32  # the float prefill's bucket: the calibration's first 31 tokens, then all of them
    first = amax_scales(prefill(float_model, jnp.float32, ids=list(ids[:T - 1]))[1])
    np.testing.assert_allclose(calculate_kv_scales(model, FP8, ids=ids[:T - 1]), first,
                               rtol=1e-5)
    got = calculate_kv_scales(model, FP8, tok)
    np.testing.assert_allclose(kv_scales_of(model), got)
    assert (got >= first * (1 - 1e-6)).all() and (got > first).any()
    assert got[1, 0] > 5 * got[0, 0]
    assert err(prefill(model, FP8)[0], want) < limit


@pytest.mark.parametrize("variant", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_pallas_kernel_takes_per_layer_scales_in_a_scan(variant):
    """The kernel (interpreted) inside a scan over layers, each layer's k/v scales traced
    scalars, against the reference given the same: both read the same float8 values, so the
    float32 tolerance holds (tests/test_pallas_attention.py checks the static-float scales'
    path against the same reference)."""
    from test_pallas_attention import ATOL, check, make_case

    from pallas_kernels.ragged_paged_attention import kernel, reference

    ker, ref, n = make_case(np.random.default_rng(7), [3, 1, 9], [30, 41, 9], 4, 2, 64, 16,
                            layers=3)
    scales = jnp.asarray([[0.5, 0.25], [2.0, 1.0], [8.0, 4.0]], jnp.float32)

    def with_fp8(args):  # layer l holds x / its scale, in float8 (padding NaN stays NaN)
        q, kc, vc, *rest = args
        return (q, *[(c / scales[:, col, None, None, None, None]).astype(FP8)
                     for col, c in ((0, kc), (1, vc))], *rest)

    ker, ref = with_fp8(ker), with_fp8(ref)

    def run(attn, args):
        q, kc, vc, _, *meta = args

        def layer(carry, xs):
            i, s = xs
            return carry, attn(q, kc, vc, i, *meta, sm_scale=0.125, k_scale=s[0],
                               v_scale=s[1])
        return jax.lax.scan(layer, 0, (jnp.arange(3), scales))[1]

    attn = functools.partial(kernel.ragged_paged_attention, variant=variant, chunk_blocks=2)
    out = jax.jit(functools.partial(run, attn))(ker)
    want = jax.jit(functools.partial(run, reference.ragged_paged_attention))(ref)
    for layer in range(3):
        check(out[layer], want[layer], n, ATOL[jnp.float32])
    assert err(out[2][:n], out[0][:n]) > 0.1  # the layers' scales really differ


@pytest.mark.parametrize("platform,tp", [
    ("tpu", 1), pytest.param("cuda", 1, marks=pytest.mark.slow),
    pytest.param("tpu", 2, marks=pytest.mark.slow)])
def test_fp8_step_with_scales_exports(platform, tp):
    """The step (test_export.py's, Pallas backend) with a float8 cache and per-layer scales
    exports for TPU and CUDA: the platform's kernel and nothing CPU-only, each attention call
    taking one operand more (the layer's scales) than the same step's without scales."""
    import dataclasses
    import re
    from collections import Counter

    from test_export import CPU_ONLY, KERNEL, export_config, exported_step

    cfg = dataclasses.replace(export_config(), kv_scales="checkpoint")

    def kernel_operands(text):
        calls = [line for line in text.splitlines() if f"custom_call @{KERNEL[platform]}" in line]
        assert calls
        return Counter(len(re.findall(r"%[\w#]+", line.split("(", 1)[1].split(")", 1)[0]))
                       for line in calls)

    exported = exported_step(platform, tp, cfg, cache_dtype=FP8)
    text = exported.mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    assert not [name for name in CPU_ONLY if name in text]
    plain = exported_step(platform, tp, export_config(), cache_dtype=FP8).mlir_module()
    with_scales, without = kernel_operands(text), kernel_operands(plain)
    assert with_scales == Counter({k + 1: c for k, c in without.items()}), (with_scales, without)


@pytest.mark.slow
def test_engine_with_calculated_scales(ckpt, load):
    """The engine (LLM) with --calculate-kv-scales: its runner's scales are the calibration's
    (not 1.0), and its greedy tokens are those of the fp8 prefill with those scales (the
    engine's steps run the same attention: the CPU backend's native kernel for a float8 cache),
    within the float tolerance of the float model's logits."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.kv_calibration import calculate_kv_scales
    from jaxllm.tokenizer import get_tokenizer

    bare, _, _, want, limit = ckpt
    llm = LLM(model=bare, kv_cache_dtype="fp8", calculate_kv_scales=True, max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=64, dtype="float32")
    state = llm.llm_engine.runner.state
    got = np.concatenate([np.asarray(state["layers"][i]["kv_scales"].get_value())
                          for i in range(len(state["layers"]))])
    model, _, _ = load(bare, kv_cache_dtype="fp8", calculate_kv_scales=True)
    tok = get_tokenizer(EngineArgs(model=bare).create_engine_config().load)
    np.testing.assert_allclose(got, calculate_kv_scales(model, FP8, tok), rtol=1e-5)
    assert got[1, 0] > 5 * got[0, 0]
    logits = prefill(model, FP8)[0]
    assert err(logits, want) < limit
    top2 = np.sort(logits[-1])[-2:]
    assert top2[1] - top2[0] > 1e-3  # no near-tie for summation order to break
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    assert list(out) == [int(logits[-1].argmax())]


@pytest.mark.slow  # two engines (~30 s); the layer-level kernel tests stay default
def test_native_cpu_engine_equals_the_reference_backend(ckpt):
    """An fp8 cache with checkpoint scales, k/v saturating without them: the CPU backend's
    engine (the native kernel writes and reads the float8 pages, scales as a run-time operand)
    gives the reference backend's greedy tokens and logprobs, over a batch of prompts whose
    decode runs past the first block."""
    from jaxllm import LLM, SamplingParams

    _, scaled, _, _, _ = ckpt
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[5:12]},
               {"prompt_token_ids": PROMPT[::-1] * 2}]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    runs = {}
    for backend in ("cpu", "reference"):
        llm = LLM(model=scaled, kv_cache_dtype="fp8", attention_backend=backend,
                  max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
                  dtype="float32")
        assert llm.llm_engine.model_config.kv_scales == "checkpoint"
        runs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    for got, want in zip(runs["cpu"], runs["reference"]):
        assert list(got.token_ids) == list(want.token_ids)
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)],
                                   [lp[t].logprob for lp, t in zip(want.logprobs,
                                                                   want.token_ids)], atol=1e-4)
