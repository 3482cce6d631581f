"""What runs inside one instance's Ray actor: a ``TorchDevice`` and the KV it has exported.

    driver (RayDevice) ──execute(plan)──► DeviceHost.execute ──► TorchDevice (its executor thread)
                       ◄──(StepOutput, CPU s)── one round trip a step: every token of the step in it

    KV hand-over, prefill actor A ──► decode actor B (the driver only passes references):
      A.export_kv(rid, blocks)     gather the blocks, put them in Ray's object store (A owns the
                                   object), pin it: exports[rid] = (ref, deadline = now + lease)
      B.import_kv(rid, [ref], blocks, A)   fetch the bytes (across hosts: Ray moves them), copy
                                   them into B's pool, then tell A: A.release(rid) = confirmed
      no confirmation within the lease (B died, the driver gave up): A's sweeper drops the pin

    or directly (the default, aserve/devices/kv_wire.py): A.push_kv(rid, blocks, B's wire
    address, B's blocks) gathers the blocks and streams them to B's wire server, which writes
    them into B's pool on B's copy thread and acknowledges (on one host A gathers them into a
    shared-memory segment instead and B copies them from there: no bytes on the socket);
    nothing is put in the object store and nothing is pinned, so there is no lease to run out

The class is plain Python: ``RayDevice`` wraps it with ``ray.remote`` as an asyncio actor, so a
step, an export and an import interleave at their awaits (the forward on the device's step
thread, the copies on its copy thread, as in one process); tests drive it without Ray. Blocks
a step and a copy touch never overlap: the driver's block managers decide both (the thread rule
of one process, kept across two).
"""
from __future__ import annotations

import asyncio
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices import kv_wire
from aserve.devices.step_channel import StepChannelServer
from aserve.devices.torch_device import TorchDevice
from scheduling.clock import Clock, MonotonicClock
from scheduling.step import StepOutput, StepPlan

SWEEP_MAX_S = 1.0  # the sweeper looks at the exports at least this often


@dataclass
class Export:
    """KV blocks of one request, pinned in the object store until confirmed or expired."""

    ref: Any  # the object store's reference (whatever ``put`` returned)
    nbytes: int
    deadline: float


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The inverse view, no copy. The object store's buffer is read-only; we only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        flat = torch.from_numpy(data)
    return flat.view(dtype).view(*shape)


class DeviceHost:
    """One instance's device in its own process. ``put`` stores an object and returns its
    reference, keeping a copy (``ray.put`` in an actor); ``get`` awaits one (awaiting a Ray ``ObjectRef``)."""

    def __init__(self, name: str, engine: EngineConfig, num_threads: int, lease_s: float,
                 bundle: Optional[ModelBundle] = None, put: Optional[Callable[[Any], Any]] = None,
                 get: Optional[Callable[[Any], Any]] = None, clock: Optional[Clock] = None,
                 wire_token: Optional[str] = None, wire_host: Optional[str] = None):
        """``wire_token``: the cluster's secret for the step channel and direct KV pushes (None:
        neither server, steps as Ray calls and KV through the object store only); both listen on
        ``wire_host`` (default: this node's address)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.name, self.lease_s = name, lease_s
        self.device = TorchDevice(name, bundle or ModelBundle.load(engine), engine, num_threads)
        self.clock = clock or MonotonicClock()
        self._put, self._get = put or _ray_put, get or _await
        self.exports: dict[str, Export] = {}
        self.counts = {"exported": 0, "confirmed": 0, "expired": 0, "imported": 0, "pushed": 0, "received": 0}
        self._sweeper: Optional[asyncio.Task] = None
        self.wire: Optional[kv_wire.KVWireServer] = None
        self._sender: Optional[kv_wire.KVWireSender] = None
        self.steps: Optional[StepChannelServer] = None  # the driver's steps, on a socket of their own
        if wire_token is not None:
            host = wire_host or _node_address()
            host = "127.0.0.1" if host == "local" else host
            self.wire = kv_wire.KVWireServer(host, wire_token, self._check_incoming, self._write_incoming)
            self._sender = kv_wire.KVWireSender(wire_token)
            self.steps = StepChannelServer(host, wire_token, self._on_frame)
        self._staging = kv_wire.Staging()  # the gathered blocks of pushes, buffers reused
        self._shared = kv_wire.SharedStaging()  # the same, in /dev/shm: pushes to an actor on this host

    def info(self) -> dict:
        """What the driver checks once the actor is up: the pool it promised, where it runs."""
        pool = self.device.kv.pool
        return {"num_blocks": self.device.num_blocks, "block_size": self.device.block_size,
                "pool_shape": tuple(pool.shape), "dtype": pool.dtype, "device": self.device.kind,
                "node": _node_address(), "node_id": _node_id(), "pid": os.getpid(), "nice": os.nice(0),
                "wire": self.wire.address if self.wire is not None else None,
                "steps": self.steps.address if self.steps is not None else None}

    async def execute(self, plan: StepPlan) -> tuple[StepOutput, float]:
        """One step; the CPU seconds it took ride along (the driver's device keeps the sum)."""
        self._sweep_soon()
        cpu0 = self.device.cpu_s
        out = await self.device.execute(plan)
        return out, self.device.cpu_s - cpu0

    def add_swap_space(self) -> int:
        return self.device.add_swap_space()

    def _on_frame(self, kind: str, payload: Any) -> Any:
        """The step channel's frames, on its connection's thread: a step (its output and CPU
        seconds, as ``execute`` answers), or making the swap space."""
        if kind == "step":
            cpu0 = self.device.cpu_s
            out = self.device.execute_blocking(payload)
            return out, self.device.cpu_s - cpu0
        if kind == "swap":
            return self.device.add_swap_space()
        raise ValueError(f"unknown step-channel frame {kind!r}")

    # ---- the hand-over ------------------------------------------------------------------------
    async def export_kv(self, request_id: str, block_ids: Sequence[int]) -> list:
        """Put the request's blocks in the object store, pinned for ``lease_s``; returns the
        reference in a list (so Ray passes the reference on instead of the bytes)."""
        self._sweep_soon()
        if request_id in self.exports:  # a retry: the earlier export is stale
            self.release(request_id)
        ids = list(block_ids)

        def gather() -> tuple[Any, int]:
            data = self._gather(ids)
            try:
                return self._put(data), data.nbytes  # the store keeps a copy: the buffer is free again
            finally:
                self._staging.give(data)

        ref, nbytes = await asyncio.get_running_loop().run_in_executor(self.device.copier(), gather)
        self.exports[request_id] = Export(ref, nbytes, self.clock.now() + self.lease_s)
        self.counts["exported"] += 1
        return [ref]

    async def import_kv(self, request_id: str, refs: list, block_ids: Sequence[int], sender=None) -> int:
        """Copy exported blocks into ``block_ids`` of this pool, then confirm to ``sender`` (the
        exporting actor's handle, or a ``DeviceHost`` in tests). Returns the bytes copied."""
        self._sweep_soon()
        ids = list(block_ids)
        data = await self._get(refs[0])
        pool = self.device.kv.pool
        shape = (*pool.shape[:2], len(ids), *pool.shape[3:])
        want = len(ids) * self.device.kv.block_bytes
        if data.nbytes != want:
            raise ValueError(f"request {request_id!r}: {data.nbytes} bytes exported for {len(ids)} blocks "
                             f"of {self.device.kv.block_bytes} bytes here")
        blocks = _from_bytes(data, pool.dtype, shape)
        await asyncio.get_running_loop().run_in_executor(self.device.copier(), self.device.kv.blocks_from, ids, blocks)
        self.counts["imported"] += 1
        if sender is not None:
            _confirm(sender, request_id)
        return want

    async def push_kv(self, request_id: str, block_ids: Sequence[int], address: Sequence,
                      dst_block_ids: Sequence[int], shared: bool = True) -> dict:
        """Send this pool's ``block_ids`` straight to the wire server at ``address`` (another
        actor's), into its ``dst_block_ids``; returns once that actor has them in its pool:
        ``{"bytes": n, "via": "shared memory" | "socket"}``. ``shared``: on one host, through a
        shared-memory segment (else always over the socket). Raises ``kv_wire.WireError`` if they
        did not land."""
        if self._sender is None:
            raise RuntimeError(f"instance {self.name} was started without a KV wire (object store only)")
        ids = list(block_ids)
        staging = self._shared if shared and self._sender.can_share(address) else self._staging
        data = await asyncio.get_running_loop().run_in_executor(self.device.copier(), self._gather, ids, staging)
        shm = staging.name_of(data) if staging is self._shared else None
        try:
            sent, via = await asyncio.to_thread(self._sender.push, address, request_id, list(dst_block_ids), data, shm)
        finally:
            staging.give(data)
        self.counts["pushed"] += 1
        return {"bytes": sent, "via": via}

    def _gather(self, ids: list[int], staging: Optional[kv_wire.Staging] = None) -> np.ndarray:
        """The blocks, in ``blocks_to``'s byte order ([L, 2, n, block, H, D]), into a reused
        buffer of ``staging`` (default: this host's private one)."""
        pool = self.device.kv.pool
        flat = pool.view(pool.shape[0] * pool.shape[1], pool.shape[2], -1)  # a block's slab is contiguous
        data = (staging or self._staging).take(len(ids) * self.device.kv.block_bytes)
        out = torch.from_numpy(data).view(pool.dtype).view(flat.shape[0], len(ids), flat.shape[2])
        idx = torch.tensor(ids, dtype=torch.long, device=pool.device)
        if pool.device.type == "cpu":
            torch.index_select(flat, 1, idx, out=out)
        else:  # a GPU pool: gathered on the device, then one copy into the host buffer
            out.copy_(flat.index_select(1, idx))
        return data

    def _check_incoming(self, request_id: str, block_ids: list[int], nbytes: int) -> Optional[str]:
        """The wire server's check of a push's header, before any byte of it is read."""
        n = self.device.num_blocks
        bad = [i for i in block_ids if not 0 <= i < n]
        if bad:
            return f"request {request_id!r}: blocks {bad[:4]} are outside this pool of {n}"
        if len(set(block_ids)) != len(block_ids):
            return f"request {request_id!r}: a block appears twice in {block_ids}"
        want = len(block_ids) * self.device.kv.block_bytes
        if nbytes != want:
            return (f"request {request_id!r}: {nbytes} bytes pushed for {len(block_ids)} blocks "
                    f"of {self.device.kv.block_bytes} bytes here")
        return None

    def _write_incoming(self, request_id: str, block_ids: list[int], data: np.ndarray) -> None:
        """On a wire connection's thread: the payload into the pool, on the device's copy thread
        (as every other copy into this pool)."""
        pool = self.device.kv.pool
        blocks = _from_bytes(data, pool.dtype, (*pool.shape[:2], len(block_ids), *pool.shape[3:]))
        self.device.copier().submit(self.device.kv.blocks_from, block_ids, blocks).result()
        self.counts["received"] += 1

    def release(self, request_id: str) -> bool:
        """The receiver has the blocks (or the driver gave up on the transfer): unpin them."""
        export = self.exports.pop(request_id, None)
        if export is not None:
            self.counts["confirmed"] += 1
        return export is not None

    def expire(self) -> list[str]:
        """Unpin every export whose lease ran out; their request ids."""
        now = self.clock.now()
        gone = [rid for rid, e in self.exports.items() if e.deadline <= now]
        for rid in gone:
            del self.exports[rid]
        self.counts["expired"] += len(gone)
        return gone

    def held(self) -> dict:
        """Exports still pinned (request id -> bytes) and the counters, for tests and views (and
        how this host's pushes went, once it has made any)."""
        out = {"exports": {rid: e.nbytes for rid, e in self.exports.items()}, **self.counts}
        if self._sender is not None and any(self._sender.counts.values()):
            out["pushed via"] = dict(self._sender.counts)
        return out

    async def watch(self) -> None:
        """Never returns: the driver awaits it to learn at once when this process dies."""
        await asyncio.Event().wait()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.wire is not None:
            self.wire.close()
            self._sender.close()
            self.steps.close()
        self._shared.close()
        self.exports.clear()
        await self.device.close()

    # ---- the lease sweeper ----------------------------------------------------------------------
    def _sweep_soon(self) -> None:
        """Start the sweeper on the actor's own loop (there is none yet in ``__init__``)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.lease_s / 4, SWEEP_MAX_S))
            self.expire()


def _ray_put(value: Any) -> Any:
    import ray

    return ray.put(value)


async def _await(ref: Any) -> Any:
    return await ref


def _confirm(sender, request_id: str) -> None:
    """Tell the exporter its blocks landed: a Ray actor handle gets a call it need not answer."""
    if isinstance(sender, DeviceHost):
        sender.release(request_id)
    else:
        sender.release.remote(request_id)


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (tests)
        return "local"


def _node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests): this host
        return "local"
