"""The engine loop: add/abort requests, and `step()` = schedule -> one model step -> detokenize.

Everything here is host-side Python. A `Request` with n > 1 is fanned out into n `Sequence`s
that share the prompt (and, through prefix caching, its KV blocks); their outputs are gathered
back into one `RequestOutput` (vLLM's words: a request, its sequences).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from jaxllm.config import EngineArgs
from jaxllm.engine.detokenizer import IncrementalDetokenizer, decode_logprob_token
from jaxllm.engine.grammar import Grammars, advance
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.startup import build_engine_parts
from jaxllm.layers.sampling_tensors import EXTRA_PENALTY_IDS, SamplingTensors, needs_processing
from jaxllm.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput,
                            RequestOutput)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.sequence import Sequence, SequenceStatus
from jaxllm.spec_decode.draft_model import build_speculator
from jaxllm.worker.pooler import Pooler, pool

logger = logging.getLogger("jaxllm")

PromptType = Union[str, list[int], dict]


@dataclass
class _SeqState:
    """One sequence of a request and what the engine builds of its output."""
    seq: Sequence
    detok: Optional[IncrementalDetokenizer]
    logprobs: Optional[list] = None
    cumulative_logprob: float = 0.0
    sent: tuple[int, int] = (0, 0)  # text chars, tokens given out (DELTA outputs)


@dataclass
class Request:
    """The user's request: its prompt and parameters, and its n sequences."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_SeqState] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: Optional[list] = None  # per prompt token; filled as positions are computed
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once


def _last(inflight):
    """The last step of what is in flight (a step, a burst's list of steps, or None)."""
    return inflight[-1] if isinstance(inflight, list) else inflight


def _reads_output_history(sp: SamplingParams) -> bool:
    """Penalties count the output tokens, bad words match their ends, and a grammar's matcher
    must have taken them all before the next mask: these need every output token on the host."""
    return (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0
            or sp.presence_penalty != 0.0 or bool(sp.bad_words)
            or sp.structured_outputs is not None)


class LLMEngine:
    def __init__(self, args: EngineArgs, devices: Optional[list] = None):
        """devices: the ones this engine's mesh uses (a data-parallel replica's share)."""
        self.args = args
        t0 = time.perf_counter()
        parts = build_engine_parts(args, devices=devices)
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.generation_defaults = parts.generation_defaults
        self.runner = parts.runner
        self.runner_type = parts.runner_type
        self.pooler_config = parts.pooler_config
        self.pooler = None if parts.pooler_config is None else Pooler(
            self.runner.graphdef, self.runner.state, self.runner.kv_cache, args.block_size)
        self.kv_cache_manager = KVCacheManager(
            parts.num_blocks, args.block_size, enable_prefix_caching=args.prefix_caching,
            hash_algo=args.prefix_caching_hash_algo)
        self.scheduler = Scheduler(
            self.kv_cache_manager, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len,
            enable_chunked_prefill=args.chunked_prefill, policy=args.scheduling_policy,
            block_size=args.block_size)
        self.startup_times = dict(parts.startup_times, total=time.perf_counter() - t0)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size,
                                 self.eos_token_ids, args.structured_outputs_config)
        self.speculator = build_speculator(args, self.model_config, self.runner,
                                           parts.num_blocks)
        self._requests: dict[str, Request] = {}
        self._seq_owner: dict[str, Request] = {}
        self._inflight = None  # async scheduling: the dispatched step (or burst) not read yet
        self._rng = np.random.default_rng(args.seed)
        self._last_log = time.monotonic()
        self._log_counts = [0, 0]  # prompt, generation tokens since the last stats line
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        logger.info("Engine ready in %.1f s (%s)", self.startup_times["total"],
                    ", ".join(f"{k} {v:.1f} s" for k, v in parts.startup_times.items()))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def step_leader(self):
        """Multi-host rank 0's end of the step channel (None on one host)."""
        return self.runner.compile_manager.step_leader

    # --- requests ----------------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None
                       ) -> tuple[Optional[str], list[int]]:
        """Text and token ids of a prompt given as text, token ids, or a vLLM prompt dict;
        truncate_prompt_tokens=k keeps its last k tokens (-1: max_model_len), as vLLM."""
        text, ids = None, None
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            text = prompt.get("prompt")
            if ids is None and text is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text = prompt
        else:
            ids = prompt
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set); "
                                 "pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        ids = [int(i) for i in ids]
        limit = self.model_config.max_model_len
        keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("The prompt cannot be empty.")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {vocab}).")
        if len(ids) > limit:
            raise ValueError(f"The prompt (length {len(ids)}) is longer than the maximum model "
                             f"length of {limit}. Make it shorter, or raise --max-model-len.")
        return text, ids

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None) -> None:
        if self.pooler is not None:
            raise ValueError("Text generation is only supported for generative models; this "
                             "one runs with --runner pooling (embeddings). Start it with "
                             "--runner generate to generate text.")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params.clone() if params is not None else SamplingParams()
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set)")
            params.update_from_tokenizer(self.tokenizer)
        params.verify_for_model(self.model_config.vocab_size, self.args.max_logprobs)
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        extra = len(params.logit_bias or {}) + len(params.stop_token_ids) + len(self.eos_token_ids)
        if extra > EXTRA_PENALTY_IDS:
            raise ValueError(f"logit_bias and stop_token_ids name {extra} tokens; at most "
                             f"{EXTRA_PENALTY_IDS} are supported.")
        text, ids = self.process_prompt(prompt, params.truncate_prompt_tokens)
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - len(ids)
        if self.args.scheduling_policy != "priority" and priority != 0:
            raise ValueError("priority is only used with --scheduling-policy priority")
        now = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, text, ids, params, metrics={"arrival_time": now})
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        for i in range(params.n):
            if params.seed is not None:
                seed = params.seed + i
            else:
                seed = int(self._rng.integers(2**31 - 1))
            seq_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seq = Sequence(seq_id, list(ids), params, eos_token_ids=self.eos_token_ids,
                           arrival_time=now, priority=priority, seed=seed,
                           computes_prompt_logprobs=i == 0 and params.prompt_logprobs is not None,
                           grammar=grammar.matcher() if grammar is not None else None)
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens)
            req.seqs.append(_SeqState(seq, detok, [] if params.logprobs is not None else None))
            self._seq_owner[seq_id] = req
            self.scheduler.add_seq(seq)
        self._requests[request_id] = req

    def encode(self, request_id: str, prompt: PromptType,
               params: Optional[PoolingParams] = None) -> PoolingRequestOutput:
        """Pool one prompt now (it takes no step and no place in the KV cache)."""
        if self.pooler is None:
            raise ValueError("Embeddings are only supported for pooling models; this one runs "
                             "with --runner generate. Start it with --runner pooling (or "
                             "--convert embed) to embed.")
        params = params or PoolingParams()
        text, ids = self.process_prompt(prompt)
        cfg = self.pooler_config
        ptype = "ALL" if params.task == "token_embed" else cfg.pooling_type
        normalize = cfg.normalize if params.use_activation is None else params.use_activation
        data = pool(self.pooler.hidden_states(ids), ptype, normalize)
        self.total_prompt_tokens += len(ids)
        return PoolingRequestOutput(request_id, PoolingOutput(data), ids, True, text)

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            seq_ids = [c.seq.seq_id for c in req.seqs]
            self.scheduler.abort_seqs(seq_ids)
            for sid in seq_ids:
                self._seq_owner.pop(sid, None)
                if self.speculator is not None:
                    self.speculator.free(sid)

    def wait_for_background_compiles(self, load_cached: bool = False) -> None:
        """Block until the programs warm-up left to the background are compiled (the server
        waits for them before it listens: see async_engine); the wait is in startup_times.
        load_cached: also load the programs the executable cache holds (benchmarks)."""
        pending = self.runner.compile_manager.pending()
        if not pending:
            self.runner.wait_for_background_compiles(load_cached)
            return
        logger.info("Waiting for the %d programs compiling in the background before serving",
                    len(pending))
        t = time.perf_counter()
        self.runner.wait_for_background_compiles(load_cached)
        self.startup_times["background_compile"] = time.perf_counter() - t
        logger.info("Compiled them in %.1f s", self.startup_times["background_compile"])

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one model step (or a burst of num_scheduler_steps); return the
        outputs of the requests that progressed. With async scheduling what was just dispatched
        is read on the next call, so the host schedules and prepares the next step while the
        device runs this one (its input tokens are taken from the device)."""
        outputs: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        if self._burst_ready():
            cur = self._dispatch_burst(prev)
        else:
            if prev is not None and not self._can_overlap(prev):
                outputs += self._complete(prev)  # penalties need the real previous tokens
                prev = None
            drafts = (self.speculator.propose(self.scheduler.running)
                      if self.speculator is not None else None)
            sched = self.scheduler.schedule(drafts)
            cur = self.runner.dispatch(sched, _last(prev)) if sched.scheduled else None
            if cur is not None:
                self.scheduler.advance(sched)
        if prev is not None:
            outputs += self._complete(prev)
        if cur is not None:
            if self.args.async_scheduling:
                self._inflight = cur
            else:
                outputs += self._complete(cur)
        self._maybe_log_stats(time.monotonic())
        return outputs

    def _burst_ready(self) -> bool:
        """Whether the next num_scheduler_steps steps can run as one program: every running
        request is decoding with plain sampling, none waits, none can stop on length before the
        last step, the KV cache has their blocks, and the program is compiled (if not, its
        compile starts and this step runs alone)."""
        K, sched = self.args.num_scheduler_steps, self.scheduler
        if (K == 1 or self.args.enforce_eager or sched.num_waiting or not sched.running
                or len(sched.running) > sched.max_num_batched_tokens):
            return False
        need, bs = 0, sched.kv.block_size
        for r in sched.running:
            sp = r.sampling_params
            left = min(self.runner.model_config.max_model_len - r.num_tokens,
                       sp.max_tokens - r.num_output_tokens if sp.max_tokens else K)
            if (r.num_tokens - r.num_computed_tokens != 1 or left < K
                    or sp.logprobs is not None or r.needs_prompt_logprobs
                    or _reads_output_history(sp) or needs_processing(r)):
                return False
            need += -(-(r.num_computed_tokens + K) // bs) - len(sched.kv.get_block_ids(r.seq_id))
        if need > sched.kv.num_free_blocks:
            return False
        tensors = SamplingTensors.from_seqs(sched.running, pad_to=self.runner.max_num_seqs,
                                            vocab_size=self.runner.model_config.vocab_size,
                                            max_logprobs=self.runner.max_logprobs,
                                            penalty_width=0)
        return self.runner.burst_ready(self.runner.burst_key(len(sched.running), K, tensors),
                                       tensors)

    def _dispatch_burst(self, prev) -> list:
        """num_scheduler_steps decode steps in one program: each is scheduled and advanced on
        the host as usual (its input token is the step before's, still on the device; step 0's
        is prev's), then all are dispatched. Their tokens are resolved in order when read
        (tokens after a stop are dropped)."""
        steps = []
        for _ in range(self.args.num_scheduler_steps):
            sched = self.scheduler.schedule()
            assert len(sched.scheduled) == len(steps[0].inflight.seqs if steps else sched.scheduled)
            steps.append(self.runner.prepare_burst_step(
                sched, steps[-1].inflight if steps else _last(prev)))
            self.scheduler.advance(sched)
        return self.runner.dispatch_burst(steps, _last(prev))

    def _can_overlap(self, prev) -> bool:
        """The next step's sampling may not read output tokens still in flight, nor may its
        drafts be proposed without them (a step that may speculate reads them first), nor
        may a step follow one with drafts before it is known how many were accepted (the
        proposers' may_propose already says True there: the guard keeps it so for any)."""
        running = self.scheduler.running
        if self.speculator is not None and (
                any(s.spec_token_ids for s in _last(prev).sched.scheduled)
                or self.speculator.wants_tokens(running)):
            return False
        return not any(_reads_output_history(r.sampling_params) for r in running)

    def _complete(self, step) -> list[RequestOutput]:
        """Read a dispatched step's (or a burst's steps') tokens and turn them into outputs."""
        if isinstance(step, list):
            return [out for s in step for out in self._complete(s)]
        sched = step.sched
        sampled, prompt_logprobs = self.runner.collect(step)
        for seq_id, (first, positions) in prompt_logprobs.items():
            req = self._seq_owner.get(seq_id)
            if req is not None:  # else aborted since scheduling
                # A recompute after preemption rewrites the same values.
                req.prompt_logprobs[first:first + len(positions)] = [
                    self._logprob_dict(s.token, s) for s in positions]
        if self.speculator is not None:
            self.speculator.record(sched, sampled)
        kept = self.scheduler.resolve(sched, {rid: [s.token for s in results]
                                              for rid, results in sampled.items()})
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for item in sched.scheduled:
            seq = item.seq
            self._log_counts[0] += max(0, min(item.start + item.num_tokens,
                                              seq.num_prompt_tokens) - item.start)
            req = self._seq_owner.get(seq.seq_id)
            if req is None or seq.seq_id not in kept:
                continue
            state = next(c for c in req.seqs if c.seq is seq)
            n = kept[seq.seq_id]
            for j, s in enumerate(sampled[seq.seq_id][:n]):
                self._log_counts[1] += 1
                self.total_generation_tokens += 1
                stopped = self._record_token(state, s, last=j + 1 == n)
                self._advance_grammar(state, s.token)
                if stopped and j + 1 < n:  # a stop string inside accepted drafts: no token
                    del seq.output_token_ids[item.out_index + j + 1:item.out_index + n]
                    break                  # after it is kept
            req.metrics.setdefault("first_token_time", now)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            done = all(c.seq.is_finished and not c.seq.has_pending for c in req.seqs)
            if done:
                req.metrics["finished_time"] = now
                self._requests.pop(req.request_id, None)
                for c in req.seqs:
                    self._seq_owner.pop(c.seq.seq_id, None)
                    if self.speculator is not None:
                        self.speculator.free(c.seq.seq_id)
                self.total_prompt_tokens += len(req.prompt_token_ids)
            if done or req.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(req, done))
        return outputs

    def _advance_grammar(self, state: _SeqState, token: int) -> None:
        """The grammar takes the token; a complete grammar ends the sequence ("stop"), a dead
        end ends it with "error" and the matcher's message as stop_reason."""
        end = advance(state.seq, token)
        if end is None:
            return
        status, reason = end
        state.seq.stop_reason = reason
        self.scheduler.finish_seqs([state.seq.seq_id], status)
        if state.detok is not None:
            state.detok.flush()

    def _record_token(self, state: _SeqState, s, last: bool = True) -> bool:
        """Take one kept token. last: it is the step's last kept token (with accepted drafts a
        step keeps several, and the sequence's status, set by the scheduler, is that after
        the last). Returns whether a stop string ended the sequence at this token."""
        seq = state.seq
        token = s.token
        if state.logprobs is not None or s.logprob is not None:
            state.cumulative_logprob += float(s.logprob)
        if state.logprobs is not None:
            state.logprobs.append(self._logprob_dict(token, s))
        if state.detok is None:
            return False
        # Finished already here = ended by EOS or a stop token, whose text is left out.
        ended_by_token = last and seq.status == SequenceStatus.FINISHED_STOPPED
        _, stop_str = state.detok.add_tokens([token], stop_terminated=ended_by_token)
        stopped = stop_str is not None and not (last and seq.is_finished)
        if stopped:
            seq.stop_reason = stop_str
            if seq.is_finished:  # by a later token of the run: the stop string comes first
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_seqs([seq.seq_id], SequenceStatus.FINISHED_STOPPED)
        if stopped or (last and seq.is_finished):
            state.detok.flush()
        return stopped

    def _logprob_dict(self, token: int, s) -> dict[int, Logprob]:
        def dec(i):
            return decode_logprob_token(self.tokenizer, i) if self.tokenizer is not None else None
        out = {token: Logprob(float(s.logprob), int(s.rank), dec(token))}
        for rank, (tid, lp) in enumerate(s.top, start=1):
            out.setdefault(int(tid), Logprob(float(lp), rank, dec(int(tid))))
        return out

    def _make_output(self, req: Request, finished: bool) -> RequestOutput:
        """Everything so far (CUMULATIVE, FINAL_ONLY), or what is new since the request's last
        output (DELTA: text, token ids and logprobs from where the last one stopped)."""
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for i, c in enumerate(req.seqs):
            seq = c.seq
            text = c.detok.released_text if c.detok is not None else ""
            tokens = seq.resolved_output_token_ids
            chars, num = c.sent if delta else (0, 0)
            c.sent = (len(text), len(tokens))
            outs.append(CompletionOutput(
                index=i, text=text[chars:], token_ids=tokens[num:],
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=list(c.logprobs[num:]) if c.logprobs is not None else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        # Complete (and no longer written) once the sequence computing them has sampled; with
        # n > 1 another sequence may sample first.
        prompt_logprobs = (req.prompt_logprobs if req.seqs[0].seq.resolved_output_token_ids
                           and not (delta and req.prompt_logprobs_sent) else None)
        req.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids, prompt_logprobs=prompt_logprobs, outputs=outs,
            finished=finished, num_cached_tokens=req.seqs[0].seq.num_cached_tokens,
            metrics=dict(req.metrics))

    # --- stats -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        stats = {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_blocks,
            "prompt_tokens_total": self.total_prompt_tokens,
            "generation_tokens_total": self.total_generation_tokens,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
        load = self.runner.expert_load
        if load is not None:  # --enable-expert-load-metrics: {MoE layer: tokens per expert}
            stats["expert_load"] = dict(zip(self.runner.moe_layer_ids, load.copy()))
        return stats

    def _maybe_log_stats(self, now: float) -> None:
        if self.args.disable_log_stats or now - self._last_log < 5.0:
            return
        dt = now - self._last_log
        s = self.stats()
        q = s["prefix_cache_queries"]
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: "
            "%.1f%%", self._log_counts[0] / dt, self._log_counts[1] / dt, s["num_running"],
            s["num_waiting"], 100 * s["kv_cache_usage"], 100 * s["prefix_cache_hits"] / q if q else 0)
        self._last_log = now
        self._log_counts = [0, 0]
