"""Prometheus metrics with vLLM's names, served under both `jaxllm:` and `vllm:` prefixes (so
vLLM dashboards and autoscalers work unchanged).

Engine-side state (queue sizes, KV-cache use, prefix-cache and preemption counts) is read from
`engine.stats()` at scrape time; per-request counters and latency histograms are recorded by the
server when a request ends, from the timestamps in RequestOutput.metrics.
"""

from __future__ import annotations

import re
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.outputs import RequestOutput

_VLLM_NAMES = re.compile(rb"(?m)^(# (?:HELP|TYPE) )?jaxllm:")
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]


class EngineStatsCollector:
    """Gauges and engine counters, read fresh from `engine.stats()` on every scrape."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        label = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        queries, hits = s.prefix_cache_queries, s.prefix_cache_hits
        yield gauge("jaxllm:num_requests_running", "Requests in the running batch.",
                    s.num_running)
        yield gauge("jaxllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_waiting)
        yield gauge("jaxllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                    s.kv_cache_usage)
        yield gauge("jaxllm:num_kv_cache_blocks", "KV-cache blocks in total.",
                    s.num_total_blocks)
        yield counter("jaxllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      queries)
        yield counter("jaxllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge("jaxllm:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.",
                    s.prefix_cache_hit_rate)
        yield counter("jaxllm:num_preemptions", "Requests preempted (KV cache ran out).",
                      s.num_preemptions)
        yield counter("jaxllm:kv_offload_saved_blocks", "KV blocks evicted from the prefix "
                      "cache and kept in host memory (--kv-offloading-size).",
                      s.kv_offload_saved_blocks)
        yield counter("jaxllm:kv_offload_hit_blocks", "KV blocks copied back from host memory "
                      "for a prefix hit instead of computed again.", s.kv_offload_hit_blocks)
        yield from self._spec_decode_counters(s.spec_decode, counter)
        yield from self._replica_gauges(s.replicas)
        yield from self._lora_info(s.lora)
        if s.expert_load is not None:  # --enable-expert-load-metrics
            c = CounterMetricFamily("jaxllm:moe_expert_tokens", "Tokens routed to an expert of "
                                    "an MoE layer (a token counts once per expert of its top-k; "
                                    "layer is the decoder layer's index).",
                                    labels=["model_name", "layer", "expert"])
            for layer, counts in s.expert_load.items():
                for expert, n in enumerate(counts):
                    c.add_metric([self.model_name, str(layer), str(expert)], int(n))
            yield c

    def _spec_decode_counters(self, sd, counter):
        """With --speculative-config: vLLM's spec_decode counters (acceptance rate = accepted
        / draft tokens; mean acceptance length = 1 + accepted / drafts)."""
        if sd is None:
            return
        for key, doc in (("num_drafts", "Requests-steps that carried draft tokens."),
                         ("num_draft_tokens", "Draft tokens proposed."),
                         ("num_accepted_tokens", "Draft tokens accepted.")):
            yield counter(f"jaxllm:spec_decode_{key}", doc, getattr(sd, key))
        c = CounterMetricFamily("jaxllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each position.",
                                labels=["model_name", "position"])
        for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
            c.add_metric([self.model_name, str(pos)], n)
        yield c

    @staticmethod
    def _lora_info(lora):
        """With --enable-lora: vLLM's lora_requests_info, its labels the adapters (names, each
        once, comma-separated) of the running and of the waiting requests and --max-loras, its
        value the time of the reading (vLLM's; routers read the latest)."""
        if lora is None:
            return
        g = GaugeMetricFamily("jaxllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters",
                                      "running_lora_adapters"])
        g.add_metric([str(lora.max_lora), ",".join(dict.fromkeys(lora.waiting)),
                      ",".join(dict.fromkeys(lora.running))], time.time())
        yield g

    def _replica_gauges(self, replicas):
        """With --data-parallel-size: each replica's load (the totals above sum them)."""
        for key, name, doc in (
                ("num_running", "num_requests_running", "Requests in a replica's batch."),
                ("num_waiting", "num_requests_waiting", "Requests waiting in a replica."),
                ("kv_cache_usage", "kv_cache_usage_perc", "A replica's KV-cache use (0-1).")):
            g = GaugeMetricFamily(f"jaxllm:replica_{name}", doc, labels=["model_name", "engine"])
            for i, r in enumerate(replicas):
                g.add_metric([self.model_name, str(i)], getattr(r, key))
            if replicas:
                yield g


class ServerMetrics:
    """One registry per app, so several servers (or tests) in one process do not clash."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, lab = self.registry, ["model_name"]
        self.request_success = Counter("jaxllm:request_success", "Finished requests by reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens processed.", lab,
                                     registry=reg)
        self.generation_tokens = Counter("jaxllm:generation_tokens", "Tokens generated.", lab,
                                         registry=reg)
        self.ttft = Histogram("jaxllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("jaxllm:time_per_output_token_seconds",
                              "Mean time per output token after the first.", lab,
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("jaxllm:e2e_request_latency_seconds", "Request latency end to end.",
                             lab, buckets=E2E_BUCKETS, registry=reg)
        self.request_prompt_tokens = Histogram("jaxllm:request_prompt_tokens",
                                               "Prompt length per request.", lab,
                                               buckets=TOKEN_BUCKETS, registry=reg)
        self.request_generation_tokens = Histogram("jaxllm:request_generation_tokens",
                                                   "Tokens generated per request.", lab,
                                                   buckets=TOKEN_BUCKETS, registry=reg)
        reg.register(EngineStatsCollector(engine, model_name))

    def record(self, out: RequestOutput, aborted: bool) -> None:
        """Count one finished (or aborted) engine request, given its last output."""
        m = self.model_name
        generated = sum(len(o.token_ids) for o in out.outputs)
        reasons = {o.finish_reason for o in out.outputs if o.finish_reason}
        reason = "abort" if aborted or not reasons else ("stop" if reasons == {"stop"} else
                                                         sorted(reasons - {"stop"})[0])
        self.request_success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(generated)
        self.request_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(m).observe(generated)
        t = out.metrics or {}
        arrival, first = t.get("arrival_time"), t.get("first_token_time")
        finished = t.get("finished_time") or time.monotonic()
        if arrival is not None:
            self.e2e.labels(m).observe(finished - arrival)
            if first is not None:
                self.ttft.labels(m).observe(first - arrival)
        longest = max((len(o.token_ids) for o in out.outputs), default=0)
        if first is not None and longest > 1:
            self.tpot.labels(m).observe((finished - first) / (longest - 1))

    def exposition(self) -> bytes:
        text = generate_latest(self.registry)
        return text + _VLLM_NAMES.sub(rb"\1vllm:", text)
