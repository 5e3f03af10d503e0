"""Benchmark workloads: random token prompts (fixed or ranged lengths), or a JSONL/ShareGPT file;
and `format_table`, the human-readable result every `jaxllm bench` prints (vLLM's layout)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

# A table row: (label, value), or a section title (str).
Row = Union[str, tuple[str, Union[int, float, str]]]


@dataclass
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0,
                    avoid_ids: tuple = ()) -> list[BenchRequest]:
    """Random token-id prompts, lengths uniform in [len*(1-r), len*(1+r)] (vLLM's 'random')."""
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> np.ndarray:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    ins, outs = lengths(input_len), lengths(output_len)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(avoid_ids, dtype=np.int64))
    return [BenchRequest(rng.choice(allowed, size=int(i)).tolist(), int(i), int(o))
            for i, o in zip(ins, outs)]


def file_requests(path: str, tokenizer, num: int, output_len: Optional[int] = None,
                  seed: int = 0) -> list[BenchRequest]:
    """Prompts from a JSONL file ({"prompt": ..., optional "output_len"}) or ShareGPT JSON.

    ShareGPT: the first human turn is the prompt, the first model turn sets the output length.
    """
    with open(path) as f:
        text = f.read()
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    pairs = []
    for row in rows:
        if "conversations" in row:
            turns = row["conversations"]
            if len(turns) < 2:
                continue
            prompt, completion = turns[0]["value"], turns[1]["value"]
            out_len = output_len or len(tokenizer.encode(completion))
        else:
            prompt = row["prompt"]
            out_len = output_len or int(row.get("output_len", 128))
        pairs.append((prompt, max(1, out_len)))
    if not pairs:
        raise ValueError(f"{path}: no prompts found (expected JSONL with 'prompt' or ShareGPT)")
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(pairs))[:num] if num < len(pairs) else range(len(pairs))
    return [BenchRequest(pairs[i][0], len(tokenizer.encode(pairs[i][0])), pairs[i][1])
            for i in picks]


def format_table(title: str, rows: list[Row]) -> str:
    """vLLM's result table, so that its users read ours at a glance:

    ============ Serving Benchmark Result ============
    Successful requests:                     100
    ---------------Time to First Token----------------
    Mean TTFT (ms):                          12.34
    ==================================================

    Floats get two decimals; a str row is a section title.
    """
    lines = [f"{' ' + title + ' ':=^50}"]
    for row in rows:
        if isinstance(row, str):
            lines.append(f"{row:-^50}")
            continue
        label, value = row
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label + ':':<40} {shown}")
    lines.append("=" * 50)
    return "\n".join(lines)
