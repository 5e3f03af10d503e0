"""Pipeline parallelism's layout: which layers each stage runs, and on which devices.

Stages hold contiguous layer ranges. The default split is vLLM's (`get_pp_indices`): equal
shares, the remainder going one layer each to the stages before the last (the last also runs
the final norm, the LM head and the sampler). $JAXLLM_PP_LAYER_PARTITION (vLLM's
$VLLM_PP_LAYER_PARTITION is read too) overrides it with comma-separated layer counts, one per
stage. Stage s runs on devices [s * tp, (s + 1) * tp): its own ('data', 'model', 'expert')
sub-mesh with tensor parallelism inside it. Across hosts a stage must sit on one host's devices
(`jax.devices()` lists them host by host): a stage spanning hosts would run its tensor-parallel
collectives between them, which is what pipelining across hosts avoids.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import jax
from jax.sharding import Mesh

from jaxllm.config import ConfigError
from jaxllm.parallel.mesh import device_groups, make_mesh

PARTITION_ENVS = ("JAXLLM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")


def stage_layer_ranges(num_layers: int, pp: int,
                       partition: Optional[str] = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers. partition: comma-separated layer counts (default:
    the environment's, see the module docstring), refused unless it has pp positive counts
    summing to num_layers."""
    env = next((e for e in PARTITION_ENVS if os.environ.get(e)), None)
    if partition is None and env is not None:
        partition = os.environ[env]
    name = env or "layer partition"
    if partition is not None:
        try:
            counts = [int(c) for c in partition.split(",")]
        except ValueError:
            raise ConfigError(f"{name}={partition!r}: expected comma-separated layer counts, "
                              f"one per stage, e.g. '{num_layers - num_layers // 2},"
                              f"{num_layers // 2}'") from None
        if len(counts) != pp:
            raise ConfigError(f"{name}={partition!r} gives {len(counts)} stages, but "
                              f"--pipeline-parallel-size is {pp}")
        if sum(counts) != num_layers or min(counts) < 1:
            raise ConfigError(f"{name}={partition!r}: the counts must be positive and sum to "
                              f"the model's {num_layers} layers")
    else:
        if pp > num_layers:
            raise ConfigError(f"--pipeline-parallel-size={pp}: the model has only {num_layers} "
                              f"layers (each stage needs at least one)")
        counts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            counts[-i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def stage_meshes(pp: int, tp: int, devices: Optional[Sequence] = None) -> list[Mesh]:
    """One tp-device mesh per stage, on consecutive devices; refused (with the numbers) when
    fewer than pp x tp devices are visible."""
    devices = list(devices if devices is not None else jax.devices())
    groups = device_groups("--pipeline-parallel-size", pp, "stages", tp, devices)
    if jax.process_count() > 1:
        if pp * tp != len(devices):
            raise ConfigError(f"--pipeline-parallel-size={pp} x --tensor-parallel-size={tp} = "
                              f"{pp * tp}: on {jax.process_count()} hosts the stages must use "
                              f"all {len(devices)} devices (every host runs a stage)")
        for s, g in enumerate(groups):
            if len({d.process_index for d in g}) > 1:
                raise ConfigError(
                    f"--pipeline-parallel-size={pp} --tensor-parallel-size={tp}: stage {s} "
                    f"would span hosts {sorted({d.process_index for d in g})}; a stage must "
                    f"sit on one host (make --tensor-parallel-size divide the "
                    f"{jax.local_device_count()} devices per host)")
    return [make_mesh(tp, devices=g) for g in groups]


def is_local(mesh: Mesh) -> bool:
    """Whether this process drives mesh's devices (across hosts, a stage's are one host's)."""
    return mesh.devices.flat[0].process_index == jax.process_index()
