"""Backends: the ops the decoder is written against, chosen once at start-up.

  reference  pure XLA (any platform; on CPU the path for sharded models)
  pallas     the Pallas attention and gated DeltaNet kernels of the TPU/GPU being compiled for
  cpu        jaxllm's native XLA:CPU kernels (one device)
"""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import Mesh

from jaxllm.config import ConfigError
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.quantization import QuantSpec
from pallas_kernels.ragged_paged_attention import kernel_cpu

BACKENDS = ("reference", "pallas", "cpu")


def resolve_backend(requested: str, num_devices: int = 1) -> str:
    """auto = Pallas on TPU/GPU; on CPU the native kernels when they build and the model
    is on one device (XLA cannot partition the FFI call), else the pure-JAX reference."""
    if requested != "auto" and requested not in BACKENDS:
        raise ConfigError(f"--attention-backend {requested!r}: one of auto, {', '.join(BACKENDS)}")
    if requested == "cpu" and not kernel_cpu.available():
        raise ConfigError("--attention-backend cpu: the CPU kernel could not be built (is a "
                          "C++ compiler installed? see the log)")
    if requested != "auto":
        return requested
    if jax.default_backend() != "cpu":
        return "pallas"
    return "cpu" if num_devices == 1 and kernel_cpu.available() else "reference"


def make_backend(requested: str = "reference", mesh: Optional[Mesh] = None,
                 experts: bool = True, quant: Optional[QuantSpec] = None) -> Backend:
    """The backend for --attention-backend on the model's mesh, its kernels built now (never
    inside a trace); `experts=False` for a dense model, whose backend never runs experts;
    `quant`: how the model's projections are quantized (None: float)."""
    name = resolve_backend(requested, 1 if mesh is None else mesh.size)
    if name == "cpu":
        from jaxllm.layers.backends.cpu import CpuBackend
        return CpuBackend.create(experts, quant)
    multi = None if mesh is None or mesh.size == 1 else mesh.abstract_mesh
    if name == "pallas":
        from jaxllm.layers.backends.pallas import PallasBackend
        return PallasBackend(multi)
    from jaxllm.layers.backends.reference import ReferenceBackend
    return ReferenceBackend(multi)
