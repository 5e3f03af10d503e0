"""The model runner: launch a step's programs on the device (`dispatch`) and read them back
(`collect`).

Two compiled functions run every step, each over a small set of shapes known at start-up:
  forward(state, kv_cache, token_ids[T], positions[T], metadata, logits_indices[R])
      -> (hidden rows to sample [R, E], all hidden states [T, E], kv_cache,
          expert load [MoE layers, experts] with --enable-expert-load-metrics, else None)
      T is a power-of-two token bucket; every other input has a fixed size (R = max_num_seqs
      sampled rows, times 1 + k with k speculative tokens; max_num_seqs rows of metadata, the
      full block-table width), so T alone picks the program. The cache is donated.
  sample(state, rows, num_rows, sampling tensors) -> sampled tokens (+ logprobs)
      for the first num_rows rows (a dynamic count: the cost follows it, the shape does not);
      the sampler's static variant picks the program (see jaxllm/layers/sampler.py).
A third, compiled on first use per T (steps computing prompt_logprobs only), gives each
target prompt token's logprob, rank and top max_logprobs at its hidden row; a fourth runs
num_scheduler_steps decode steps (forward and sampler) in one call (`burst`). The only
device-to-host transfers per step are the sampler's output (with the expert load, when
counted), the prompt logprobs when asked, and the logits with custom logits processors (the
sampler then splits around them: logits_processing.py). Speculative drafts are rows of one
sampler call; `collect` keeps the prefix matching them (jaxllm/spec_decode/acceptance.py).
`dispatch` launches a step and `collect` reads it, so the engine can dispatch step N+1 (its
in-flight input tokens read on the device from step N's output) before reading step N.

Host inputs come from jaxllm/worker/input_batch.py, programs from compile_manager.py (warm-up,
background compiles, the executable cache); every call goes through the StepLauncher (also
compile_manager.py), which runs it here, on the other hosts too, or not here at all.
--enforce-eager skips the warm-up and runs unpadded shapes through plain jit.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.layers.attention import empty_kv_caches, kv_cache_shardings
from jaxllm.layers.lora import fill_slot, write_slot
from jaxllm.layers.sampler import LOGIT_ROWS, SamplerOutput, gathered_token_logprobs, sample_rows
from jaxllm.models.vision_spec import bidirectional_images, mm_embed_width
from jaxllm.sequence import (EXTRA_PENALTY_IDS, SamplingTensors, SchedulerOutput, Sequence,
                             needs_processing, warmup_tensors)
from jaxllm.spec_decode.acceptance import num_accepted
from jaxllm.worker.compile_manager import CompileManager, ProgramKey, StepLauncher
from jaxllm.worker.encoder import ImageEncoder
from jaxllm.worker.executable_cache import ExecutableCache
from jaxllm.worker.kv_transfer import HostKVStore
from jaxllm.worker.logits_processing import ProcessedSampling
from jaxllm.worker.memory_tiers import MemoryTiers
from jaxllm.worker.input_batch import (BurstStep, Inflight, InputBatcher, PromptRows,
                                       SampleResult, StepEvent, StepHidden, StepInputs, bucket,
                                       prompt_logprob_targets, prompt_results, sample_result)

logger = logging.getLogger("jaxllm")


class ModelRunner(MemoryTiers):
    def __init__(self, model, model_config, mesh, *, num_blocks: int, block_size: int,
                 kv_cache_dtype, max_num_seqs: int, max_num_batched_tokens: int,
                 max_logprobs: int, enforce_eager: bool = False,
                 executable_dir: Optional[str] = None, num_scheduler_steps: int = 1,
                 num_speculative_tokens: int = 0, keep_hidden: bool = False,
                 logits_processors: tuple = ()):
        """keep_hidden: each dispatched step keeps its hidden states (`Inflight.hidden`) for an
        MTP drafter; logits_processors: custom ones (their steps sample in ProcessedSampling)."""
        self.model_config = model_config
        self.keep_hidden = keep_hidden
        self.num_scheduler_steps = num_scheduler_steps
        self.mesh = mesh
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_logprobs = max_logprobs
        self.enforce_eager = enforce_eager
        self.num_rows = max_num_seqs * (1 + num_speculative_tokens)  # sampled rows per step
        self.backend = backend = model.backend
        # Why this runner takes no images (None: it does, or the model takes none): the causal
        # Pallas kernel runs such a model's text and refuses its images by name.
        self.image_refusal = None
        if bidirectional_images(model_config) and backend.name == "pallas":
            self.image_refusal = (
                f"images are not supported by {model_config.architecture} with "
                "--attention-backend pallas (its image tokens attend bidirectionally, which the "
                "Pallas attention kernel does not take yet); use --attention-backend reference "
                "or cpu")
        self.input_batch = InputBatcher(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, max_model_len=model_config.max_model_len,
            enforce_eager=enforce_eager,
            # Decode steps get programs of their own (decode tiling) unless the attention is
            # the same for every step: then a decode step of T tokens runs the bucket T one.
            decode_programs=backend.decode_programs(kv_cache_dtype), num_rows=self.num_rows,
            num_speculative_tokens=num_speculative_tokens, lora=model_config.lora is not None,
            mm=((mm_embed_width(model_config), model_config.jnp_dtype)
                if model_config.vision or model_config.prompt_embeds else None),
            state_slots=bool(model_config.linear_layers),
            mrope=bool(model_config.mrope_section),
            image_spans=bidirectional_images(model_config) and self.image_refusal is None)
        self.penalty_width = model_config.max_model_len + EXTRA_PENALTY_IDS
        self.graphdef, state = nnx.split(model)
        self.encoder = ImageEncoder.of(self.graphdef, model_config)  # images (None: text only)
        self._relayout = backend.relayout
        self.state = backend.relayout(state, model_config)  # the weights as its ops read them
        self._offloaded = None  # sleep mode: the weights' host copy and shardings
        self.logit_rows = backend.logit_rows(model_config, LOGIT_ROWS)  # LM-head chunk sizes
        self.processed = ProcessedSampling(
            logits_processors, self.graphdef, model_config.vocab_size, max_logprobs,
            self.penalty_width, self.logit_rows) if logits_processors else None
        kv_shapes = model.kv_cache_shapes(num_blocks, block_size, state_slots=max_num_seqs)
        kv_sharding = kv_cache_shardings(kv_shapes, mesh)
        self._kv_layout = (kv_shapes, kv_cache_dtype, kv_sharding)
        self.kv_cache = empty_kv_caches(*self._kv_layout)  # one per group
        self.kv_store = HostKVStore()  # --kv-offloading-size: the host tier's saved blocks
        self.rows_sharding = NamedSharding(mesh, P())  # replicated: the sampler reads all rows
        # --enable-expert-load-metrics: tokens routed per expert, summed on the host as steps
        # are read (rows: model.moe_layer_ids); device counts of steps not read yet wait.
        self.moe_layer_ids = model.moe_layer_ids if model_config.count_expert_load else ()
        self.expert_load = (np.zeros((len(self.moe_layer_ids), model_config.num_experts),
                                     np.int64) if self.moe_layer_ids else None)
        self._unread_loads: list = []
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,),
                                out_shardings=(self.rows_sharding, self.rows_sharding,
                                               kv_sharding, self.rows_sharding))
        self._sample = jax.jit(self._sample_fn, out_shardings=self.rows_sharding)
        self._no_prev_tokens = jax.device_put(np.zeros(self.num_rows, np.int32),
                                              self.rows_sharding)
        self._write_slot = jax.jit(write_slot, static_argnums=3, donate_argnums=0)
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn,
                                        out_shardings=self.rows_sharding)
        self._burst = jax.jit(self._burst_fn, donate_argnums=(1,),
                              out_shardings=(self.rows_sharding, kv_sharding,
                                             self.rows_sharding))
        self.compile_manager = CompileManager(
            enforce_eager=enforce_eager,
            executable_cache=None if executable_dir is None else ExecutableCache(
                os.path.join(executable_dir, "jaxllm-executables"), mesh.devices.flat,
                context=repr((self.graphdef, self.logit_rows, self.max_logprobs))))
        self.launcher = StepLauncher(self.compile_manager)
        self._hooks: list[Callable[[StepEvent], None]] = []

    @property
    def num_recompiles(self) -> int:
        """Programs compiled after warm-up for a shape outside the buckets."""
        return self.compile_manager.num_recompiles

    def num_pending_compiles(self) -> int:
        """Programs warm-up left to the background that are not compiled yet."""
        return len(self.compile_manager.pending())

    def wait_for_background_compiles(self, load_cached: bool = False) -> Optional[float]:
        """Block until background compiles (and with load_cached, cached loads) are done."""
        return self.compile_manager.wait_for_background_compiles(load_cached)

    def startup_arrays(self) -> tuple:
        """The device arrays made at start-up that steps take (the KV cache, the no-previous-
        tokens input): multi-host ranks number them, then every step output, alike."""
        return self.kv_cache, self._no_prev_tokens

    def weights(self) -> tuple:
        """The weight trees step programs take (multi-host ranks name them, not send them)."""
        return (self.state,)

    def program(self, key: ProgramKey):
        """The jitted function of a ProgramKey (what a follower host runs it with)."""
        return {"forward": self._forward, "sample": self._sample,
                "prompt_logprobs": self._prompt_logprobs, "burst": self._burst}[key.kind]

    def replay(self, key: ProgramKey, args: tuple):
        """A follower host's run of rank 0's call key(*args)."""
        if key.kind == "lora_write":
            return self._write_lora_here(*args)
        return self.launcher.run(key, self.program(key), *args, first_use=True)

    def lead_hosts(self, leader) -> None:
        """Multi-host rank 0: from now on every step-program call is also sent to the other
        hosts (leader: a StepLeader of jaxllm/parallel/step_channel.py), which replay it."""
        self.launcher.lead_hosts(leader)

    def write_lora_slot(self, slot: int, weights: dict) -> None:
        """Put a LoRA adapter in device slot `slot` (between steps). A call of the launcher:
        on several hosts every host writes the slot (the adapter's host arrays go down the
        step channel, so only rank 0 reads adapter folders), before the steps that use it."""
        self.launcher.call(ProgramKey("lora_write"), self._write_lora_here, slot, weights)

    def _write_lora_here(self, slot: int, weights: dict) -> None:
        """This host's share of write_lora_slot (`fill_slot`: the state updated in place, so
        the step channel's weights names stay valid)."""
        fill_slot(self.state["layers"], slot, weights, self._write_slot)

    def add_step_hook(self, hook: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call hook(StepEvent) after every launch and every read; returns its remover."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook)

    def _notify(self, event: StepEvent) -> None:
        for hook in list(self._hooks):
            hook(event)

    # --- the jitted functions ----------------------------------------------------------------
    def _forward_fn(self, state, kv_cache, token_ids, positions, md, logits_indices,
                    prev_tokens, from_prev, lora_slots=None, mm_embeds=None):
        model = nnx.merge(self.graphdef, state)
        token_ids = jnp.where(from_prev >= 0, prev_tokens[jnp.maximum(from_prev, 0)], token_ids)
        load = None
        if self.moe_layer_ids:
            hidden, kv_cache, load = model.forward_counting_experts(
                kv_cache, token_ids, positions, md, lora_slots, mm_embeds)
        else:
            hidden, kv_cache = model(kv_cache, token_ids, positions, md, lora_slots, mm_embeds)
        return hidden[logits_indices], hidden, kv_cache, load

    def _sample_fn(self, state, rows, num_rows, tensors):
        model = nnx.merge(self.graphdef, state)
        return sample_rows(rows, num_rows, model.compute_logits, tensors,
                           logit_rows=self.logit_rows, greedy_head=model.greedy_head,
                           draw=model.backend.draw())

    def _prompt_logprobs_fn(self, state, hidden, row_idx, target_ids, num_rows):
        model = nnx.merge(self.graphdef, state)
        return gathered_token_logprobs(hidden, row_idx, target_ids, num_rows,
                                       model.compute_logits, self.max_logprobs)

    def _burst_fn(self, state, kv_cache, token_ids, positions, md, logits_indices, from_prev,
                  num_rows, tensors, prev_tokens, lora_slots=None):
        """K decode steps in one call (multi-step scheduling): each step's inputs are stacked on
        a leading K axis, step k's in-flight tokens are step k-1's samples and step 0's are
        prev_tokens (the samples of the step dispatched before, still on the device). Each
        step's tokens come back as their own array, so the next call can start from the last;
        the K steps' expert loads come back summed (None when not counted)."""
        def step(carry, xs):
            kv, prev_tokens = carry
            tok, pos, m, li, fp, n, t, ls = xs
            rows, _, kv, load = self._forward_fn(state, kv, tok, pos, m, li, prev_tokens, fp, ls)
            sampled = self._sample_fn(state, rows, n, t).token_ids
            return (kv, sampled), (sampled, load)

        xs = (token_ids, positions, md, logits_indices, from_prev, num_rows, tensors, lora_slots)
        (kv_cache, _), (tokens, loads) = lax.scan(step, (kv_cache, prev_tokens), xs)
        return tuple(tokens), kv_cache, None if loads is None else loads.sum(0)

    # --- host side ---------------------------------------------------------------------------
    def _prev_tokens(self, prev: Optional[Inflight]):
        """prev's sampled tokens, on the device (zeros when nothing was sampled)."""
        return prev.out.token_ids if prev is not None and prev.out is not None \
            else self._no_prev_tokens

    def _prepare(self, sched: SchedulerOutput, prev: Optional[Inflight]):
        if sched.kv_transfers:  # KV to and from the host tier, before the step writes
            self.kv_cache = self.kv_store.apply(self.kv_cache, sched.kv_transfers)
        mm_rows = self.encoder.step_rows(sched, self.state) if self.encoder else None
        return self.input_batch.prepare(sched, prev.seqs if prev is not None else [],
                                        self._prev_tokens(prev), mm_rows)

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        return SamplingTensors.from_seqs(seqs, pad_to=self.num_rows,
                                         vocab_size=self.model_config.vocab_size,
                                         max_logprobs=self.max_logprobs,
                                         penalty_width=self.penalty_width)

    def dispatch(self, sched: SchedulerOutput, prev: Optional[Inflight] = None) -> Inflight:
        """Launch one step on the device without waiting for it. A PENDING input token (the
        sampled token of `prev`, not read yet) is taken from prev's device output in the step."""
        step = self._prepare(sched, prev)
        inputs = step.inputs
        key = ProgramKey("forward", inputs.token_ids.shape[0], inputs.metadata.decode_only)
        rows, hidden, load = self._run_forward(key, inputs)
        prompt = self._compute_prompt_logprobs(hidden, step.prompt_rows) \
            if step.prompt_rows else None
        out = None
        if step.seqs and self.processed is not None:
            out = self.processed.sample(self.state, rows, step.seqs)
        elif step.seqs:
            tensors = self._sampling_tensors(step.seqs)
            key = ProgramKey("sample", sampler=jax.tree_util.tree_structure(tensors))
            out = self.launcher.run(key, self._sample, self.state, rows,
                                           np.int32(len(step.seqs)), tensors)
        inflight = Inflight(sched, step.seqs, out, step.prompt_rows, prompt, load,
                            StepHidden(hidden, inputs.positions, inputs.metadata)
                            if self.keep_hidden else None)
        self._notify(StepEvent("dispatch", [inflight], chained=prev is not None))
        return inflight

    def _run_forward(self, key: ProgramKey, inputs: StepInputs):
        """Launch the forward program(s) of a step: (rows to sample, all hidden states, expert
        load or None), the KV cache updated (a pipeline runs one program per stage here)."""
        rows, hidden, self.kv_cache, load = self.launcher.run(
            key, self._forward, self.state, self.kv_cache, *inputs)
        return rows, hidden, load

    def prepare_burst_step(self, sched: SchedulerOutput, prev: Optional[Inflight]) -> BurstStep:
        """One step of a burst, prepared on the host as it is scheduled (before the scheduler
        advances past it); its in-flight input tokens come from `prev`, the step before."""
        step = self._prepare(sched, prev)
        return BurstStep(Inflight(sched, step.seqs, None, [], None), step.inputs,
                         self._sampling_tensors(step.seqs))

    def burst_key(self, num_seqs: int, num_steps: int, tensors: SamplingTensors) -> ProgramKey:
        return ProgramKey("burst", bucket(num_seqs, self.input_batch.decode_buckets),
                          steps=num_steps, sampler=jax.tree_util.tree_structure(tensors))

    def burst_ready(self, seqs: list[Sequence], num_steps: int) -> bool:
        """Whether these decoding sequences' next num_steps tokens can be sampled in one
        program: plain sampling only (no logprobs, nothing that reads the output tokens or
        processes the logits: each step's token would be needed on the host), and the
        program compiled; if it is not, its compile starts in the background (the engine
        runs single steps meanwhile). The scheduler has checked the KV cache and lengths."""
        if num_steps == 1 or self.enforce_eager or any(
                r.sampling_params.logprobs is not None or r.needs_prompt_logprobs
                or r.sampling_params.needs_output_history or needs_processing(r) for r in seqs):
            return False
        tensors = SamplingTensors.from_seqs(seqs, pad_to=self.max_num_seqs,
                                            vocab_size=self.model_config.vocab_size,
                                            max_logprobs=self.max_logprobs, penalty_width=0)
        key = self.burst_key(len(seqs), num_steps, tensors)
        return self.compile_manager.ready(
            key, self._burst, lambda: self._burst_example_args(key.tokens, key.steps, tensors))

    def _burst_example_args(self, T: int, K: int, tensors: SamplingTensors) -> tuple:
        stack = lambda tree: jax.tree.map(lambda a: np.stack([np.asarray(a)] * K), tree)  # noqa
        pad = self.input_batch.padding(T, self.input_batch.decode_programs, None)
        return (self.state, self.kv_cache,
                *stack((pad.token_ids, pad.positions, pad.metadata, pad.logits_indices,
                        pad.from_prev, np.int32(0), tensors)),
                self._no_prev_tokens, stack(pad.lora_slots))

    def dispatch_burst(self, steps: list[BurstStep],
                       prev: Optional[Inflight] = None) -> list[Inflight]:
        """Launch prepared steps (same sequences, one token each) as one program without
        waiting for it; step 0's in-flight input tokens come from prev, the step dispatched
        before. Returns the steps' Inflights, each holding its step's tokens on the device."""
        stack = lambda *xs: np.stack([np.asarray(x) for x in xs])  # noqa: E731
        inputs = [s.inputs._replace(prev_tokens=None, mm_embeds=None) for s in steps]
        token_ids, positions, md, logits_indices, _, from_prev, lora_slots, _ = jax.tree.map(
            stack, *inputs)
        num_rows = np.array([len(s.inflight.seqs) for s in steps], np.int32)
        tensors = jax.tree.map(stack, *[s.tensors for s in steps])
        key = self.burst_key(len(steps[0].inflight.seqs), len(steps), steps[0].tensors)
        tokens, self.kv_cache, load = self.launcher.run(
            key, self._burst, self.state, self.kv_cache, token_ids, positions, md,
            logits_indices, from_prev, num_rows, tensors, self._prev_tokens(prev), lora_slots)
        for s, t in zip(steps, tokens):
            s.inflight.out = SamplerOutput(t)
        steps[0].inflight.expert_load = load  # all K steps' routes, read with step 0's tokens
        inflights = [s.inflight for s in steps]
        self._notify(StepEvent("burst", inflights, chained=prev is not None))
        return inflights

    def collect(self, step: Inflight) -> tuple[dict[str, list[SampleResult]], dict[str, tuple]]:
        """Wait for a dispatched step. Returns the sampled tokens (and logprobs) of each
        sequence that samples: one, or with drafts the accepted ones and the token after
        them; and {seq_id: (first, [SampleResult per prompt token first, first + 1, ...])}
        for the prompt positions computed for prompt_logprobs."""
        sampled: dict[str, list[SampleResult]] = {}
        if step.expert_load is not None:
            self._unread_loads.append(step.expert_load)
        if step.out is not None:
            out, loads = jax.device_get((self.launcher.to_reader(step.out), self._unread_loads))
            for i, seq in enumerate(step.seqs):
                sampled.setdefault(seq.seq_id, []).append(sample_result(out, i, seq))
            for s in step.sched.scheduled:
                rows = sampled.get(s.seq.seq_id)
                if s.spec_token_ids and rows:
                    del rows[num_accepted([r.token for r in rows], s.spec_token_ids) + 1:]
            if loads:  # one transfer with the tokens: counting adds no wait of its own
                self.expert_load += np.sum(loads, axis=0)
                self._unread_loads = []
        prompt = (prompt_results(jax.device_get(self.launcher.to_reader(step.prompt)),
                                  step.prompt_rows)
                  if step.prompt_rows else {})
        self._notify(StepEvent("collect", [step], sampled=sampled, prompt_logprobs=prompt))
        return sampled, prompt

    def _compute_prompt_logprobs(self, hidden, prompt_rows: list[PromptRows]):
        """Dispatch the prompt-logprobs program on this step's hidden states [T, E]."""
        T = hidden.shape[0]
        return self.launcher.run(
            ProgramKey("prompt_logprobs", T), self._prompt_logprobs, self.state, hidden,
            *prompt_logprob_targets(T, prompt_rows), first_use=True)

    # --- warm-up -----------------------------------------------------------------------------
    def warmup(self, greedy_only: bool = False, background: bool = True) -> None:
        """Compile every token bucket and the plain sampler variants on all cores. The sampler
        variants with penalties, logprobs or top-k/top-p filters, and the multi-step programs,
        compile after that in a background thread, so the engine is ready sooner; a step that
        needs one before then compiles it or waits for it (which is not a recompile).
        greedy_only: the plain greedy sampler alone (a draft model's runner, which never samples
        otherwise: jaxllm/spec_decode/draft_model.py). background=False leaves the deferred
        programs to their first use (a follower host, which compiles what rank 0 calls: a
        background compile still running when rank 0 stops would hold its exit, and with 4
        processes on 2 busy cores the followers missed jax's shutdown barrier)."""
        if self.enforce_eager:
            return
        cm, shapes = self.compile_manager, self.input_batch.forward_shapes()
        here = self.launcher.runs_here  # another host's programs are its to compile
        tensors = warmup_tensors(self.num_rows, self.model_config.vocab_size,
                                 max_logprobs=self.max_logprobs,
                                 penalty_width=self.penalty_width)
        if greedy_only:
            tensors = [(True, t) for is_plain, t in tensors if is_plain and t.all_greedy]
        samplers = [(ProgramKey("sample", sampler=jax.tree_util.tree_structure(t)), is_plain, t)
                    for is_plain, t in tensors]
        plain = [t for _, is_plain, t in samplers if is_plain]

        def jobs():
            yield from self._forward_jobs(shapes)
            rows = self._rows_spec()
            for key, is_plain, t in samplers:
                if is_plain:
                    yield key, self._sample, (self.state, rows, np.int32(0), t)
                elif here(key):
                    cm.defer(key, self._sample, (self.state, rows, np.int32(0), t))

        total = len(shapes) * self.programs_per_step + sum(here(key) for key, is_plain, _
                                                           in samplers if is_plain)
        cm.compile_now(self.launcher.here(jobs()), total=total)
        K = self.num_scheduler_steps
        for t in plain if K > 1 else ():  # multi-step programs, after the rest
            for T in self.input_batch.decode_buckets:
                key = self.burst_key(T, K, t)
                if here(key):
                    cm.defer(key, self._burst, self._burst_example_args(T, K, t))
        if background:
            cm.start_background()
        logger.info("Compiled %d forward shapes (token buckets %s, decode buckets %s) and %d "
                    "sampler variants (%d more programs in the background); %d found in the "
                    "executable cache", len(shapes), self.input_batch.token_buckets,
                    self.input_batch.decode_buckets, len(plain), len(cm.deferred()),
                    cm.programs_from_cache)

    programs_per_step = 1  # forward programs per step compiled here (a pipeline's: per stage)

    def _forward_jobs(self, shapes: list[tuple[int, bool]]):
        """(key, function, example arguments) of the forward program of each shape."""
        for T, decode_only in shapes:
            args = (self.state, self.kv_cache,
                    *self.input_batch.padding(T, decode_only, self._no_prev_tokens))
            yield ProgramKey("forward", T, decode_only), self._forward, args

    def _rows_spec(self) -> jax.ShapeDtypeStruct:
        """The rows forward hands the sampler (what warm-up compiles the sampler for)."""
        args = (self.state, self.kv_cache,
                *self.input_batch.padding(1, False, self._no_prev_tokens))
        rows = jax.eval_shape(self._forward_fn, *args)[0]
        return jax.ShapeDtypeStruct(rows.shape, rows.dtype, sharding=self.rows_sharding)

