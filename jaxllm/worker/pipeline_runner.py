"""The pipeline-parallel model runner: a step's forward runs as one program per stage, each on
its stage's sub-mesh, the hidden states handed from stage to stage with `jax.device_put`.

Stage s holds layers [start_s, end_s) (its weights and its KV cache only, jaxllm/models/
pipeline_stage.py); stage 0 also embeds, the last stage applies the final norm and hands its
rows to the sampler, which runs there too (as do prompt logprobs): everything after the
forward is the plain `ModelRunner`'s, on the last stage's model.

Why one program per stage and a device-to-device copy, not one SPMD program with a `stage`
mesh axis and `ppermute`: the pipeline's point is that stage s works on step k while stage
s+1 works on step k-1. Separate programs get that from JAX's asynchronous dispatch alone (the
engine keeps up to N steps in flight, jaxllm/engine/pp_engine.py): each stage's device queue
runs its programs in order, and a program waits only for its own input. One SPMD program
would run every stage in lockstep on the same step's schedule, so overlapping steps would
need a hand-written micro-batch schedule inside it, stages would have to be identical (the
first embeds, the last samples) and every step would pay the slowest stage N times. The
handoff is one [T, hidden] array per stage boundary per step (measured in docs/multi-host.md).

Every step dispatches all stages without waiting; only the sampled tokens are read back
(`collect`). `start_timeline` records when each stage is busy (jaxllm/worker/
pipeline_timeline.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.layers.attention import empty_kv_caches, kv_cache_shardings
from jaxllm.models.pipeline_stage import stage_forward
from jaxllm.worker.compile_manager import ProgramKey
from jaxllm.worker.input_batch import StepInputs
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.pipeline_timeline import StageTimeline

logger = logging.getLogger("jaxllm")


class PipelineRunner(ModelRunner):
    def __init__(self, stages: list, meshes: list[Mesh], model_config, *, num_blocks: int,
                 block_size: int, kv_cache_dtype, **kwargs):
        """stages: the stage models (`split_stage`), meshes: their sub-meshes. The keyword
        arguments are ModelRunner's (without executable_dir: stage programs are not cached
        on disk)."""
        # The plain runner's parts (sampler, prompt logprobs, compile manager) run on the
        # last stage; its forward program is replaced by the stages' (`_run_forward`).
        super().__init__(stages[-1], model_config, meshes[-1], num_blocks=num_blocks,
                         block_size=block_size, kv_cache_dtype=kv_cache_dtype, **kwargs)
        self.meshes = meshes
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
        self._stages = []
        for s, mesh in enumerate(meshes):
            kv = kv_cache_shardings(stages[s].kv_cache_shapes(num_blocks, block_size), mesh)
            out = (self.rows_sharding, self.rows_sharding, kv) if s == len(meshes) - 1 \
                else (self.hidden_shardings[s], kv)
            self._stages.append(jax.jit(functools.partial(self._stage_fn, s),
                                        donate_argnums=(1,), out_shardings=out))
        self.timeline: Optional[StageTimeline] = None

    @property
    def num_stages(self) -> int:
        return len(self.meshes)

    @property
    def programs_per_step(self) -> int:
        return self.num_stages

    def _stage_fn(self, s: int, state, kv_cache, x, positions, md, logits_indices):
        return stage_forward(nnx.merge(self.stage_graphdefs[s], state), kv_cache, x,
                             positions, md, logits_indices)

    def _stage_args(self, s: int, x, inputs: StepInputs) -> tuple:
        return (self.stage_states[s], self.stage_kv[s], x, inputs.positions, inputs.metadata,
                inputs.logits_indices)

    def _run_forward(self, key: ProgramKey, inputs: StepInputs):
        """Dispatch every stage without waiting: stage s+1's program is queued on its devices
        behind the copy of stage s's output (a step never takes tokens still in flight: the
        pipeline engine schedules a sequence only once its last token is read)."""
        if (np.asarray(inputs.from_prev) >= 0).any():
            raise RuntimeError("a pipeline step cannot take tokens still in flight")
        x = inputs.token_ids
        for s, fn in enumerate(self._stages):
            if s:
                x = jax.device_put(x, self.hidden_shardings[s])
            *out, self.stage_kv[s] = self.compile_manager.run(
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
        raise NotImplementedError("pipeline parallelism runs on one host")

    # --- observation -------------------------------------------------------------------------
    def start_timeline(self) -> None:
        """Record each stage's busy intervals from the next step on."""
        self.timeline = StageTimeline(self.num_stages)

    def stop_timeline(self) -> dict:
        """Stop recording; StageTimeline.summary() of what was recorded."""
        timeline, self.timeline = self.timeline, None
        return timeline.close()

    def memory_report(self) -> list[dict]:
        """Per stage: its layers, and the weight and KV-cache bytes on one of its devices."""
        def per_device(tree, device) -> int:
            return sum(sh.data.nbytes for leaf in jax.tree.leaves(tree)
                       for sh in leaf.addressable_shards if sh.device == device)

        return [{"stage": s, "layers": sum(int(c.k.shape[0]) for c in self.stage_kv[s]),
                 "devices": [d.id for d in mesh.devices.flat],
                 "weight_bytes_per_device": per_device(self.stage_states[s], mesh.devices.flat[0]),
                 "kv_bytes_per_device": per_device(self.stage_kv[s], mesh.devices.flat[0])}
                for s, mesh in enumerate(self.meshes)]
