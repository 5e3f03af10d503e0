"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from jaxllm.config import DEFAULT_MODEL, EngineArgs
from jaxllm.engine.dp_engine import make_engine
from jaxllm.engine.engine import PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

Params = Union[SamplingParams, Sequence[SamplingParams], None]


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.llm_engine = make_engine(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults, as vLLM does."""
        d = dict(self.llm_engine.generation_defaults)
        if "max_new_tokens" in d:
            d["max_tokens"] = d.pop("max_new_tokens")
        return SamplingParams(**d)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Params = None, use_tqdm: bool = True,
                 priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A single prompt may be given bare."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                self.llm_engine.add_request(rid, prompt, p, priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: Params = None, use_tqdm: bool = True,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations."""
        from jaxllm.entrypoints.chat_utils import render_chat_prompt

        tok = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = render_chat_prompt(tok, conv, chat_template=chat_template,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template_kwargs=chat_template_kwargs)
            # The template already holds any BOS: do not add special tokens again (as vLLM).
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        t0, n_in, n_out = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                done[out.request_id] = out
                n_in += len(out.prompt_token_ids)
                n_out += sum(len(o.token_ids) for o in out.outputs)
                dt = time.perf_counter() - t0
                bar.set_postfix_str(f"est. speed input: {n_in / dt:.1f} toks/s, "
                                    f"output: {n_out / dt:.1f} toks/s", refresh=False)
                bar.update(1)
        bar.close()
        return [done[i] for i in ids]
