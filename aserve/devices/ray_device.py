"""A device in another process: one Ray actor per instance, the step loop stays in the driver.

    driver process (one event loop)                       Ray actor (any host of the cluster)
    Instance: plan = scheduler.schedule()
              out = await RayDevice.execute(plan) ──plan──► step channel (a socket of their own,
                                                            aserve/devices/step_channel.py):
                                                            TorchDevice step on its step thread
                                                  ◄─(StepOutput, CPU s)─ (tokens of the whole step)
              events = scheduler.update(plan, out)         (a Ray call each where the channel
                                                            cannot connect: +2.5-6 ms a step)
    Handoff:  src.send_kv(..., dst, link) ── A.push_kv ─► bytes over A's socket to B's wire server
              (direct, the default)           ◄─ answered once B has them in its pool
                                              (on one host: through a shared-memory segment)
              or, --ray-kv object-store:      ── A.export_kv ─► object store ─► B.import_kv ─► A.release
              link.carry: the emulated link time around the real transfer time

Why the loop stays here: the schedulers, the request table, dispatch, the predictor and flips
read and write each instance's blocks and queues every step, on one thread (the thread rule);
splitting them across processes would make every one of those reads a remote call. What a step
needs crosses once: the immutable plan out, the output back, so tokens come back batched a step
at a time by construction (as vLLM's Ray executor sends ``execute_model`` to its workers).

Capacity is known before the actor is up: the actor's pool is sized by the same rule
(``pool_num_blocks``) from the same config and model, and ``ready`` checks it. A dead actor
(killed, its host gone) fails the step in flight, or is seen at once by ``watch``; either way
the instance goes through the failed-instance path (aserve/cluster/lifecycle.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import ray
import torch
from ray.exceptions import RayError

from aserve.config import RAY_KV_TRANSPORTS as KV_TRANSPORTS, EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.device import Device, DeviceFault
from aserve.devices.device_host import DeviceHost
from aserve.devices.step_channel import ChannelClosed, StepChannel, StepError
from aserve.devices.torch_device import pool_num_blocks, swap_num_blocks
from netemu.transfer import TransferError, block_nbytes, check_blocks
from scheduling.step import StepOutput, StepPlan

log = logging.getLogger(__name__)
RemoteHost = ray.remote(DeviceHost)  # an asyncio actor: its methods are coroutines
CODE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding aserve/, model/, ...
CLOSE_WAIT_S = 30.0  # how long close waits for a live actor's step in flight

# the secret this driver's connections present to its actors' step channels and KV wire servers,
# and the actors to each other's (never logged)
WIRE_TOKEN = secrets.token_hex(16)


def actor_niceness() -> str:
    """The nice value of the instances' actors: the driver's ``RAY_worker_niceness`` if set, else
    0. Ray starts its workers at 15 so that its own daemons come first; but these actors are the
    server's steps, which in one process run at the driver's priority, and at 15 a nice-0
    process on the host (the driver's own loop, a client) takes ~28x their share of a core
    whenever both want it (CFS weights 1024 against 36)."""
    return os.environ.get("RAY_worker_niceness", "0")


def actor_options(engine: EngineConfig, num_cpus: float) -> dict:
    """Ray resources of one instance's actor: its share of the CPUs, or one GPU. The actors
    import this same code: its folder goes first on their ``PYTHONPATH`` (hosts that lack the
    folder use the aserve they have installed, which must be the same version). They run at
    ``actor_niceness()``."""
    gpus = 0 if engine.device == "cpu" else 1
    return {"num_cpus": num_cpus if not gpus else 1, "num_gpus": gpus,
            "runtime_env": {"env_vars": {"PYTHONPATH": CODE_ROOT, "RAY_worker_niceness": actor_niceness()}}}


class RayDevice(Device):
    """The driver's side of one instance's actor. ``bundle`` gives the model's shape (the pool's
    size and block layout); the actor loads the weights itself, on its own host."""

    def __init__(self, name: str, engine: EngineConfig, bundle: ModelBundle, num_threads: int, num_cpus: float,
                 lease_s: float, start_timeout_s: float, kv_transport: str = "direct",
                 scheduling: Optional[dict] = None, placement: str = ""):
        """``kv_transport``: direct (actor to actor: through shared memory on one host, else over a
        socket of their own, which only this driver's actors may write to: ``WIRE_TOKEN``), socket
        (actor to actor, the socket always) or object-store; steps take the step channel
        either way. ``scheduling``: extra Ray
        options for the actor (its placement group's bundle, its hosts' mark: ray_placement.py),
        which ``placement`` says in words."""
        super().__init__()
        if kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"bad KV transport {kv_transport!r}: {' or '.join(KV_TRANSPORTS)}")
        self.name, self.cfg, self.start_timeout_s = name, engine, start_timeout_s
        self.block_size = engine.block_size
        self.num_blocks = pool_num_blocks(bundle.args, bundle.dtype, engine)
        self._args, self._dtype = bundle.args, bundle.dtype
        a = bundle.args  # the pool's shape, for checking hand-overs here without the tensors
        self.pool = torch.empty((a.num_layers, 2, self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim),
                                dtype=bundle.dtype, device="meta")
        self.kind = f"ray:{engine.device}"
        self.options = actor_options(engine, num_cpus)
        self.placement = placement
        self.kv_transport = kv_transport  # the actor has its wire either way; this says whether pushes use it
        self.actor = RemoteHost.options(**self.options, **(scheduling or {})).remote(
            name, engine, num_threads, lease_s, wire_token=WIRE_TOKEN)
        self.wire_address: Optional[tuple] = None  # the actor's KV wire server, once up
        self.node_id: Optional[str] = None  # the Ray node the actor runs on, once up
        self.niceness: Optional[int] = None  # the actor process's nice value, once up
        # hand-overs sent: actor to actor (of them, through shared memory) or through the object store
        self.kv_sent = {"direct": 0, "shared-memory": 0, "object-store": 0}
        self._channel: Optional[StepChannel] = None  # the actor's step channel, once up
        self.step_path = "ray call"  # how steps reach the actor: "channel" once its channel is open
        self._info = self.actor.info.remote()
        self._ready: Optional[asyncio.Future] = None
        self._watcher: Optional[asyncio.Task] = None
        self._closing = False
        self._swap_blocks: Optional[int] = None
        self.num_steps, self.overhead_s = 0, 0.0  # steps, and their round trip beyond the actor's busy time

    # ---- start ----------------------------------------------------------------------------------
    async def ready(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._wait_up())
        if not self._ready.done():  # every step asks: once up, no await at all
            await asyncio.shield(self._ready)
        self._ready.result()  # a start that failed fails every step

    async def _wait_up(self) -> None:
        try:
            info = await asyncio.wait_for(_future(self._info), self.start_timeout_s)
        except asyncio.TimeoutError:
            raise DeviceFault(f"instance {self.name}: its Ray actor was not up within {self.start_timeout_s:g} s "
                              f"(it asks for {self._asks()}; free now: {_free()})") from None
        except RayError as e:
            raise DeviceFault(f"instance {self.name}: its Ray actor failed to start: {_why(e)}") from None
        if (info["num_blocks"], info["block_size"]) != (self.num_blocks, self.block_size):
            raise DeviceFault(f"instance {self.name}: the actor's pool has {info['num_blocks']} blocks of "
                              f"{info['block_size']} tokens, the driver sized {self.num_blocks} of {self.block_size} "
                              "(a different model or aserve on that host?)")
        self.kind = f"ray:{info['device']}@{info['node']}"
        self.wire_address = tuple(info["wire"]) if info.get("wire") else None
        self.node_id = info.get("node_id")
        self.niceness = info.get("nice")
        if self.niceness is not None and str(self.niceness) != actor_niceness():
            log.warning("instance %s: its actor runs at nice %s (asked for %s): its steps yield the CPU to "
                        "every process of a lower nice value on that host", self.name, self.niceness, actor_niceness())
        if info.get("steps"):
            try:
                self._channel = await StepChannel.open(info["steps"], WIRE_TOKEN, self.name)
                self.step_path = "channel"
            except ChannelClosed as e:  # a port the driver cannot reach: every step a Ray call
                log.warning("%s; its steps go as Ray calls (+2.5-6 ms each)", e)

    def _asks(self) -> str:
        o = self.options
        what = f"{o['num_gpus']} GPU" if o["num_gpus"] else f"{o['num_cpus']:.2f} CPU"
        return f"{what}, {self.placement}" if self.placement else what

    def watch(self, on_lost: Callable[[str], None]) -> None:
        async def wait_for_death():
            try:
                await self.actor.watch.remote()
            except RayError as e:
                if not self._closing:
                    on_lost(f"Ray actor of instance {self.name} died: {_why(e)}")

        self._watcher = asyncio.ensure_future(wait_for_death())

    # ---- steps ----------------------------------------------------------------------------------
    async def _execute(self, plan: StepPlan) -> StepOutput:
        await self.ready()
        t0 = time.perf_counter()
        try:
            if self._channel is not None:
                out, cpu_s = await self._channel.call("step", plan)
            else:
                out, cpu_s = await self.actor.execute.remote(plan)
        except (ChannelClosed, StepError) as e:
            raise DeviceFault(f"instance {self.name}: step failed in its Ray actor: {type(e).__name__}: {e}") from None
        except RayError as e:
            raise DeviceFault(f"instance {self.name}: step failed in its Ray actor: {_why(e)}") from None
        self.num_steps += 1
        self.overhead_s += max(0.0, time.perf_counter() - t0 - out.busy_s)
        self.cpu_s += cpu_s
        return out

    def add_swap_space(self) -> int:
        """The count is known here by the actor's own rule; the actor makes the space before
        any step it is sent after this (an actor runs one caller's calls in order)."""
        if self._swap_blocks is None:
            self._swap_blocks = swap_num_blocks(self._args, self._dtype, self.cfg)
            if self._channel is not None:  # the steps' own path, so it lands before the next one
                self._channel.post("swap")
            else:
                self.actor.add_swap_space.remote()
        return self._swap_blocks

    # ---- the KV hand-over -----------------------------------------------------------------------
    async def send_kv(self, request_id: str, block_ids: Sequence[int], dst: Device, dst_block_ids: Sequence[int],
                      link, num_tokens: int):
        """Blocks from this actor to ``dst``'s, directly (both have a wire) or through the object
        store; ``link`` (a ``netemu.KVLink``) charges the emulated time around the real transfer."""
        if not isinstance(dst, RayDevice):
            raise TypeError(f"a Ray device sends KV to a Ray device, not {type(dst).__name__}")
        src_ids, dst_ids = list(block_ids), list(dst_block_ids)
        check_blocks(request_id, self.pool, src_ids, dst.pool, dst_ids)
        nbytes = len(src_ids) * block_nbytes(self.pool)

        async def copy() -> float:
            t0 = link.clock.now()
            await self._move(request_id, src_ids, dst, dst_ids)
            return link.clock.now() - t0

        return await link.carry(request_id, nbytes, num_tokens, copy)

    def transport_to(self, dst: "RayDevice") -> str:
        """How a hand-over to ``dst`` goes: direct (actor to actor) where both ends have a wire and
        this device was started with the direct or socket transport, else through the object store."""
        direct = self.kv_transport != "object-store" and self.wire_address is not None and dst.wire_address is not None
        return "direct" if direct else "object-store"

    async def _move(self, request_id: str, src_ids: list[int], dst: "RayDevice", dst_ids: list[int]) -> None:
        """Push straight to ``dst`` (it answers once the blocks are in its pool), or export here
        and import there (which confirms to us). A cancel lets the call under way end first: a
        write still running lands in blocks the caller is about to free."""
        job = None
        transport = self.transport_to(dst)
        try:
            if transport == "direct":
                job = _future(self.actor.push_kv.remote(request_id, src_ids, dst.wire_address, dst_ids,
                                                        shared=self.kv_transport == "direct"))
                pushed = await asyncio.shield(job)
                self.kv_sent["shared-memory"] += pushed["via"] == "shared memory"
            else:
                job = _future(self.actor.export_kv.remote(request_id, src_ids))
                refs = await asyncio.shield(job)
                job = _future(dst.actor.import_kv.remote(request_id, refs, dst_ids, self.actor))
                await asyncio.shield(job)
            self.kv_sent[transport] += 1
        except asyncio.CancelledError:
            if job is not None:
                await asyncio.wait([job])
            self.actor.release.remote(request_id)
            raise
        except RayError as e:
            self.actor.release.remote(request_id)  # harmless if this actor is the one that died
            raise TransferError(f"request {request_id!r}: KV transfer {self.name} -> {dst.name} failed: "
                                f"{_why(e)}") from None

    async def held(self) -> dict:
        """The actor's pinned exports and counters (tests, views)."""
        return await self.actor.held.remote()

    async def close(self) -> None:
        """Let the step in flight end, then end the actor (a dead one: nothing to wait for)."""
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._channel is not None:
            await self._channel.close()
        up = self._ready is not None and self._ready.done() and not self._ready.cancelled() \
            and self._ready.exception() is None
        if up:  # an actor that never came up has no step in flight
            try:
                await asyncio.wait_for(_future(self.actor.close.remote()), CLOSE_WAIT_S)
            except (RayError, asyncio.TimeoutError):
                pass
        ray.kill(self.actor, no_restart=True)


def _future(ref) -> asyncio.Future:
    """An ``ObjectRef`` as an asyncio future of the running loop (shieldable, waitable)."""
    return asyncio.wrap_future(ref.future())


def _free() -> str:
    free = ray.available_resources()
    return ", ".join(f"{free.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


def _why(e: BaseException) -> str:
    """What happened, in one line: an error raised in the actor as itself (Ray wraps it with the
    remote traceback), else the first line of Ray's own message (an actor that died, ...)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(cause, RayError):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
