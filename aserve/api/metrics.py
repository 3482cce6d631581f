"""``/metrics`` (Prometheus): request latencies, and the cluster's snapshot at every scrape.

It reads the same snapshot as ``/v1/stats`` (aserve/cluster/snapshot.py). Per-request latencies
are observed once, when a request ends, from the timestamps the cluster keeps on it.

Names follow vLLM where it has one (``vllm:time_to_first_token_seconds``, ...) so existing
dashboards work; what vLLM has no name for (KV transfers, padding, busy time, loop lag) is
``aserve:``. Every server owns its ``CollectorRegistry``: several servers can share a process.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from aserve.cluster.requests import RequestHandle

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


# ---- Prometheus ------------------------------------------------------------------------------
_INSTANCE_GAUGES = (("vllm:num_requests_running", "num_running", "Requests running on the instance"),
                    ("vllm:num_requests_waiting", "num_waiting", "Requests waiting on the instance"),
                    ("aserve:free_blocks", "free_blocks", "Free KV blocks"),
                    ("aserve:total_blocks", "total_blocks", "KV blocks in the instance's pool"),
                    ("aserve:cached_blocks", "cached_blocks", "Free KV blocks still holding a cached prefix"))
_INSTANCE_COUNTERS = (("vllm:num_preemptions", "num_preemptions", "Preemptions on the instance"),
                      ("vllm:prompt_tokens", "num_prefill_tokens", "Prompt (prefill) tokens computed"),
                      ("vllm:generation_tokens", "num_decode_tokens", "Tokens generated"),
                      ("aserve:pad_tokens", "num_pad_tokens", "Padding tokens computed in fixed-size chunks"),
                      ("aserve:instance_busy_seconds", "busy_s", "Seconds the instance's device was computing"),
                      ("aserve:instance_steps", "num_steps", "Forward steps run"),
                      ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                      ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
                      ("aserve:prefix_cache_evictions", "prefix_cache_evictions",
                       "Cached KV blocks evicted to make room"))
_LINK_COUNTERS = (("aserve:kv_transfer_bytes", "bytes", "KV bytes really copied"),
                  ("aserve:kv_transfer_emulated_bytes", "emulated_bytes", "KV bytes the emulated link was charged"),
                  ("aserve:kv_transfer_emulated_seconds", "emulated_s", "Emulated transfer seconds"),
                  ("aserve:kv_transfer_real_seconds", "real_copy_s", "Seconds of the real copies"),
                  ("aserve:kv_transfer_link_busy_seconds", "busy_s", "Link seconds with data moving"))

# ``counts`` of the snapshot: how requests ended (one family, by outcome), and the control plane's
# own counters, each a family named for what it counts (aserve/cluster/lifecycle.py, handoff.py)
OUTCOMES = ("finished", "aborted", "failed", "rejected")
CONTROL_COUNTERS = {
    "reruns": ("aserve:request_reruns", "Requests re-run from the prompt (a failed instance, or a hand-over given up)"),
    "instance_failures": ("aserve:instance_failures", "Instances that failed (a step raised, or the loop died)"),
    "decode_leases_expired": ("aserve:decode_leases_expired", "Decode blocks reserved for KV that never came, "
                              "freed after --lease"),
    "prefill_leases_expired": ("aserve:prefill_leases_expired", "Prefilled KV released after --lease with no "
                               "decode instance room for it"),
    "transfer_failures": ("aserve:kv_transfer_failures", "KV transfer attempts that failed (an error, a timeout, "
                          "or a receiver that went away)"),
    "transfer_timeouts": ("aserve:kv_transfer_timeouts", "KV transfer attempts that ran past --transfer-timeout"),
    "transfer_retries": ("aserve:kv_transfer_retries", "Failed KV transfer attempts tried again on another "
                         "decode instance"),
    "transfer_recomputes": ("aserve:kv_transfer_recomputes", "Requests re-run from the prompt because their KV "
                            "could not be handed over (--on-transfer-failure recompute)"),
    "transfer_failed_requests": ("aserve:kv_transfer_failed_requests", "Requests ended with an error because their "
                                 "KV could not be handed over (--on-transfer-failure fail)"),
    "migrations": ("aserve:decode_migrations", "Running decodes an adaptive rebalance moved to another instance "
                   "by their KV (--rebalance)"),
    "migrations_kept": ("aserve:decode_migrations_kept", "Rebalance moves that did not happen (no room on the "
                        "receiver, or the copy failed): the decode went on where it was"),
}

_PREDICTOR_COUNTERS = (("aserve:predictor_predictions", "predictions", "Predicted ranges put on requests"),
                       ("aserve:predictor_scored", "scored", "Finished requests whose prediction was scored"),
                       ("aserve:predictor_hits", "hits", "Scored requests whose length fell in the predicted bucket"))


class _ClusterCollector:
    """Reads a fresh snapshot at every scrape (no background task to keep in sync)."""

    def __init__(self, take: Callable[[], dict]):
        self.take = take

    def collect(self):
        snap = self.take()
        model = snap["model"]
        yield from self._instances(model, snap["instances"])
        yield from self._links(snap["links"])
        yield GaugeMetricFamily("aserve:loop_lag_seconds", "Event-loop lag seen by the cluster monitor",
                                value=snap["loop_lag_s"])
        yield CounterMetricFamily("aserve:flips", "Instance role flips", value=snap["num_flips"])
        yield from self._counts(snap["counts"])
        yield from self._predictor(snap["predictor"])

    def _counts(self, counts: dict):
        outcome = CounterMetricFamily("aserve:requests", "Requests ended, by outcome", labels=["outcome"])
        for key in OUTCOMES:
            if key in counts:
                outcome.add_metric([key], counts[key])
        yield outcome
        for key, (name, doc) in CONTROL_COUNTERS.items():
            if key in counts:
                yield CounterMetricFamily(name, doc, value=counts[key])

    def _predictor(self, pred: dict):
        """The length predictor: latency, outcomes, and hits over scored requests (accuracy =
        hits / scored over any window)."""
        labels = [pred["name"]]
        lat = pred["latency"]
        hist = HistogramMetricFamily("aserve:predictor_latency_seconds",
                                     "Submit to predicted range, queueing on the predictor thread included",
                                     labels=["predictor"])
        hist.add_metric(labels, [(str(b), n) for b, n in lat["buckets"]] + [("+Inf", lat["count"])], lat["sum_s"])
        yield hist
        for name, key, doc in _PREDICTOR_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["predictor"])
            counter.add_metric(labels, pred[key])
            yield counter
        fallbacks = CounterMetricFamily("aserve:predictor_fallbacks", "Requests that went on without a prediction",
                                        labels=["predictor", "reason"])
        for reason, n in pred["fallback_reasons"].items():
            fallbacks.add_metric(labels + [reason], n)
        yield fallbacks

    def _instances(self, model: str, instances: list[dict]):
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)",
                                  labels=["model_name", "instance"])
        for inst in instances:
            usage.add_metric([model, inst["id"]], 1.0 - inst["free_blocks"] / max(1, inst["total_blocks"]))
        yield usage
        for family, table in ((GaugeMetricFamily, _INSTANCE_GAUGES), (CounterMetricFamily, _INSTANCE_COUNTERS)):
            for name, key, doc in table:
                metric = family(name, doc, labels=["model_name", "instance", "role"])
                for inst in instances:
                    metric.add_metric([model, inst["id"], inst["role"]], inst[key])
                yield metric

    def _links(self, links: list[dict]):
        for name, key, doc in _LINK_COUNTERS:
            metric = CounterMetricFamily(name, doc, labels=["src", "dst", "profile"])
            for link in links:
                metric.add_metric([link["src"], link["dst"], link["profile"]], link[key])
            yield metric
        transfers = CounterMetricFamily("aserve:kv_transfers", "KV transfers ended, by outcome",
                                        labels=["src", "dst", "outcome"])
        in_flight = GaugeMetricFamily("aserve:kv_transfers_in_flight", "KV transfers on the link", labels=["src", "dst"])
        for link in links:
            for outcome in ("done", "failed"):  # failed: raised, cancelled (request aborted) or bad blocks
                transfers.add_metric([link["src"], link["dst"], outcome], link[f"num_{outcome}"])
            in_flight.add_metric([link["src"], link["dst"]], link["in_flight"])
        yield transfers
        yield in_flight


class ServerMetrics:
    """One server's registry: request latencies observed at the end, cluster state at scrape."""

    def __init__(self, model: str, take_snapshot: Callable[[], dict]):
        self.model = model
        self.registry = CollectorRegistry()
        labels = ["model_name", "instance"]

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (label: entry instance)")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens (label: last instance)")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish (label: last instance)")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first schedule")
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.output_len = hist("vllm:request_generation_tokens", "Output tokens per request", TOKEN_BUCKETS)
        self.success = Counter("vllm:request_success", "Requests ended, by finish reason",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(_ClusterCollector(take_snapshot))

    def observe(self, handle: RequestHandle) -> None:
        """Record one ended request (any finish reason) from its timestamps."""
        req, times = handle.request, handle.request.times
        first = handle.prefill_instance or handle.instance_id or "none"
        last = handle.decode_instance or handle.instance_id or "none"
        if "first_token" in times:
            self.ttft.labels(self.model, first).observe(times["first_token"] - times["arrival"])
        if "scheduled" in times:
            self.queue.labels(self.model, first).observe(times["scheduled"] - times["arrival"])
        itl = self.itl.labels(self.model, last)
        for a, b in zip(handle.token_times, handle.token_times[1:]):
            itl.observe(b - a)
        if "finish" in times:
            self.e2e.labels(self.model, last).observe(times["finish"] - times["arrival"])
        self.prompt_len.labels(self.model, first).observe(req.num_prompt_tokens)
        self.output_len.labels(self.model, last).observe(req.num_output_tokens)
        self.success.labels(self.model, req.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
