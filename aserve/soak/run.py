"""One soak, start to end, in this process: the cluster and its HTTP server on this loop, the
client on its own thread.

    start cluster + server ─► client sends for duration_s ─► faults stop; due re-adds happen
      ─► client drains (drain_s, then the server aborts what is left) ─► wait for the cluster to
      settle ─► leftovers and leaked blocks ─► RSS sampled for SETTLED_RSS_S while idle ─► report
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Sequence

from aserve.replay.driver import SystemSpec
from aserve.replay.traces import Trace
from aserve.soak.client import LoadClient
from aserve.soak.faults import FaultInjector
from aserve.soak.probe import Probe
from aserve.soak.report import build_report
from aserve.soak.settings import SoakConfig

SETTLE_S = 60.0  # once the client is done: how long the cluster gets to hold nothing
SETTLED_RSS_S = 5.0  # then RSS is sampled this long, idle, for the end level of rss_growth


def _abort_all(cluster) -> None:
    for rid in list(cluster.requests):
        cluster.abort(rid)


def _idle(cluster) -> bool:
    live = [i for i in cluster.instances.values() if i.state == "active"]
    return (not cluster.requests and all(i.num_requests == 0 for i in live)
            and not any(cluster.handoff.moving(i.id) for i in live)
            and all(link.stats()["in_flight"] == 0 for link in cluster.handoff.links.values()))


async def settle(cluster, timeout_s: float = SETTLE_S) -> dict:
    """Wait until nothing runs, then what is left: requests still in the table, blocks not free
    on each live instance (reservations for KV included), KV transfers on the links."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not _idle(cluster) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0)  # a hand-over that just landed releases its source blocks
    live = {iid: i for iid, i in cluster.instances.items() if i.state == "active"}
    return {"leftover_requests": sorted(cluster.requests),
            "leaked_blocks": {iid: i.blocks.num_blocks - i.blocks.num_free for iid, i in live.items()},
            "links_in_flight": sum(link.stats()["in_flight"] for link in cluster.handoff.links.values())}


def _client_cuts(records) -> dict:
    return {"disconnect": sum(r.plan == "disconnect" and r.outcome == "disconnected" for r in records),
            "abort": sum(r.plan == "abort" and r.outcome == "aborted" for r in records),
            "cut_planned": sum(r.plan != "complete" for r in records)}


async def soak(spec: SystemSpec, cfg: SoakConfig, trace: Trace, prompts: Sequence[list[int]], bundle) -> dict:
    """Run one soak of ``spec`` over ``trace`` (cycled) and return its report."""
    from aserve.api.server import ApiServer, ServerSettings
    from aserve.cluster.cluster import Cluster

    cluster = Cluster(spec.engine, spec.cluster, bundle=bundle)
    await cluster.start()
    server = ApiServer(cluster, "soak", ServerSettings(shutdown_timeout_s=0))
    background: list[asyncio.Task] = []
    try:
        port = await server.start("127.0.0.1", 0)
        loop, base, counts0 = asyncio.get_running_loop(), time.monotonic(), cluster.all_counts()
        client = LoadClient(f"http://127.0.0.1:{port}", trace, prompts, cfg, base,
                            abort=lambda rid: loop.call_soon_threadsafe(cluster.abort, rid),
                            abort_all=lambda: loop.call_soon_threadsafe(_abort_all, cluster))
        probe, faults = Probe(cluster, server, cfg, base), FaultInjector(cluster, cfg, base)
        background = [asyncio.create_task(probe.lag_loop()), asyncio.create_task(probe.run())]
        injector = asyncio.create_task(faults.run())
        client.start()
        await asyncio.sleep(cfg.duration_s)
        injector.cancel()
        await faults.settle()
        records = await asyncio.to_thread(client.join)
        end = await settle(cluster)
        settled_s, probe.settled = cluster.clock.now() - base, True
        probe.take()
        await asyncio.sleep(SETTLED_RSS_S)  # probe.run() keeps sampling every sample_period_s
        probe.take()
        counts = {k: v - counts0.get(k, 0) for k, v in cluster.all_counts().items()}
        meta = {"system": spec.name, "duration_s": cfg.duration_s, "warmup_s": cfg.warmup,
                "mode": spec.cluster.mode, "kernels": bundle.kernels, "throttled_arrivals": client.num_throttled,
                "cluster_counts": counts, "links_in_flight_end": end["links_in_flight"],
                "config": {"soak": asdict(cfg), "engine": asdict(spec.engine), "cluster": asdict(spec.cluster)}}
        return build_report(meta, records, end, probe.samples, probe.lags, faults, _client_cuts(records), cfg.warmup,
                            settled_s=settled_s)
    finally:
        for task in background:
            task.cancel()
        await server.shutdown(timeout_s=0)
        await cluster.stop()
