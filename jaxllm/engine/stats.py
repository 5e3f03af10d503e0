"""The engine's counters as one typed value, and the periodic stats line of vLLM's log.

`EngineStats` is what every engine's `stats()` returns (one engine, a pipeline, data-parallel
replicas summed, a remote replica read off the wire); /metrics, the router and the
benchmarks read its fields. Optional parts are None where the feature is off.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

from jaxllm.spec_decode.speculator import SpecDecodeStats

logger = logging.getLogger("jaxllm")

LOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class LoraStats:
    """--enable-lora: the adapters of running and waiting requests, by name (vLLM's
    lora_requests_info), and the device slots."""
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_lora: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0   # fraction of blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    spec_decode: Optional[SpecDecodeStats] = None
    # --enable-expert-load-metrics: {MoE layer index: tokens routed to each expert}
    expert_load: Optional[dict] = None
    # Data parallelism: each replica's own, and the router's prefix-affinity hits.
    replicas: tuple["EngineStats", ...] = ()
    prefix_affinity_hits: Optional[int] = None
    lora: Optional[LoraStats] = None
    # --kv-offloading-size: blocks saved to the host tier, and copied back for prefix hits
    kv_offload_saved_blocks: int = 0
    kv_offload_hit_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def to_dict(self) -> dict:
        """Plain JSON-able values (a remote replica sends them over its socket)."""
        d = dataclasses.asdict(self)
        if self.expert_load is not None:
            d["expert_load"] = {str(k): [int(n) for n in v] for k, v in self.expert_load.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineStats":
        d = dict(d)
        if d.get("spec_decode") is not None:
            sd = dict(d["spec_decode"])
            sd["num_accepted_tokens_per_pos"] = tuple(sd["num_accepted_tokens_per_pos"])
            d["spec_decode"] = SpecDecodeStats(**sd)
        if d.get("expert_load") is not None:
            d["expert_load"] = {int(k): v for k, v in d["expert_load"].items()}
        if d.get("lora") is not None:
            lora = d["lora"]
            d["lora"] = LoraStats(tuple(lora["running"]), tuple(lora["waiting"]),
                                  lora["max_lora"])
        d["replicas"] = tuple(cls.from_dict(r) for r in d.get("replicas", ()))
        return cls(**d)


_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "num_free_blocks", "num_total_blocks", "prompt_tokens_total",
           "generation_tokens_total", "kv_offload_saved_blocks", "kv_offload_hit_blocks")


def sum_stats(per: list[EngineStats], **extra) -> EngineStats:
    """Replicas' counters added (KV usage over all their blocks; expert loads per layer),
    each replica's own kept under `replicas`."""
    total = {k: sum(getattr(s, k) for s in per) for k in _SUMMED}
    used = sum(s.kv_cache_usage * s.num_total_blocks for s in per)
    total["kv_cache_usage"] = used / max(total["num_total_blocks"], 1)
    if per[0].expert_load is not None:
        total["expert_load"] = {layer: np.sum([s.expert_load[layer] for s in per], axis=0)
                                for layer in per[0].expert_load}
    loras = [s.lora for s in per if s.lora is not None]
    if loras:  # the adapters running (waiting) on any replica; each replica's own slots
        total["lora"] = LoraStats(tuple(sorted({n for s in loras for n in s.running})),
                                  tuple(sorted({n for s in loras for n in s.waiting})),
                                  loras[0].max_lora)
    return EngineStats(**total, replicas=tuple(per), **extra)


class StatsLogger:
    """Every LOG_INTERVAL_S seconds of steps, vLLM's line: prompt and generation throughput
    since the last line, running and waiting requests, KV-cache use, prefix-cache hit rate.
    The engine calls `log` once `next_at` has passed (a step costs one comparison)."""

    def __init__(self, enabled: bool, now: float):
        self.next_at = now + LOG_INTERVAL_S if enabled else float("inf")
        self._last = (now, 0, 0)  # time, prompt tokens computed, tokens generated

    def log(self, now: float, stats: EngineStats, prompt_tokens: int,
            generation_tokens: int) -> None:
        """prompt_tokens, generation_tokens: totals since start (prompt positions computed,
        recomputes included; output tokens kept)."""
        then, p0, g0 = self._last
        dt = now - then
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: "
            "%.1f%%", (prompt_tokens - p0) / dt, (generation_tokens - g0) / dt,
            stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage,
            100 * stats.prefix_cache_hit_rate)
        self._last = (now, prompt_tokens, generation_tokens)
        self.next_at = now + LOG_INTERVAL_S
