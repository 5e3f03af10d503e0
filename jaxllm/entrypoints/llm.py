"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from jaxllm.config import DEFAULT_MODEL, EngineArgs
from jaxllm.deploy.data_parallel import make_engine
from jaxllm.engine.engine import PromptType
from jaxllm.engine.input_processor import render_chat_prompt
from jaxllm.entrypoints.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from jaxllm.lora.request import LoRARequest
from jaxllm.entrypoints.score_utils import ScoreJob, Texts, score_pairs
from jaxllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                            PoolingRequestOutput, RequestOutput, ScoringOutput,
                            ScoringRequestOutput)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

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
                 priority: Optional[list[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None
                 ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A single prompt may be given bare.
        lora_request: the adapter of every prompt, or one per prompt (None: the base model);
        needs enable_lora=True."""
        prompts = _as_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
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
                # As vLLM's LLM: the result is each request's final output, whatever the
                # output_kind, so the engine builds no intermediate ones.
                p = (p if p is not None else SamplingParams()).clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._ids))
                lora = {"lora_request": loras[i]} if loras[i] is not None else {}
                self.llm_engine.add_request(rid, prompt, p, priority[i] if priority else 0,
                                            **lora)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: Params = None, use_tqdm: bool = True,
             chat_template: Optional[str] = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Optional[list[dict]] = None,
             chat_template_kwargs: Optional[dict] = None,
             lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None
             ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. `tools` (OpenAI
        function definitions) are rendered by the chat template, as in vLLM; the outputs are
        the model's text (parse tool calls with a tool parser from
        jaxllm.entrypoints.openai_parsers)."""
        from jaxllm.entrypoints.media import load_image

        tok = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        # a vision-language model's images: image parts (PIL images or data: URLs) go with it
        vision = getattr(getattr(self.llm_engine, "input_processor", None), "images", None)
        for conv in conversations:
            images = [] if vision is not None else None
            text = render_chat_prompt(tok, conv, chat_template=chat_template,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      tools=tools, chat_template_kwargs=chat_template_kwargs,
                                      content_format=chat_template_content_format,
                                      images=images,
                                      image_placeholder=vision.placeholder if vision else "")
            # The template already holds any BOS: do not add special tokens again (as vLLM).
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
            if images:
                prompts[-1]["multi_modal_data"] = {"image": [load_image(r) for r in images]}
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the beam_width best continuations of each prompt (text,
        token ids or a prompt dict), best first (see jaxllm/entrypoints/beam_search.py)."""
        engine = self.llm_engine
        ids = [engine.process_prompt(p)[1] for p in _as_list(prompts)]
        search = BeamSearch(ids, params, engine.eos_token_ids,
                            engine.model_config.max_model_len, engine.args.max_logprobs)
        steps = tqdm(total=params.max_tokens, desc="Beam search",
                     disable=None if use_tqdm else True)
        while not search.done:
            outs = self.generate(search.pending(), search.sampling_params, use_tqdm=False)
            search.advance([o.outputs[0].logprobs[0] for o in outs])
            steps.update(1)
        steps.close()
        return search.outputs(engine.tokenizer)

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Optional[PoolingParams] = None, use_tqdm: bool = True,
               pooling_task: Optional[str] = None) -> list[PoolingRequestOutput]:
        """Pooled hidden states of each prompt (a model run with --runner pooling); vLLM's
        pooling_task picks embed (one vector) or token_embed (one per token)."""
        prompts = _as_list(prompts)
        each = (pooling_params if isinstance(pooling_params, list)  # vLLM: or one per prompt
                else [pooling_params] * len(prompts))
        if len(each) != len(prompts):
            raise ValueError(f"{len(each)} pooling_params for {len(prompts)} prompts")
        each = [replace(p or PoolingParams(), **({} if pooling_task is None
                                                 else {"task": pooling_task})) for p in each]
        return [self.llm_engine.encode(str(next(self._ids)), p, params)
                for p, params in tqdm(list(zip(prompts, each)), desc="Processed prompts",
                                      unit="req", disable=None if use_tqdm else True,
                                      dynamic_ncols=True)]

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: Optional[PoolingParams] = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), as vLLM's LLM.embed."""
        if pooling_params is not None and pooling_params.task not in (None, "embed"):
            raise ValueError(f"LLM.embed() pools with task 'embed', not "
                             f"{pooling_params.task!r}; use LLM.encode()")
        return [EmbeddingRequestOutput.from_base(out)
                for out in self.encode(prompts, pooling_params, use_tqdm, "embed")]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]],
                 pooling_params: Optional[PoolingParams] = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (`.outputs.probs`), as vLLM's LLM.classify: a
        *ForSequenceClassification model (--convert classify), its head on the last token."""
        if pooling_params is not None and pooling_params.task not in (None, "classify"):
            raise ValueError(f"LLM.classify() pools with task 'classify', not "
                             f"{pooling_params.task!r}; use LLM.encode()")
        return [ClassificationRequestOutput.from_base(out)
                for out in self.encode(prompts, pooling_params, use_tqdm, "classify")]

    def score(self, data_1: Texts, data_2: Texts, /, *, use_tqdm: bool = True,
              pooling_params: Optional[PoolingParams] = None,
              truncate_prompt_tokens: Optional[int] = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one text against each of several (1:N) or pairwise (N:N); a
        cross-encoder's relevance (sigmoid of its one label) or an embedding model's cosine
        similarity (jaxllm/entrypoints/score_utils.py)."""
        if truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported by this server")
        if pooling_params is not None and pooling_params.task not in (None, "score"):
            raise ValueError(f"LLM.score() pools with task 'score', not "
                             f"{pooling_params.task!r}")
        engine = self.llm_engine
        head = getattr(engine, "classifier", None)
        job = ScoreJob.build(getattr(engine, "supported_tasks", ("generate",)),
                             engine.tokenizer, score_pairs(data_1, data_2),
                             pooling_params.use_activation if pooling_params else None,
                             None if head is None else head.num_labels)
        outs = self.encode([{"prompt_token_ids": p} for p in job.prompts], job.prompt_params,
                           use_tqdm)
        return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(score), ids)
                for score, ids in job.scores(outs)]

    def reward(self, *args, **kwargs):
        """Refused: reward models (vLLM's LLM.reward, per-token rewards of a *RewardModel
        checkpoint) are not implemented; classifiers run with LLM.classify."""
        raise ValueError("LLM.reward is not supported: reward models are not implemented "
                         "(use LLM.classify for a *ForSequenceClassification model)")

    # --- sleep mode (enable_sleep_mode=True) and new weights ---------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep: free the device memory the engine holds (level 1: the weights kept
        in host memory, the KV cache freed; level 2: both freed) until `wake_up`."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take back what `tags` name ("weights", "kv_cache"; default both)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def update_weights(self, named_tensors) -> None:
        """Replace the model's weights (RL loops): (name, array) pairs named and shaped as the
        model's Hugging Face checkpoint, all of them (NumPy, torch or JAX arrays)."""
        self.llm_engine.update_weights(named_tensors)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        # disable=None: shown on a terminal only, as a log line a bar is noise
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req",
                   disable=None if use_tqdm else True,
                   dynamic_ncols=True)
        t0, n_in, n_out = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if isinstance(out, Exception):  # a lost data-parallel replica's request
                    raise out
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


def _as_list(prompts) -> list:
    """A single prompt (text, token ids or a prompt dict) may be given bare."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
