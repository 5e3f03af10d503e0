"""The pipeline-parallel model runner: a step's forward runs as one program per stage, each on
its stage's sub-mesh, the hidden states handed from stage to stage with `jax.device_put`.

Stage s holds layers [start_s, end_s) (its weights and its KV cache only, jaxllm/models/
pipeline_stage.py); stage 0 also embeds, the last stage applies the final norm and hands its
rows to the sampler, which runs there too (as do prompt logprobs): everything after the
forward is the plain `ModelRunner`'s, on the last stage's model.

Why one program per stage and a device-to-device copy, not one SPMD program with a `stage`
mesh axis and `ppermute`: the pipeline's point is that stage s works on step k while stage
s+1 works on step k-1. Separate programs get that from JAX's asynchronous dispatch alone (the
engine's step policy keeps up to N steps in flight): each stage's device queue runs its
programs in order, and a program waits only for its own input. One SPMD program
would run every stage in lockstep on the same step's schedule, so overlapping steps would
need a hand-written micro-batch schedule inside it, stages would have to be identical (the
first embeds, the last samples) and every step would pay the slowest stage N times. The
handoff is one [T, hidden] array per stage boundary per step (its cost: docs/multi-host.md).

Across hosts (one or more stages per host, --nnodes) the same `jax.device_put` moves the
hidden states: JAX's cross-host transfer server (jaxllm/parallel/distributed.py enables it)
sends them from one process's devices to the other's, and the step channel replays every
call, transfers included, on every host in rank 0's order (docs/multi-host.md, 'Pipeline
parallelism across hosts', has what was tried and its cost). A `ppermute` over a ('stage',
'model') mesh spanning the processes would work too, but it is one program on every device, so
all hosts would meet in it every step: the lockstep this design avoids. A host
never compiles or runs another host's stage program: its call makes placeholders of the
outputs (arrays without local shards) to pass on. The sampled tokens come back to rank 0 the
same way when it reads them (`to_reader`, from `collect`: a receiving host's `device_put`
waits for the sender to issue its side, so at dispatch it would hold rank 0's next step until
the last stage's host got there). Both rules are this runner's StepLauncher's (jaxllm/worker/
compile_manager.py: `elsewhere` and `reader`, given when it is made).

Every step dispatches all stages without waiting; only the sampled tokens are read back
(`collect`). `start_timeline` records when each stage is busy (jaxllm/worker/
pipeline_timeline.py).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.layers.attention import empty_kv_caches, kv_cache_shardings
from jaxllm.layers.lora import fill_slot
from jaxllm.models.pipeline_stage import stage_forward, stage_lora_share
from jaxllm.parallel.pipeline import is_local
from jaxllm.worker.compile_manager import ProgramKey, StepLauncher
from jaxllm.worker.input_batch import StepInputs
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.pipeline_timeline import StageTimeline

logger = logging.getLogger("jaxllm")


class PipelineRunner(ModelRunner):
    def __init__(self, stages: list, meshes: list[Mesh], model_config, *, num_blocks: int,
                 block_size: int, kv_cache_dtype, stage_cuts: Optional[list] = None, **kwargs):
        """stages: the stage models (`split_stage`), meshes: their sub-meshes, stage_cuts:
        each stage's groups as the model's (`pipeline_stage.stage_cuts`; needed with LoRA
        slots). The other keyword arguments are ModelRunner's (without executable_dir: stage
        programs are not cached on disk)."""
        # The plain runner's parts (sampler, prompt logprobs, compile manager) run on the
        # last stage; its forward program is replaced by the stages' (`_run_forward`).
        super().__init__(stages[-1], model_config, meshes[-1], num_blocks=num_blocks,
                         block_size=block_size, kv_cache_dtype=kv_cache_dtype, **kwargs)
        self.meshes = meshes
        self.stage_cuts = stage_cuts
        self.stage_graphdefs, self.stage_states, self.stage_kv = [], [], []
        for model, mesh in zip(stages[:-1], meshes[:-1]):
            graphdef, state = nnx.split(model)
            shapes = model.kv_cache_shapes(num_blocks, block_size)
            self.stage_graphdefs.append(graphdef)
            self.stage_states.append(model.backend.relayout(state, model.cfg))
            self.stage_kv.append(empty_kv_caches(shapes, kv_cache_dtype,
                                                 kv_cache_shardings(shapes, mesh)))
        self.stage_graphdefs.append(self.graphdef)
        self.stage_states.append(self.state)
        self.stage_kv.append(self.kv_cache)
        self.kv_cache = None  # each stage's is in stage_kv
        self.hidden_shardings = [NamedSharding(m, P()) for m in meshes]
        self.local = [is_local(m) for m in meshes]
        self._stages = []
        for s, mesh in enumerate(meshes):
            kv = kv_cache_shardings(stages[s].kv_cache_shapes(num_blocks, block_size), mesh)
            out = (self.rows_sharding, self.rows_sharding, kv) if s == len(meshes) - 1 \
                else (self.hidden_shardings[s], kv)
            self._stages.append(jax.jit(functools.partial(self._stage_fn, s),
                                        donate_argnums=(1,), out_shardings=out))
        # In place of the plain runner's launcher: this one knows which stages are another
        # host's (never compiled here) and how results come back to rank 0.
        self.launcher = StepLauncher(
            self.compile_manager, elsewhere=self._elsewhere,
            reader=None if all(self.local) else self.program(ProgramKey("to_reader")))
        self.timeline: Optional[StageTimeline] = None

    @property
    def num_stages(self) -> int:
        return len(self.meshes)

    @property
    def programs_per_step(self) -> int:
        return sum(self.local)  # this host's stages

    def weights(self) -> tuple:
        return tuple(self.stage_states)

    def _elsewhere(self, key: ProgramKey) -> bool:
        """Whether key runs on another host's devices only (a stage there; the sampler and
        prompt logprobs run on the last stage)."""
        return not self.local[key.stage if key.kind == "forward" else -1]

    def program(self, key: ProgramKey):
        if key.kind == "forward":
            return self._stages[key.stage]
        if key.kind == "to_stage":  # the hidden states onto stage key.stage's devices
            return functools.partial(jax.device_put, device=self.hidden_shardings[key.stage])
        if key.kind == "to_reader":  # results onto rank 0's devices (stage 0 is its)
            return functools.partial(jax.device_put, device=self.hidden_shardings[0])
        return super().program(key)

    def replay(self, key: ProgramKey, args: tuple):
        if key.kind in ("to_stage", "to_reader"):
            return self.program(key)(*args)
        return super().replay(key, args)

    def _stage_fn(self, s: int, state, kv_cache, x, positions, md, logits_indices,
                  lora_slots=None):
        return stage_forward(nnx.merge(self.stage_graphdefs[s], state), kv_cache, x,
                             positions, md, logits_indices, lora_slots)

    def _stage_args(self, s: int, x, inputs: StepInputs) -> tuple:
        """A stage's inputs; each token's LoRA slot (the scheduler's, once per step) goes to
        every stage with the tokens."""
        return (self.stage_states[s], self.stage_kv[s], x, inputs.positions, inputs.metadata,
                inputs.logits_indices, inputs.lora_slots)

    def _write_lora_here(self, slot: int, weights: dict) -> None:
        """A LoRA adapter into slot `slot` of this host's stages: each stage's share, its own
        layers' (`stage_lora_share`), onto its devices (another host's stages are written
        there, when it replays the call: ModelRunner.write_lora_slot)."""
        for s, state in enumerate(self.stage_states):
            if self.local[s]:
                fill_slot(state["layers"], slot, stage_lora_share(weights, self.stage_cuts[s]),
                          self._write_slot)

    def _run_forward(self, key: ProgramKey, inputs: StepInputs):
        """Dispatch every stage without waiting: stage s+1's program is queued on its devices
        behind the copy of stage s's output (a step never takes tokens still in flight: the
        pipeline engine schedules a sequence only once its last token is read)."""
        if (np.asarray(inputs.from_prev) >= 0).any():
            raise RuntimeError("a pipeline step cannot take tokens still in flight")
        x = inputs.token_ids
        for s, fn in enumerate(self._stages):
            if s:
                handoff = ProgramKey("to_stage", stage=s)
                x = self.launcher.call(handoff, self.program(handoff), x)
            *out, self.stage_kv[s] = self.launcher.run(
                key._replace(stage=s), fn, *self._stage_args(s, x, inputs))
            x = out[0]
            if self.timeline is not None:
                self.timeline.dispatched(s, x)
        rows, hidden = out
        return rows, hidden, None  # expert loads are not counted with a pipeline (refused)

    def _forward_jobs(self, shapes: list[tuple[int, bool]]):
        for T, decode_only in shapes:
            inputs = self.input_batch.padding(T, decode_only, None)
            x = inputs.token_ids
            for s, fn in enumerate(self._stages):
                args = self._stage_args(s, x, inputs)
                yield ProgramKey("forward", T, decode_only, stage=s), fn, args
                if s + 1 < self.num_stages:
                    out = jax.eval_shape(fn, *args)[0]
                    x = jax.ShapeDtypeStruct(out.shape, out.dtype,
                                             sharding=self.hidden_shardings[s + 1])

    def _rows_spec(self) -> jax.ShapeDtypeStruct:
        inputs = self.input_batch.padding(1, False, None)
        x = inputs.token_ids
        for s, fn in enumerate(self._stages):
            x = jax.eval_shape(fn, *self._stage_args(s, x, inputs))[0]
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.rows_sharding)

    def startup_arrays(self) -> tuple:
        return self.stage_kv, self._no_prev_tokens

    # --- observation -------------------------------------------------------------------------
    def start_timeline(self) -> None:
        """Record each stage's busy intervals from the next step on."""
        self.timeline = StageTimeline(self.num_stages)

    def stop_timeline(self) -> dict:
        """Stop recording; StageTimeline.summary() of what was recorded."""
        timeline, self.timeline = self.timeline, None
        return timeline.close()

    def memory_report(self) -> list[dict]:
        """Per stage: its layers, its host, and the weight and KV-cache bytes on each of its
        devices (from the shardings: known for every host's stages)."""
        def per_device(tree) -> int:
            return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                       for leaf in jax.tree.leaves(tree))

        return [{"stage": s, "layers": sum(int(c.k.shape[0]) for c in self.stage_kv[s]),
                 "devices": [d.id for d in mesh.devices.flat],
                 "host": mesh.devices.flat[0].process_index,
                 "weight_bytes_per_device": per_device(self.stage_states[s]),
                 "kv_bytes_per_device": per_device(self.stage_kv[s])}
                for s, mesh in enumerate(self.meshes)]
