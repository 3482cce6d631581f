"""Trace replay: send a fitted trace to the in-process cluster (or a server) at its arrival times.

    Trace ──PromptBuilder──► prompt ids ──drive: sleep to each arrival on the loop's clock──► target
       target: the in-process Cluster (one ModelBundle shared by every --compare system)
             | HttpTarget (--url, streaming /v1/completions; aserve/replay/http_target.py)
       every request: max_tokens = its trace output length, ignore_eos, temperature 0
    ──► RequestRecord per request, InstanceRecord per instance ──► report / JSON / plots

Systems of a ``--compare`` run one after another on the same trace, prompts, bundle and cores.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Optional, Sequence

from aserve.config import ClusterConfig, EngineConfig
from aserve.replay.report import InstanceRecord, RequestRecord, SystemRun
from aserve.replay.traces import Trace, TraceRequest
from scheduling.request import SamplingParams

if TYPE_CHECKING:
    from aserve.predict.online import LatencyHistogram

SAMPLE_PERIOD_S = 0.25  # instance busy/role timeline resolution


@dataclass(frozen=True)
class SystemSpec:
    """One named system to replay: its engine and cluster configs."""

    name: str
    engine: EngineConfig
    cluster: ClusterConfig

    def __post_init__(self):
        if not self.name or ":" in self.name or ";" in self.name:
            raise ValueError(f"bad system name {self.name!r}: non-empty, without ':' or ';'")


def default_name(engine: EngineConfig, cluster: ClusterConfig) -> str:
    if cluster.split:
        return f"{cluster.mode} {cluster.num_prefill}P+{cluster.num_decode}D"
    return f"coupled {engine.batching} x{cluster.num_coupled}"


class ReplayProgress:
    """A rich progress bar per system (output tokens); silent when disabled."""

    def __init__(self, enabled: bool = True):
        self.bar, self.task = None, None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("tokens, {task.fields[done]}/{task.fields[n]} requests"),
                                TimeElapsedColumn(), transient=False)
        self.done = 0

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def system(self, name: str, trace: Trace) -> None:
        self.done, n = 0, len(trace.requests)
        if self.bar:
            total = sum(r.output_tokens for r in trace.requests)
            self.task = self.bar.add_task(name, total=total, done=0, n=n)

    def token(self) -> None:
        if self.bar and self.task is not None:
            self.bar.advance(self.task)

    def tokens(self, n: int) -> None:
        if self.bar and self.task is not None and n:
            self.bar.advance(self.task, n)

    def request_done(self) -> None:
        self.done += 1
        if self.bar and self.task is not None:
            self.bar.update(self.task, done=self.done)


def sampling_for(req: TraceRequest, max_tokens: Optional[int] = None) -> SamplingParams:
    """Exactly the trace's output length: greedy, EOS ignored. ``max_tokens`` is the cap the
    policies see (default: the length itself); a larger one keeps the true length from them."""
    cap = max(req.output_tokens, max_tokens or req.output_tokens)
    return SamplingParams(max_tokens=cap, temperature=0.0, ignore_eos=True, length_after=req.output_tokens)


def replay_cap(longest_output: int, context: int, prompt_tokens: int) -> int:
    """The ``max_tokens`` a replayed request is sent with: the trace's longest output (the same
    for every request, so it says nothing about this one), within the model's context."""
    return max(1, min(longest_output, context - prompt_tokens))


async def drive(trace: Trace, send: Callable[[int], Awaitable[RequestRecord]],
                timeout_s: Optional[float] = None) -> list[RequestRecord]:
    """Start ``send(i)`` at each request's arrival time (relative to now, on the loop's clock).

    ``send`` must turn its own cancellation into an ``aborted`` record; requests not yet sent
    when ``timeout_s`` runs out are recorded as aborted without being sent.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + timeout_s if timeout_s else None
    tasks: list[asyncio.Task] = []
    for i, req in enumerate(trace.requests):
        delay = t0 + req.arrival_s - loop.time()
        if deadline is not None and t0 + req.arrival_s >= deadline:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=None if deadline is None else max(0.0, deadline - loop.time()))
        for t in pending:
            t.cancel()
    records = list(await asyncio.gather(*tasks))
    for i in range(len(tasks), len(trace.requests)):
        r = trace.requests[i]
        records.append(RequestRecord(i, r.prompt_tokens, r.output_tokens, r.arrival_s, "aborted",
                                     error="not sent: the replay's timeout ran out"))
    return records


# ---- the in-process cluster ------------------------------------------------------------------------
class _Sampler:
    """Every ``period`` seconds: each instance's busy seconds and role (the timeline plot), loop lag."""

    def __init__(self, cluster, base: float, busy0: dict, period: float = SAMPLE_PERIOD_S):
        self.cluster, self.base, self.busy0, self.period = cluster, base, busy0, period
        self.samples: dict[str, list] = {iid: [] for iid in cluster.instances}
        self.max_lag = 0.0

    def take(self) -> None:
        t = self.cluster.clock.now() - self.base
        for iid, inst in self.cluster.instances.items():
            self.samples.setdefault(iid, []).append((t, inst.busy_s - self.busy0.get(iid, 0.0), inst.role))
        self.max_lag = max(self.max_lag, self.cluster.loop_lag_s)

    async def run(self) -> None:
        while True:
            self.take()
            await asyncio.sleep(self.period)

    def flips(self) -> int:
        return sum(a[2] != b[2] for s in self.samples.values() for a, b in zip(s, s[1:]))


async def _cluster_request(cluster, i: int, req: TraceRequest, ids: list[int], base: float,
                           progress: ReplayProgress, cap: int) -> RequestRecord:
    arrival = cluster.clock.now() - base
    # on a virtual clock (a simulated device) only the final event is streamed: the bar advances
    # a request at a time there, and the run skips a wake-up per token
    per_token = getattr(asyncio.get_running_loop(), "clock", None) is None
    try:
        # the trace's output length is exactly what will be generated: the oracle predictor's answer
        handle = cluster.submit(ids, sampling_for(req, cap), request_id=f"trace-{i}", prompt_text=req.prompt_text or "",
                                oracle_length=req.output_tokens, stream_tokens=per_token)
    except ValueError as e:  # PromptTooLong and bad parameters
        progress.request_done()
        return RequestRecord(i, len(ids), req.output_tokens, arrival, "failed", error=str(e))
    cancelled = False
    try:
        async for ev in cluster.stream(handle):
            if ev.token_id is not None:
                progress.token()
    except asyncio.CancelledError:
        cancelled = True  # stream()'s finally aborted the request and freed its blocks
    if not per_token:
        progress.tokens(len(handle.token_times))
    progress.request_done()
    r = handle.request
    status = "aborted" if cancelled or r.finish_reason == "abort" else "failed" if r.finish_reason == "error" else "completed"
    rel = {k: v - base for k, v in r.times.items() if isinstance(v, float) and k != "transfer_real_s"}
    return RequestRecord(i, len(ids), req.output_tokens, rel.get("arrival", arrival), status,
                         scheduled_s=rel.get("scheduled"), first_token_s=rel.get("first_token"),
                         finish_s=rel.get("finish"), token_times=tuple(t - base for t in handle.token_times),
                         num_preemptions=r.num_preemptions, error=r.error, cached_tokens=r.num_cached_tokens)


async def _warm_up(cluster, vocab: int) -> None:
    """One tiny request per entry instance, so the first system measured pays no cold start."""
    entry = [i for i in cluster.instances.values() if i.role in ("prefill", "coupled")]
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    handles = [cluster.submit([rng.randrange(3, vocab) for _ in range(16)], sp, request_id=f"warmup-{k}")
               for k in range(len(entry))]
    for h in handles:
        async for _ in cluster.stream(h):
            pass


def _counters(cluster) -> dict:
    return {iid: (i.busy_s, i.num_prefill_tokens, i.num_decode_tokens, i.num_pad_tokens)
            for iid, i in cluster.instances.items()}


def _evictions(cluster) -> dict:
    """Blocks each instance has evicted from its prefix cache so far (0 with the cache off)."""
    return {iid: i.blocks.num_evictions for iid, i in cluster.instances.items()}


KV_TOTALS = ("bytes", "emulated_bytes", "num_done", "real_copy_s", "emulated_s")


def _kv_totals(cluster) -> dict:
    """KV hand-overs so far, over every link: bytes copied, bytes the link was charged (a
    simulated device copies none), transfers, real copy and emulated seconds; and on Ray, how
    many went actor to actor directly and how many through the object store."""
    stats = [link.stats() for link in cluster.handoff.links.values()]
    totals = {k: sum(s.get(k, 0) for s in stats) for k in KV_TOTALS}
    for inst in cluster.instances.values():
        for transport, n in getattr(inst.device, "kv_sent", {}).items():
            key = f"sent_{transport.replace('-', '_')}"
            totals[key] = totals.get(key, 0) + n
    return totals


def _predictor_delta(before: dict, after: dict, latency: LatencyHistogram, latency_count_before: int) -> dict:
    """The predictor's counts over the replay alone (warm-up requests taken out), and the
    latency (submit to answer, on the loop's clock) of the predictions that came back."""
    d = {k: after[k] - before[k] for k in ("predictions", "fallbacks", "hits", "scored", "from_prefill")}
    d["latency_p50_s"] = latency.quantile(0.5, since=latency_count_before)
    d["latency_p99_s"] = latency.quantile(0.99, since=latency_count_before)
    d["fallback_reasons"] = {r: n - before["fallback_reasons"].get(r, 0) for r, n in after["fallback_reasons"].items()}
    d["accuracy"] = d["hits"] / d["scored"] if d["scored"] else None
    return {"name": after["name"], "granularity": after["granularity"], "mode": after["mode"],
            "features": after["features"], **d}


async def replay_cluster(spec: SystemSpec, trace: Trace, prompts: Sequence[list[int]], bundle,
                         progress: Optional[ReplayProgress] = None, warmup: bool = True,
                         timeout_s: Optional[float] = None, step_log=None) -> SystemRun:
    """Replay ``trace`` on a fresh in-process cluster built from ``spec`` over ``bundle``;
    ``step_log`` (a ``StepLog``): every step after the warm-up is written to it."""
    from aserve.cluster.cluster import Cluster

    progress = progress or ReplayProgress(False)
    # on a virtual-time loop (simulated devices) the cluster reads the loop's clock
    cluster = Cluster(spec.engine, spec.cluster, bundle=bundle, clock=getattr(asyncio.get_running_loop(), "clock", None))
    await cluster.start()
    if spec.engine.device.startswith("cuda"):  # each instance's share of the card, and its graphs
        for line in cluster.device_lines():
            print(f"aserve: {spec.name}: {line}", file=sys.stderr, flush=True)
    try:
        free0 = cluster.free_blocks()
        if warmup:
            await _warm_up(cluster, len(bundle.tokenizer))
        placed0 = dict(cluster.placements)  # after the warm-up: the trace's requests only
        moves0 = len(cluster.placer.move_log)
        if step_log is not None:
            step_log.start_system(spec.name, cluster.clock.now)
            cluster.log_steps(step_log)
        c0, kv0, base = _counters(cluster), _kv_totals(cluster), cluster.clock.now()
        ev0 = _evictions(cluster)
        pred0 = cluster.predictor.snapshot()
        lat0 = pred0["latency"]["count"]
        sampler = _Sampler(cluster, base, {k: v[0] for k, v in c0.items()})
        task = asyncio.create_task(sampler.run())
        progress.system(spec.name, trace)
        longest = max((r.output_tokens for r in trace.requests), default=1)
        send = lambda i: _cluster_request(cluster, i, trace.requests[i], prompts[i], base, progress,  # noqa: E731
                                          replay_cap(longest, bundle.args.max_position, len(prompts[i])))
        try:
            wall0 = time.perf_counter()
            records = await drive(trace, send, timeout_s)
            wall_s = time.perf_counter() - wall0
        finally:
            task.cancel()
        await asyncio.sleep(0)  # let finished handoffs release their source blocks
        cluster.log_steps(None)
        sampler.take()
        c1, free1 = _counters(cluster), cluster.free_blocks()
        instances = tuple(InstanceRecord(iid, inst.role, c1[iid][0] - c0[iid][0], c1[iid][1] - c0[iid][1],
                                         c1[iid][2] - c0[iid][2], c1[iid][3] - c0[iid][3], free0[iid], free1[iid],
                                         tuple(sampler.samples.get(iid, ())))
                          for iid, inst in cluster.instances.items())
        flips = max(sampler.flips(), cluster.lifecycle.counts["flips"])
        kv = {k: v - kv0.get(k, 0) for k, v in _kv_totals(cluster).items()}
        evicted = sum(n - ev0.get(iid, 0) for iid, n in _evictions(cluster).items())
        return SystemRun(spec.name, tuple(records), instances, int(kv["bytes"]), flips, sampler.max_lag,
                         wall_s=wall_s, cache_evictions=evicted,
                         config={"engine": asdict(spec.engine), "cluster": asdict(spec.cluster)},
                         flip_log=tuple(cluster.lifecycle.flip_log), kv_transfer=kv,
                         placements=({k: v - placed0.get(k, 0) for k, v in cluster.placements.items()}
                                     if spec.cluster.mode == "adaptive" else None),
                         move_log=tuple({**m, "at": m["at"] - base} for m in cluster.placer.move_log[moves0:]),
                         failures=tuple(_failure(f) for f in cluster.lifecycle.failure_log), predictor=_predictor_delta(pred0, cluster.predictor.snapshot(),
                                                                    cluster.predictor.latency, lat0))
    finally:
        await cluster.stop()


def _failure(record: dict) -> dict:
    return {k: record[k] for k in ("instance", "why", "requests", "recovered_s")}


async def replay_systems(specs: Sequence[SystemSpec], trace: Trace, prompts: Sequence[list[int]], bundle,
                         progress: Optional[ReplayProgress] = None, warmup: bool = True,
                         timeout_s: Optional[float] = None, step_log=None) -> list[SystemRun]:
    """Each system in turn on the same trace, prompts and model bundle (and step log)."""
    runs = []
    for spec in specs:
        runs.append(await replay_cluster(spec, trace, prompts, bundle, progress, warmup, timeout_s, step_log))
    return runs
