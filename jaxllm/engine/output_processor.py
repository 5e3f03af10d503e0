"""From sampled tokens to `RequestOutput`s: detokenizing, stop strings, logprobs, the DELTA
and FINAL_ONLY output kinds, and the fan-in of a request's n sequences.

The processor owns the requests the engine is running and their output state; it never
changes a sequence's status. What it finds that ends a sequence (a stop string in the text,
the grammar's end or dead end) it returns as a `Stop` for the scheduler to apply, and it
builds the outputs only after the scheduler has, so each output reads the final status.

The detokenizer (`IncrementalDetokenizer`, below) turns token ids into streamed text deltas,
with stop strings, as vLLM's incremental detokenizer.

Each new token is decoded within a short window of ids (vLLM's prefix/read offsets): the text of
ids[prefix:] minus the text of ids[prefix:read] is the new text, so leading spaces and merges come
out as in a full decode, and a window whose text ends in U+FFFD (a UTF-8 character split across
tokens) is held until the character completes. Stop strings are searched in the text, across
token boundaries; text that could still become a stop string is held back from the delta until
it either completes (the output ends before it) or stops matching (the text is released).

With a fast (Rust-backed) tokenizer, as vLLM's FastIncrementalDetokenizer, a token is one step of
tokenizers' DecodeStream, primed with the same prompt ids: one native call, where the window
takes two decodes through transformers per token, host time paid on every decode step
(docs/performance.md, "The decode step's host work and sampler").
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import tokenizers
from tokenizers.decoders import DecodeStream

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
        self.num_prompt_positions = 0  # prompt positions computed since start (recomputes too)

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
                           grammar=(req.grammar.matcher(p.structured_outputs.after_reasoning)
                                    if req.grammar is not None else None),
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
            self.num_prompt_positions += max(
                0, min(item.start + item.num_tokens, seq.num_prompt_tokens) - item.start)
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


# --- the incremental detokenizer ---------------------------------------------------------------

logger = logging.getLogger("jaxllm")

_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (vLLM uses 5)


class IncrementalDetokenizer:
    """One sequence's output text. `text` is everything decoded so far (cut at a stop string);
    the deltas returned by `add_tokens` and `flush` concatenate to it, and `released_text` is
    their concatenation so far."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._decode_kwargs = dict(skip_special_tokens=skip_special_tokens,
                                   spaces_between_special_tokens=spaces_between_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT - 2:])
        self._read = len(self._ids)
        self._prefix = max(self._read - _PROMPT_CONTEXT, 0)
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_output = 0
        self._emitted = 0
        self.text = ""
        self._stream = _decode_stream(tokenizer, self._ids, skip_special_tokens,
                                      spaces_between_special_tokens)

    def add_tokens(self, new_ids: list[int], *, stop_terminated: bool = False
                   ) -> tuple[str, Optional[str]]:
        """Decode new_ids -> (delta text, the stop string that ended the output or None).
        stop_terminated: the last id is the eos/stop token that ended the request, so its text
        is left out (unless include_stop_str_in_output) and nothing is held back."""
        ids = list(new_ids)
        if stop_terminated and not self._include_stop and ids:
            ids.pop()
            self._num_output += 1
        check_from = len(self.text)
        for token_id in ids:
            self.text += self._decode_next(token_id)
            self._num_output += 1
            if self._num_output <= self._min_tokens:
                check_from = len(self.text)  # vLLM: no stop strings within min_tokens
        found = None
        if self._stop and self._num_output > self._min_tokens:
            found = _find_stop(self.text, check_from, self._stop, self._include_stop)
            if found:
                self.text = self.text[:found[1]]
        if found or stop_terminated or self._include_stop:
            return self.flush(), found and found[0]
        release = len(self.text) - _partial_stop_len(self.text, self._stop)
        delta = self.text[self._emitted:release]
        self._emitted = max(self._emitted, release)
        return delta, None

    @property
    def streams(self) -> bool:
        """Which path decodes: True, tokenizers' DecodeStream (one native call a token); False,
        the decoded window (a slow tokenizer, or options the stream cannot honour)."""
        return self._stream is not None

    @property
    def released_text(self) -> str:
        """The text given out so far: `text` minus what is held back (for cumulative streams)."""
        return self.text[:self._emitted]

    def flush(self) -> str:
        """The text still held back; call when the request ends without a stop string."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            return self._step(token_id) or ""
        self._ids.append(token_id)
        decode = functools.partial(self._tokenizer.decode, **self._decode_kwargs)
        prefix_text = decode(self._ids[self._prefix:self._read])
        new_text = decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        del self._ids[:self._read]  # the next window starts at the old read offset
        self._prefix, self._read = 0, len(self._ids)
        return new_text[len(prefix_text):]

    def _step(self, token_id: int) -> Optional[str]:
        stream, backend = self._stream
        try:
            return stream.step(backend, token_id)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            if not str(e).startswith("Invalid prefix"):
                raise
            # A tokenizer whose text of ids is not a prefix of that of more ids breaks the
            # stream's state (vLLM issue 17448): start a new one from this token.
            logger.warning("detokenizer: %s; the decode stream restarts at token %d", e,
                           token_id)
            stream = DecodeStream(skip_special_tokens=self._decode_kwargs["skip_special_tokens"])
            self._stream = (stream, backend)
            return stream.step(backend, token_id)


def _decode_stream(tokenizer, context: list[int], skip_special_tokens: bool,
                   spaces_between_special_tokens: bool):
    """(DecodeStream primed with context, the Rust tokenizer), or None where the stream would
    not give tokenizer.decode's text: a slow tokenizer, decode-time clean-up of spaces, or
    special tokens kept without spaces between them."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(backend, tokenizers.Tokenizer)
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)
            or not (skip_special_tokens or spaces_between_special_tokens)):
        return None
    try:
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens), backend
    except TypeError:  # a tokenizers release whose DecodeStream cannot be primed with ids
        return None


def _find_stop(text: str, check_from: int, stop: list[str], include: bool):
    """The earliest stop string ending after check_from -> (it, where text ends), or None.
    (vLLM takes the first one in list order; earliest in the text is what a reader expects.)"""
    best = None
    for s in stop:
        i = text.find(s, max(0, check_from - len(s) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, i + len(s) if include else i


def _partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest end of text that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@functools.lru_cache(maxsize=1 << 18)
def decode_logprob_token(tokenizer, token_id: int) -> str:
    """`Logprob.decoded_token`: the token decoded alone, special tokens kept, as vLLM does
    (a piece of a UTF-8 character comes out as U+FFFD). Cached: logprobs ask for many per step."""
    return tokenizer.decode([token_id])
