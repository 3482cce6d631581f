"""The device seam: the only thing an instance's step loop executes on.

    Instance ──StepPlan──► Device.execute ──StepOutput──► Instance
                            │
                            ├ TorchDevice (torch_device.py): the model over a paged KV pool, on
                            │   the device's own executor thread (CPU cores, or a CUDA device)
                            ├ a simulated device: advance a virtual clock by a cost model's step
                            │   time, no tensors; KV capacity from the profile's memory
                            └ RayDevice (ray_device.py): the same plan sent to a Ray actor that
                                owns the hardware and runs a TorchDevice, the output back once a step

A device knows its KV capacity (``num_blocks`` of ``block_size`` tokens, and host swap blocks
once asked for), runs one plan at a time, and moves KV blocks to another device of its kind
(``send_kv``: the link model charges the emulated time, the device does the real copy, off the
event-loop thread). Schedulers, dispatch, predictors, flips and the link model never learn which
device they drive.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from aserve.devices.cores import CoreLender
from scheduling.step import StepOutput, StepPlan


class DeviceFault(RuntimeError):
    """A step failed on the device (an injected fault, or a real device error)."""


@dataclass
class CoreShare:
    """How the instances of one process share a CPU's cores (``ClusterConfig.device_share``).

    ``dedicated`` emulates the paper's setting, where each instance owns its accelerator, on a CPU
    with fewer cores than instances: every live instance owns ``cores / live`` of a core, so a step
    that used ``c`` CPU seconds holds its device for ``c * live / cores`` seconds and an idle
    instance's share is lost instead of going to busy ones. CPU seconds, not wall seconds, so
    time-slicing with other instances is not charged twice. The control plane keeps ``live``
    (instances neither failed nor removed) up to date.
    """

    dedicated: bool = False
    cores: int = 1
    live: int = 1
    busy: set = field(default_factory=set)  # devices stepping right now (simulated ones read it: a shared bus)
    first_step_at: Optional[float] = None  # loop time of the first step any of them took (a speed trace's zero)
    lender: Optional[CoreLender] = None  # device_share "lend": idle instances' cores go to busy ones' steps

    def slowdown(self) -> float:
        """How much slower than one borrowed core each instance's emulated device is (>= 1)."""
        if not self.dedicated:
            return 1.0
        return max(1.0, self.live / self.cores)


class Device(ABC):
    """One instance's hardware: it executes plans and holds the KV pool."""

    name: str
    kind: str  # what it is, for views: "cpu", "cuda:0", "sim:<profile>", ...
    block_size: int
    num_blocks: int  # KV blocks on the device

    def __init__(self) -> None:
        self._fault: Optional[str] = None
        self.cpu_s = 0.0  # CPU seconds spent in steps (0 where the device is not this CPU)

    async def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step; ``StepOutput.busy_s`` is how long it held the device."""
        if self._fault:
            fault, self._fault = self._fault, None
            raise DeviceFault(fault)
        return await self._execute(plan)

    def fail_next_step(self, why: str = "injected fault") -> None:
        """Fault drill: the next ``execute`` raises, as a device error would."""
        self._fault = why

    @abstractmethod
    async def _execute(self, plan: StepPlan) -> StepOutput:
        ...

    async def warm_up(self, block_ids: Sequence[int]) -> None:
        """Run what a first step would pay for once, before serving (lazy set-up: a thread's
        OpenMP team, packed weights, the allocator's first pools), in ``block_ids`` (at least two,
        taken from the instance's block manager and given back after). Nothing by default."""

    def set_idle(self, idle: bool) -> None:
        """The instance's step loop waits for work (``idle``) or has some again: a device whose
        cores can be lent (``CoreShare.lender``) tells the lender. Nothing by default."""

    def describe(self) -> str:
        """One start-up line: where the device runs and what it holds."""
        return f"{self.name}: {self.kind}, {self.num_blocks} KV blocks of {self.block_size} tokens"

    async def ready(self) -> None:
        """Wait until the device can step. A local one can at once; a remote one once its
        process is up with the pool it promised (raises ``DeviceFault`` if it never is)."""

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """A device that can die on its own (a remote process) calls ``on_lost(why)`` on the
        event loop when it does, idle or not; a local one never does."""

    @abstractmethod
    def add_swap_space(self) -> int:
        """Host memory for swapped-out KV (made once); returns its number of blocks."""

    @abstractmethod
    async def send_kv(self, request_id: str, block_ids: Sequence[int], dst: "Device", dst_block_ids: Sequence[int],
                      link, num_tokens: int):
        """Copy blocks into ``dst``'s pool (already allocated there) over ``link``, which charges
        the emulated time; returns the link's ``TransferRecord``."""

    @abstractmethod
    async def close(self) -> None:
        """Release the device once the step running on it (if any) has ended."""
