"""From sampled tokens to `RequestOutput`s: detokenizing, stop strings, logprobs, the DELTA
and FINAL_ONLY output kinds, and the fan-in of a request's n sequences.

The processor owns the requests the engine is running and their output state; it never
changes a sequence's status. What it finds that ends a sequence (a stop string in the text,
the grammar's end or dead end) it returns as a `Stop` for the scheduler to apply, and it
builds the outputs only after the scheduler has, so each output reads the final status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from jaxllm.engine.detokenizer import IncrementalDetokenizer, decode_logprob_token
from jaxllm.engine.grammar import advance
from jaxllm.engine.input_processor import EngineRequest
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import RequestOutputKind
from jaxllm.sequence import SchedulerOutput, Sequence, SequenceStatus, Stop


@dataclass
class _SeqState:
    """One sequence of a request and what is built of its output."""
    seq: Sequence
    detok: Optional[IncrementalDetokenizer]
    logprobs: Optional[list] = None
    cumulative_logprob: float = 0.0
    sent: tuple[int, int] = (0, 0)  # text chars, tokens given out (DELTA outputs)


@dataclass
class _Request:
    """A running request: what came in, and its n sequences' output state."""
    req: EngineRequest
    seqs: list[_SeqState]
    metrics: dict
    prompt_logprobs: Optional[list] = None  # per prompt token; filled as positions compute
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._owner: dict[str, _Request] = {}  # seq_id -> its request
        self._touched: dict[str, _Request] = {}  # progressed in the step being recorded
        self.num_generation_tokens = 0  # kept tokens, since start

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        """The requests not finished yet."""
        return list(self._requests)

    def add_request(self, req: EngineRequest) -> list[Sequence]:
        """Fan the request out into its n sequences (they share the prompt, and through the
        prefix cache its KV blocks); returns them for the scheduler."""
        p = req.params
        state = _Request(req, [], {"arrival_time": req.arrival_time},
                         [None] * len(req.prompt_token_ids)
                         if p.prompt_logprobs is not None else None)
        for i, seed in enumerate(req.seeds):
            seq_id = req.request_id if p.n == 1 else f"{i}_{req.request_id}"
            seq = Sequence(seq_id, list(req.prompt_token_ids), p, eos_token_ids=req.eos_token_ids,
                           arrival_time=req.arrival_time, priority=req.priority, seed=seed,
                           computes_prompt_logprobs=i == 0 and p.prompt_logprobs is not None,
                           grammar=req.grammar.matcher() if req.grammar is not None else None,
                           lora_request=req.lora_request, mm=req.mm)
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids,
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens,
                    stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
                    min_tokens=p.min_tokens)
            state.seqs.append(_SeqState(seq, detok, [] if p.logprobs is not None else None))
            self._owner[seq_id] = state
        self._requests[req.request_id] = state
        return [c.seq for c in state.seqs]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids (for the scheduler), [] if unknown."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        return self._forget(state)

    def _forget(self, state: _Request) -> list[str]:
        ids = [c.seq.seq_id for c in state.seqs]
        for sid in ids:
            self._owner.pop(sid, None)
        return ids

    # --- a step's tokens -----------------------------------------------------------------
    def record_prompt_logprobs(self, prompt_logprobs: dict) -> None:
        """{seq_id: (first position, [SampleResult per position])}; a recompute after
        preemption rewrites the same values."""
        for seq_id, (first, positions) in prompt_logprobs.items():
            state = self._owner.get(seq_id)
            if state is not None:  # else aborted since scheduling
                state.prompt_logprobs[first:first + len(positions)] = [
                    self._logprob_dict(s.token, s) for s in positions]

    def record_tokens(self, sched: SchedulerOutput, sampled: dict, kept: dict[str, int],
                      now: float) -> list[Stop]:
        """Take the tokens the scheduler kept for each sequence of the step (text, logprobs,
        grammar); returns the stops found, for the scheduler to apply before `outputs()`."""
        stops = []
        for item in sched.scheduled:
            seq = item.seq
            state = self._owner.get(seq.seq_id)
            if state is None or seq.seq_id not in kept:
                continue
            c = next(c for c in state.seqs if c.seq is seq)
            n = kept[seq.seq_id]
            for j, s in enumerate(sampled[seq.seq_id][:n]):
                self.num_generation_tokens += 1
                stop = self._record_token(c, s, last=j + 1 == n)
                if stop is None and seq.grammar is not None:
                    stop = self._advance_grammar(c, s.token)
                if stop is not None:
                    if j + 1 < n:  # a stop string inside accepted drafts: drop what follows
                        stop.drop_from, stop.drop_to = item.out_index + j + 1, item.out_index + n
                    stops.append(stop)
                    break
            state.metrics.setdefault("first_token_time", now)
            self._touched[state.req.request_id] = state
        return stops

    def outputs(self, now: float) -> tuple[list[RequestOutput], list[str], int]:
        """The outputs of the requests the step touched (statuses final); returns them, the
        sequence ids of requests now finished (forgotten here), and their prompt tokens."""
        outputs, done_ids, prompt_tokens = [], [], 0
        touched, self._touched = self._touched, {}
        for rid, state in touched.items():
            done = all(c.seq.is_finished and not c.seq.has_pending for c in state.seqs)
            if done:
                state.metrics["finished_time"] = now
                self._requests.pop(rid, None)
                done_ids += self._forget(state)
                prompt_tokens += len(state.req.prompt_token_ids)
            if done or state.req.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(state, done))
        return outputs, done_ids, prompt_tokens

    def _advance_grammar(self, c: _SeqState, token: int) -> Optional[Stop]:
        """The grammar takes the token; complete, it ends the sequence ("stop"); at a dead end
        it ends it with "error" and the matcher's message as stop_reason."""
        end = advance(c.seq, token)
        if end is None:
            return None
        if c.detok is not None:
            c.detok.flush()
        return Stop(c.seq, *end)

    def _record_token(self, c: _SeqState, s, last: bool) -> Optional[Stop]:
        """Take one kept token. last: the step's last kept token (with accepted drafts a step
        keeps several, and the status the scheduler set is that after the last). Returns the
        stop if a stop string ended the sequence at this token."""
        seq, token = c.seq, s.token
        if c.logprobs is not None or s.logprob is not None:
            c.cumulative_logprob += float(s.logprob)
        if c.logprobs is not None:
            c.logprobs.append(self._logprob_dict(token, s))
        if c.detok is None:
            return None
        # Finished already here = ended by EOS or a stop token, whose text is left out.
        ended_by_token = last and seq.status == SequenceStatus.FINISHED_STOPPED
        _, stop_str = c.detok.add_tokens([token], stop_terminated=ended_by_token)
        stopped = stop_str is not None and not (last and seq.is_finished)
        if stopped or (last and seq.is_finished):
            c.detok.flush()
        if not stopped:
            return None
        return Stop(seq, SequenceStatus.FINISHED_STOPPED, stop_str, override=True)

    def _logprob_dict(self, token: int, s) -> dict[int, Logprob]:
        def dec(i):
            return decode_logprob_token(self.tokenizer, i) if self.tokenizer is not None else None
        out = {token: Logprob(float(s.logprob), int(s.rank), dec(token))}
        for rank, (tid, lp) in enumerate(s.top, start=1):
            out.setdefault(int(tid), Logprob(float(lp), rank, dec(int(tid))))
        return out

    def _make_output(self, state: _Request, finished: bool) -> RequestOutput:
        """Everything so far (CUMULATIVE, FINAL_ONLY), or what is new since the request's last
        output (DELTA: text, token ids and logprobs from where the last one stopped)."""
        req = state.req
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for i, c in enumerate(state.seqs):
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
        prompt_logprobs = (state.prompt_logprobs if state.seqs[0].seq.resolved_output_token_ids
                           and not (delta and state.prompt_logprobs_sent) else None)
        state.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids, prompt_logprobs=prompt_logprobs, outputs=outs,
            finished=finished, num_cached_tokens=state.seqs[0].seq.num_cached_tokens,
            metrics=dict(state.metrics), lora_request=req.lora_request)
