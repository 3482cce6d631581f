"""Cores that follow the load: the in-process CPU instances lend an idle instance's cores to a
busy one's step (``ClusterConfig.device_share = "lend"``, issue 60).

Each instance owns ``cores / instances`` torch threads. A step asks the lender for threads:
- its own share always, once no other step holds it (a borrower gives the cores back at the
  end of its step, which the owner waits for: one chunk, never a whole request);
- plus the shares of the instances whose step loops wait for work, when the step has at least
  ``min_rows`` rows: on this 2-core machine two threads made a batch-1 decode step slower
  (23 against 20 ms) and a 256-token prompt chunk 1.8x faster (375 against 675 ms), a batch-16
  decode 1.36x.

So a lone prompt prefills on every core, as in one engine over the whole CPU, and two busy
instances keep one share each, as before. Where a lone decode row is faster on every core too
(an fp32 model on a Zen 3, whose one-row step reads 540 MB of weights, bound by one core's
memory stream), the first device's warm-up measures it and ``min_rows`` drops to 1
(``TorchDevice.warm_up``, ``learn``). The lender knows which instances wait for work from
their step loops (``Device.set_idle``); a share is never lent while its owner has a step to run.
"""
from __future__ import annotations

import asyncio
from typing import Optional


class CoreLender:
    """The cores of one process's CPU devices and who holds them (on the event loop's thread)."""

    def __init__(self, cores: int, min_rows: int = 8):
        self.cores, self.min_rows = max(1, cores), min_rows
        self.own: dict[str, int] = {}  # device -> its share of threads
        self.idle: set[str] = set()  # devices whose step loop waits for work
        self.held: dict[str, int] = {}  # device -> threads of its step running now
        self._waiters: list[asyncio.Future] = []
        self.counts = {"steps": 0, "lent_steps": 0, "waits": 0}
        self.measured: Optional[tuple[float, float]] = None  # a one-row step's seconds: own share, every core

    def learn(self, own_s: float, lent_s: float, gain: float = 1.1) -> None:
        """A one-row decode step took ``own_s`` at an instance's share and ``lent_s`` on every core:
        lend from one row where that is ``gain`` faster (measured once, by the first warm-up)."""
        self.measured = (own_s, lent_s)
        if own_s >= gain * lent_s:
            self.min_rows = 1

    def join(self, name: str, threads: int) -> None:
        self.own[name] = max(1, threads)

    def leave(self, name: str) -> None:
        self.own.pop(name, None)
        self.idle.discard(name)
        self.give(name)

    def set_idle(self, name: str, idle: bool) -> None:
        (self.idle.add if idle else self.idle.discard)(name)

    def _in_use(self) -> int:
        return sum(self.held.values())

    def _capacity(self) -> int:
        """The cores, or the shares' sum where instances outnumber them (threads time-slice as
        without a lender: nobody waits for a share it was given)."""
        return max(self.cores, sum(self.own.values()))

    async def take(self, name: str, rows: int) -> int:
        """Threads for ``name``'s next step of ``rows`` rows: its share, once free, and the
        shares no one needs now when the step is large enough to use them."""
        mine = self.own.get(name, 1)
        if self._in_use() + mine > self._capacity():
            self.counts["waits"] += 1
            await self._until(lambda: self._in_use() + mine <= self._capacity())
        threads = mine
        if rows >= self.min_rows:
            # the shares of devices with work that are between steps stay theirs
            kept = sum(n for d, n in self.own.items() if d != name and d not in self.idle and d not in self.held)
            threads = max(mine, self.cores - self._in_use() - kept)
        self.held[name] = threads
        self.counts["steps"] += 1
        self.counts["lent_steps"] += threads > mine
        return threads

    async def take_all(self, name: str) -> int:
        """Every core for ``name``'s next step, once no step holds any (a warm-up at the thread
        count lent steps run at: what a first lent step would set up, measured alone)."""
        await self._until(lambda: not self.held)
        self.held[name] = self.cores
        return self.cores

    async def _until(self, ready) -> None:
        """Wait until ``ready()``, checked again each time a step gives its threads back."""
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def give(self, name: str) -> None:
        """``name``'s step ended: its threads are free, and whoever waited for them goes on."""
        if self.held.pop(name, None) is None:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def describe(self) -> str:
        """The start-up line: from how many rows a step borrows an idle instance's cores, and the
        warm-up's measurement behind it when there is one."""
        text = f"an idle instance's cores go to another's steps of {self.min_rows}+ rows"
        if self.measured is not None:
            own, lent = self.measured
            text += (f" (a lone decode row: {own * 1e3:.1f} ms on its own share, {lent * 1e3:.1f} ms on all "
                     f"{self.cores} cores)")
        return text

    def snapshot(self) -> dict:
        return {"cores": self.cores, "held": dict(self.held), "idle": sorted(self.idle), "min_rows": self.min_rows,
                **self.counts}


def lender_for(share: str, device: str, cores: int) -> Optional[CoreLender]:
    """The lender of a cluster whose instances share ``device``'s cores by ``share``."""
    return CoreLender(cores) if share == "lend" and device == "cpu" else None
