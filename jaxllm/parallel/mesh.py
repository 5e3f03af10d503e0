"""The device mesh and the one table mapping logical axis names to mesh axes (MaxText style).

Layers name the role of each weight dimension (`embed`, `heads`, `kv_heads`, `mlp`, `vocab`, ...);
only this file decides which mesh axis, if any, shards that role. A dimension that does not divide
evenly by its mesh axis is replicated instead (e.g. 3 KV heads on 4 devices), so GSPMD stays
correct for any head count.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxllm.config import ConfigError

MESH_AXES = ("data", "model", "expert")

# logical axis -> mesh axis (None = replicated)
LOGICAL_AXIS_RULES: dict[str, Optional[str]] = {
    "layers": None,
    "embed": None,
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "q_per_kv": None,
    "head_dim": None,
    "mlp": "model",
    # Expert parallelism takes the tensor-parallel devices (vLLM: EP size = TP x DP), so a
    # MoE layer's experts shard over `model` while its attention stays tensor-parallel; the
    # experts' FFN axis is then left unsharded (`jaxllm.models.moe`).
    "expert": "model",
    # KV cache and activations
    "cache_blocks": None,
    "cache_block_size": None,
    "tokens": None,
    "batch": "data",
}


def device_groups(flag: str, n: int, what: str, tp: int, devices: Sequence) -> list[list]:
    """n groups of tp consecutive devices (pipeline stages, data-parallel replicas), refused
    with the numbers, naming `flag`, when fewer than n x tp devices are visible."""
    devices = list(devices)
    if n * tp > len(devices):
        raise ConfigError(
            f"{flag}={n}: {n} {what} x --tensor-parallel-size {tp} need {n * tp} devices, but "
            f"{len(devices)} {devices[0].platform.upper()} device(s) are visible (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return [devices[i * tp:(i + 1) * tp] for i in range(n)]


def absent_array(shape: Sequence[int], dtype, sharding: NamedSharding) -> jax.Array:
    """An array on devices all of another process's: its shape and sharding, no local data
    (what a host holds of another host's pipeline stage)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              expert_parallel_size: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A ('data', 'model', 'expert') mesh with Auto axes, so XLA's GSPMD inserts collectives."""
    shape = (data_parallel_size, tensor_parallel_size, expert_parallel_size)
    need = math.prod(shape)
    devices = list(devices if devices is not None else jax.devices())
    if need > len(devices):
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size "
            f"{data_parallel_size} needs {need} devices, but {len(devices)} "
            f"{devices[0].platform.upper()} device(s) are visible (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    arr = np.array(devices[:need]).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for a tensor whose dims have these logical names, on this mesh."""
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        mesh_axis = LOGICAL_AXIS_RULES.get(name) if name else None
        if (mesh_axis is None or mesh_axis in used or mesh.shape[mesh_axis] == 1
                or dim % mesh.shape[mesh_axis] != 0):
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return P(*spec)


def named_sharding(mesh: Mesh, axes: Sequence[Optional[str]], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))
