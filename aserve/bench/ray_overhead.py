"""``aserve bench ray``: what running each instance in a Ray actor costs, against threads of one process.

Two devices of each kind over the same model and config, side by side in one run, rounds
alternating between the kinds so both see the same machine minutes:

- **per-step overhead**: the same plans (one decode row, a decode batch, a prompt chunk) timed
  from the driver's side, ``await device.execute(plan)``; in-process that is the executor thread's
  round trip, through Ray the plan's and output's trip to the actor and back. The overhead is
  the Ray step's median minus the in-process step's median (and, per Ray step, its round trip
  beyond the actor's own busy time);
- **KV hand-over throughput**: ``send_kv`` of n blocks from device a to device b over a link so
  fast its emulated time is nil, so the record's real copy time is the transfer alone: in-process
  one ``index_select``/``index_copy_`` on the copy thread; between the Ray actors both ways, in
  the same rounds: directly (the default: on one host the sender gathers the blocks into a
  shared-memory segment the receiver copies from into its pool, across hosts it streams them
  over a socket, aserve/devices/kv_wire.py), over the socket always, and through the object
  store (an export, a fetch and a copy into the other actor's pool). Real bytes per second, median of rounds.

The pools hold zeros: a step's cost does not depend on the values.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Callable, Optional, Sequence

from rich.console import Console
from rich.table import Table

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.device import Device
from aserve.devices.torch_device import TorchDevice
from model.kv_cache import kv_bytes_per_block
from netemu import KVLink, LinkProfile
from scheduling.clock import MonotonicClock
from scheduling.step import GREEDY, SeqStep, StepPlan

NIL_LINK = LinkProfile("nil", 1e18, 0.0)  # emulated time ~0: the record's time is the real copy's
CONTEXT = 128  # tokens of context of every decode row


def plans(block_size: int, decode_batch: int, chunk: int) -> dict[str, StepPlan]:
    """The timed steps, each over its own blocks (ids from 0 up)."""
    per_row = -(-(CONTEXT + 1) // block_size)

    def decode_row(i: int) -> SeqStep:
        return SeqStep(f"d{i}", (7,), CONTEXT, tuple(range(i * per_row, (i + 1) * per_row)), GREEDY)

    prompt = SeqStep("p", tuple(range(100, 100 + chunk)), 0, tuple(range(-(-chunk // block_size))), GREEDY)
    return {"decode x1": StepPlan((decode_row(0),)),
            f"decode x{decode_batch}": StepPlan(tuple(decode_row(i) for i in range(decode_batch))),
            f"prefill {chunk}": StepPlan((prompt,))}


async def _time_steps(device: Device, plan: StepPlan, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await device.execute(plan)
        times.append(time.perf_counter() - t0)
    return times


async def _time_send(src: Device, dst: Device, n: int, link: KVLink) -> float:
    ids = list(range(n))
    record = await src.send_kv(f"kv{n}", ids, dst, ids, link, num_tokens=n * src.block_size)
    return record.real_copy_s


def _copy_ways(kind: str) -> list[str]:
    """How KV goes between two devices of ``kind``: a Ray device both ways, direct first."""
    if kind != "ray":
        return [kind]
    return [f"ray {t}" for t in ("direct", "socket", "object-store")]


async def measure(make: dict[str, Callable[[str], Device]], step_plans: dict[str, StepPlan],
                  kv_blocks: Sequence[int], block_bytes: int, rounds: int, reps: int) -> dict:
    """Per kind: every plan's step times and every size's real copy times, rounds alternating."""
    devices = {kind: (mk(f"{kind}-a"), mk(f"{kind}-b")) for kind, mk in make.items()}
    await asyncio.gather(*(d.ready() for pair in devices.values() for d in pair))
    ways = {kind: _copy_ways(kind) for kind in devices}
    links = {way: KVLink(NIL_LINK, MonotonicClock()) for w in ways.values() for way in w}
    steps = {kind: {name: [] for name in step_plans} for kind in make}
    copies = {way: {n: [] for n in kv_blocks} for w in ways.values() for way in w}

    async def send(kind: str, way: str, n: int) -> float:
        a, b = devices[kind]
        if kind == "ray":
            a.kv_transport = way.removeprefix("ray ")
        return await _time_send(a, b, n, links[way])

    try:
        for kind, (a, b) in devices.items():  # warm-up: first steps and copies pay one-off costs
            for plan in step_plans.values():
                await _time_steps(a, plan, 2)
            for way in ways[kind]:
                await send(kind, way, kv_blocks[0])
        for _ in range(rounds):
            for kind, (a, b) in devices.items():
                for name, plan in step_plans.items():
                    steps[kind][name] += await _time_steps(a, plan, reps)
                for n in kv_blocks:
                    for way in ways[kind]:
                        copies[way][n].append(await send(kind, way, n))
        extra = {kind: getattr(a, "overhead_s", 0.0) / max(1, getattr(a, "num_steps", 0))
                 for kind, (a, _) in devices.items()}
    finally:
        for pair in devices.values():
            for d in pair:
                await d.close()
    return {"steps_s": {k: {name: statistics.median(v) for name, v in s.items()} for k, s in steps.items()},
            "round_trip_beyond_busy_s": extra,
            "ray_nodes_apart": _apart(devices.get("ray")),
            "ray_step_path": getattr(devices["ray"][0], "step_path", None) if "ray" in devices else None,
            "kv_bytes_per_s": {k: {n: n * block_bytes / statistics.median(v) for n, v in c.items()}
                               for k, c in copies.items()},
            "block_bytes": block_bytes}


def _apart(pair) -> Optional[bool]:
    """Whether the two Ray devices' actors ran on different Ray nodes (None: no Ray pair)."""
    if not pair:
        return None
    a, b = pair
    return getattr(a, "node_id", None) != getattr(b, "node_id", None)


def run_ray_bench(engine: EngineConfig, address: Optional[str], decode_batch: int = 16, chunk: int = 128,
                  kv_blocks: Sequence[int] = (4, 32, 128), rounds: int = 5, reps: int = 10,
                  json_path: Optional[str] = None, nodes: int = 1) -> dict:
    """``nodes`` > 1: a local Ray of that many nodes (each its own raylet and object store), the
    machine's cores split between them, so the two Ray devices' actors land on different nodes."""
    from aserve.devices import ray_runtime
    from aserve.devices.ray_device import RayDevice

    bundle = ModelBundle.load(engine)
    harness = ray_runtime.local_nodes(nodes) if nodes > 1 else None
    owned = ray_runtime.connect(harness.address if harness else address)
    threads = max(1, (engine.num_threads or ray_runtime.total_cpus()) // 2)
    make = {"in-process": lambda name: TorchDevice(name, bundle, engine, threads),
            "ray": lambda name: RayDevice(name, engine, bundle, threads, threads, lease_s=60, start_timeout_s=600)}
    try:
        block_bytes = kv_bytes_per_block(bundle.args, engine.block_size, bundle.dtype)
        result = asyncio.run(measure(make, plans(engine.block_size, decode_batch, chunk), kv_blocks, block_bytes,
                                     rounds, reps))
    finally:
        if owned:
            ray_runtime.disconnect()
        if harness is not None:
            harness.shutdown()
    result.update(model=engine.model, dtype=str(bundle.dtype), threads_per_device=threads, rounds=rounds, reps=reps,
                  nodes=nodes, date=time.strftime("%Y-%m-%d"))
    _print(result, Console())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


def _print(r: dict, console: Console) -> None:
    local, ray = r["steps_s"]["in-process"], r["steps_s"]["ray"]
    t = Table(title=f"per step, median ms ({r['threads_per_device']} threads a device)")
    for col in ("step", "in-process", "ray", "overhead"):
        t.add_column(col, justify="right")
    for name in local:
        t.add_row(name, f"{local[name] * 1e3:.2f}", f"{ray[name] * 1e3:.2f}", f"{(ray[name] - local[name]) * 1e3:+.2f}")
    console.print(t)
    console.print(f"ray round trip beyond the actor's busy time: {r['round_trip_beyond_busy_s']['ray'] * 1e3:.2f} ms a step "
                  f"(steps by {r.get('ray_step_path')})")
    where = "on different Ray nodes" if r.get("ray_nodes_apart") else "on one Ray node"
    console.print(f"the two actors ran {where} ({r.get('nodes', 1)} node(s) in the cluster)")
    k = Table(title=f"KV hand-over, real copy (blocks of {r['block_bytes']:,d} bytes)")
    ways = list(r["kv_bytes_per_s"])
    for col in ("blocks", "bytes", *(f"{w} GB/s" for w in ways)):
        k.add_column(col, justify="right")
    for n in r["kv_bytes_per_s"]["in-process"]:
        k.add_row(str(n), f"{n * r['block_bytes']:,d}", *(f"{r['kv_bytes_per_s'][w][n] / 1e9:.2f}" for w in ways))
    console.print(k)
