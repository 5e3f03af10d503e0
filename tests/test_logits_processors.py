"""Custom logits processors (issue 51): vLLM's v1 interface over NumPy logits, loaded by
--logits-processors, opted into per request with extra_args (vllm_xargs over HTTP).

One engine with two processors serves the module: a batch-level one that forces each opted-in
row to its own token (so a row that points at the wrong request shows up as a wrong token),
and a per-request one (AdapterLogitsProcessor) that suppresses a token, checked against
transformers' `suppress_tokens` on the same weights.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor


class ForceToken(LogitsProcessor):
    """vLLM's DummyLogitsProcessor: rows whose request has extra_args {"force": t} get every
    logit but t's set to -inf. Keeps {row: t} through the batch updates."""

    calls: list[BatchUpdate] = []

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        t = (params.extra_args or {}).get("force")
        if t is not None and not isinstance(t, int):
            raise ValueError(f"force must be a token id, got {t!r}")

    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update) -> None:
        if update is None:
            return
        ForceToken.calls.append(update)
        for i in update.removed:
            self.rows.pop(i, None)
        for i, params, _, _ in update.added:
            t = (params.extra_args or {}).get("force")
            if t is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = t
        assert not update.moved  # jaxllm reports a changed row as removed + added

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for i, t in self.rows.items():
            keep = logits[i, t]
            logits[i] = -np.inf
            logits[i, t] = keep
        return logits


class Suppress(AdapterLogitsProcessor):
    """Per request: extra_args {"suppress": t} bans token t (transformers' suppress_tokens)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        t = (params.extra_args or {}).get("suppress")
        if t is None:
            return None

        def suppress(output_ids, row):
            row[t] = -np.inf
            return row
        return suppress


class NotAProcessor:
    pass


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=64, logits_processors=[
                   ForceToken, "test_logits_processors:Suppress"])


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype="float32")


def hf_greedy(hf, prompt: list[int], n: int, **kw) -> list[int]:
    import torch
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8], [4, 4, 11, 12, 6, 2], [9, 1], [15, 2, 20, 21],
           [30, 31, 32]]


def test_rows_follow_their_requests_as_the_batch_changes(llm, hf):
    """Six requests over four batch rows, with different lengths: rows are freed and taken
    again mid-run, so each opted-in request keeps its own forced token only if every batch
    update reached the processor right; the others equal transformers' greedy tokens (the
    processed sampler path changes nothing for them)."""
    forced = {0: 17, 2: 23, 3: 29, 5: 31}
    lens = [3, 9, 5, 12, 7, 4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             extra_args={"force": forced[i]} if i in forced else None)
              for i, n in enumerate(lens)]
    ForceToken.calls.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for i, out in enumerate(outs):
        got = out.outputs[0].token_ids
        assert len(got) == lens[i]
        if i in forced:
            assert got == [forced[i]] * lens[i], (i, got)
        else:
            assert got == hf_greedy(hf, PROMPTS[i], lens[i]), i
    # The run needed updates that replace rows (a request leaving, another taking its row).
    assert any(u.removed and u.added for u in ForceToken.calls)
    assert all(u.batch_size <= 4 for u in ForceToken.calls)


def test_per_request_adapter_equals_transformers_suppress_tokens(llm, hf):
    prompt = PROMPTS[1]
    plain = hf_greedy(hf, prompt, 8)
    banned = max(set(plain), key=plain.count)  # the token greedy decoding leans on most
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                      extra_args={"suppress": banned}), use_tqdm=False)
    got = out[0].outputs[0].token_ids
    assert banned not in got
    assert got == hf_greedy(hf, prompt, 8, suppress_tokens=[banned])
    assert got != plain


def test_validate_params_refuses_the_request(llm):
    with pytest.raises(ValueError, match="force must be a token id"):
        llm.generate({"prompt_token_ids": [1, 2]},
                     SamplingParams(max_tokens=2, extra_args={"force": "x"}), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={1: 2})
    # The engine still serves after a refused request.
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_extra_args_need_a_processor(load, tiny_llama):
    from transformers import AutoTokenizer

    from jaxllm.engine.input_processor import InputProcessor

    _, cfg, _ = load(tiny_llama)
    inputs = InputProcessor(AutoTokenizer.from_pretrained(tiny_llama), cfg, max_logprobs=0,
                            eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="extra_args .* no.*--logits-processors"):
        inputs.process("r", [1, 2], SamplingParams(extra_args={"force": 3}))
    inputs.process("r", [1, 2], SamplingParams())  # and without them, accepted


@pytest.mark.parametrize("spec, extra, match", [
    (["no_such_module:Thing"], {}, "does not name an importable class"),
    (["test_logits_processors:NotAProcessor"], {}, "not a subclass"),
    ([ForceToken], {"async_scheduling": True}, "async-scheduling"),
    ([ForceToken], {"num_scheduler_steps": 4}, "num-scheduler-steps"),
    ([ForceToken], {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                           "prompt_lookup_max": 3}}, "speculative"),
    ([ForceToken], {"runner": "pooling"}, "pooling"),
])
def test_start_up_refusals_name_the_flag(tiny_llama, spec, extra, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny_llama, logits_processors=spec, **extra).create_engine_config()


def test_cli_flag_and_vllm_xargs():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    specs = ["test_logits_processors:ForceToken", "test_logits_processors.Suppress"]
    args = EngineArgs.from_cli_args(parser.parse_args(["--logits-processors", *specs]))
    assert args.logits_processors == specs
    assert args.create_engine_config().logits_processors == (ForceToken, Suppress)

    from serving.protocol_completion import CompletionRequest
    req = CompletionRequest(model="m", prompt="hi", vllm_xargs={"force": 3, "tags": ["a", 1]})
    sp = req.sampling_params(max_tokens=4, logprobs=None, prompt_logprobs=None, defaults={})
    assert sp.extra_args == {"force": 3, "tags": ["a", 1]}
    with pytest.raises(Exception, match="vllm_xargs"):
        CompletionRequest(model="m", prompt="hi", vllm_xargs={"force": {"nested": 1}})


@pytest.mark.slow  # a server process of its own
def test_server_vllm_xargs(tiny_llama, monkeypatch):
    """`jaxllm serve --logits-processors MODULE:CLASS` (the module on the server's PYTHONPATH,
    as a vLLM user ships one): vllm_xargs reach the processor; a request it refuses is a 400
    naming the problem, and the server keeps serving."""
    import os

    import httpx
    from server_process import ENGINE_FLAGS, ServerProcess

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p))
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--logits-processors",
                        "test_logits_processors:ForceToken")
    try:
        body = {"model": tiny_llama, "prompt": [1, 5, 9], "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/v1/completions", json={**body, "vllm_xargs": {"force": 42}})
            assert r.status_code == 200, r.text
            from transformers import AutoTokenizer
            assert r.json()["choices"][0]["text"] == \
                AutoTokenizer.from_pretrained(tiny_llama).decode([42] * 5)
            r = c.post("/v1/completions", json={**body, "vllm_xargs": {"force": "x"}})
            assert r.status_code == 400 and "force must be a token id" in r.text, r.text
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()


def test_logprobs_are_of_the_logits_before_the_processors(llm, hf):
    """vLLM's default logprobs (raw_logprobs): the forced token's logprob is the model's, not
    the 0.0 of the processed distribution; the top entries are the model's too."""
    import torch

    prompt, t = PROMPTS[0], 17
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                      extra_args={"force": t}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [t] * 3
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + [t] * 2])).logits[0, len(prompt) - 1:]
    want = torch.log_softmax(logits.float(), -1).numpy()
    for step, entry in enumerate(out.logprobs):
        assert entry[t].logprob == pytest.approx(float(want[step, t]), abs=1e-4)
        assert entry[t].logprob < -1e-3  # not the processed distribution's 0.0
        assert entry[t].rank == int((want[step] >= want[step, t]).sum())
        for tok in [int(i) for i in np.argsort(-want[step])[:2]]:
            assert entry[tok].logprob == pytest.approx(float(want[step, tok]), abs=1e-4)
