"""The cluster as plain JSON values: what ``/v1/stats``, ``/metrics`` and the live monitor read.

Taken on the event-loop thread when asked (the thread rule: nobody else reads scheduler state).
"""
from __future__ import annotations

import time
from typing import Optional

from aserve.cluster.cluster import Cluster
from aserve.engine.instance import Instance


def _predictor(cluster: Cluster, inst: Instance) -> Optional[str]:
    """The length predictor whose ranges this instance's policies read; None where none does
    (vLLM and Sarathi coupled batching never look at a prediction)."""
    if inst.role == "coupled" and cluster.engine.batching != "alise":
        return None
    return cluster.cfg.predictor


def link_snapshot(src: str, dst: str, link) -> dict:
    p = link.profile
    return {"src": src, "dst": dst, "profile": p.name, "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s,
            "latency_s": p.latency_s, "num_copies": p.num_copies, **link.stats()}


def num_waiting_requests(cluster: Cluster) -> int:
    """Requests in the table that have not produced a token yet (queued or in prefill)."""
    return sum("first_token" not in h.request.times for h in cluster.requests.values())


def snapshot(cluster: Cluster, model: str, started_at: float, draining: bool) -> dict:
    """Everything the live monitor shows."""
    counts = cluster.all_counts()
    return {
        "model": model, "mode": cluster.cfg.mode, "uptime_s": time.monotonic() - started_at,
        "draining": draining, "loop_lag_s": cluster.loop_lag_s,
        "num_requests": len(cluster.requests), "num_waiting": num_waiting_requests(cluster),
        "counts": counts, "num_flips": counts.get("flips", 0),
        "flips": list(cluster.lifecycle.flip_log[-20:]), "events": list(cluster.log.events)[-50:],
        "instances": [{**i.snapshot(), "predictor": _predictor(cluster, i)} for i in cluster.instances.values()],
        "links": [link_snapshot(s, d, link) for (s, d), link in cluster.handoff.links.items()],
        "predictor": cluster.predictor.snapshot(),  # name, counters, accuracy, latency (aserve/predict/online.py)
        "prefix_cache": prefix_cache(cluster),
    }


def prefix_cache(cluster: Cluster) -> dict:
    """The prefix cache over every instance: prompt tokens looked up and found (vLLM's queries and
    hits, since start), their ratio, and blocks kept cached now."""
    blocks = [i.blocks for i in cluster.instances.values()]
    queries, hits = sum(b.num_query_tokens for b in blocks), sum(b.num_hit_tokens for b in blocks)
    return {"enabled": cluster.engine.enable_prefix_caching, "queries": queries, "hits": hits,
            "hit_rate": hits / queries if queries else None, "cached_blocks": sum(b.num_cached for b in blocks),
            "evictions": sum(b.num_evictions for b in blocks)}
