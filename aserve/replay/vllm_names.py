"""A replay's numbers under ``vllm bench serve``'s names, so an HTTP replay's JSON compares
directly with vLLM's own benchmark JSON (same keys, same units, same definitions).

    vLLM key                          aserve's own (report.py)    definition here
    duration                          makespan_s                  first request sent -> last request ended, s
    completed / failed                completed / failed          requests that ended with tokens / with an error
    total_input_tokens, total_output_tokens                       sums over completed requests
    request_throughput                throughput_rps              completed / duration
    output_throughput                 output_tokens_per_s         total_output_tokens / duration
    total_token_throughput                                        (input + output tokens) / duration
    {mean,median,std,p99}_ttft_ms     ttft                        arrival -> first token
    {mean,median,std,p99}_tpot_ms     tpot                        per request: (last - first token) / (tokens - 1), > 1 token
    {mean,median,std,p99}_itl_ms      token_gap                   every gap between consecutive tokens (chunks over HTTP)
    {mean,median,std,p99}_e2el_ms     jct                         arrival -> last token

Statistics as vLLM computes them (numpy mean, median, population std, 99th percentile) in
milliseconds; where there are no samples vLLM writes 0, and so does this.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


def _samples(records: Sequence) -> dict[str, list[float]]:
    out = {k: [] for k in METRICS}
    for r in records:
        t = r.token_times
        out["ttft"].append(r.first_token_s - r.arrival_s)
        out["e2el"].append(r.finish_s - r.arrival_s)
        out["itl"].extend(b - a for a, b in zip(t, t[1:]))
        if r.output_tokens > 1:
            out["tpot"].append((r.finish_s - r.first_token_s) / (r.output_tokens - 1))
    return out


def _stats_ms(name: str, values: list[float]) -> dict[str, float]:
    a = np.asarray(values or [0.0], dtype=float) * 1000.0
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"std_{name}_ms": float(a.std()), f"p99_{name}_ms": float(np.percentile(a, 99))}


def vllm_fields(records: Sequence) -> dict:
    """``vllm bench serve``'s result fields for one system's replayed ``RequestRecord``s."""
    done = [r for r in records if r.status == "completed" and r.first_token_s is not None and r.finish_s is not None]
    ends = [r.finish_s for r in done] + [r.arrival_s for r in records]
    duration = (max(ends) - min(r.arrival_s for r in records)) if records else 0.0
    num_in = sum(r.prompt_tokens for r in done)
    num_out = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out = {"duration": duration, "completed": len(done), "failed": sum(r.status == "failed" for r in records),
           "total_input_tokens": num_in, "total_output_tokens": num_out,
           "request_throughput": per_s(len(done)), "output_throughput": per_s(num_out),
           "total_token_throughput": per_s(num_in + num_out)}
    for name, values in _samples(done).items():
        out.update(_stats_ms(name, values))
    return out
