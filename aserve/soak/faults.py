"""The server-side faults of a soak, on the cluster's own loop, at random and in combination:

    transfer_fail   the next 1-3 KV transfers fail mid-way (cluster.handoff.inject_faults)
    transfer_stall  the next 1-2 hang twice ``transfer_timeout_s`` after their copy (past the timeout)
    kill            an instance's loop dies now (cluster.lifecycle.kill), never the last active one of its
                    role; ``readd_after_s`` later the failed instance is removed (its pool freed) and a
                    new one of its role added
    flip            an instance is drained and switched to the other role (refusals are counted, not errors)

Every event is logged with its time (the plot marks them); a kill keeps the requests it hit, so
its recovery time (until each of them streamed its next token or ended) is known at the end.
"""
from __future__ import annotations

import asyncio
import collections
import random
import weakref
from dataclasses import dataclass, field
from typing import Optional

from aserve.cluster.lifecycle import InstanceError
from aserve.soak.settings import SoakConfig


@dataclass
class Kill:
    """One kill: when, which instance, and the requests it held (handle, tokens streamed by then)."""

    instance: str
    role: str
    at: float  # on the cluster's clock
    hit: list = field(default_factory=list)  # (RequestHandle, len(token_times) at the kill)

    def recovery_s(self) -> Optional[float]:
        """Seconds until every request it hit had its next token or its end; None: one never did."""
        ends = []
        for handle, streamed in self.hit:
            if len(handle.token_times) > streamed:
                ends.append(handle.token_times[streamed])
            elif "finish" in handle.request.times:
                ends.append(handle.request.times["finish"])
            else:
                return None
        return max(ends, default=self.at) - self.at


class FaultInjector:
    """``run()`` until cancelled; ``events`` (time, kind, detail), ``counts`` per fault, ``kills``."""

    def __init__(self, cluster, cfg: SoakConfig, base: float):
        self.cluster, self.cfg, self.base = cluster, cfg, base
        self.kinds = cfg.faults_for(cluster.cfg.mode)
        self.rng = random.Random(cfg.seed + 1)
        self.events: list[tuple[float, str, str]] = []
        self.counts: collections.Counter = collections.Counter()
        self.kills: list[Kill] = []
        self._readds: set[asyncio.Task] = set()
        self.removed: list[weakref.ref] = []  # the devices of removed instances: none may outlive it
        self._now = asyncio.Event()  # set by settle(): re-adds still waiting happen at once

    def _note(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        self.events.append((self.cluster.clock.now() - self.base, kind, detail))

    async def run(self) -> None:
        if not self.kinds:
            return
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / self.cfg.fault_interval_s))
            together = 2 if len(self.kinds) > 1 and self.rng.random() < self.cfg.combine_p else 1
            if together == 2:
                self.counts["combined"] += 1
            for kind in self.rng.sample(self.kinds, together):
                self.inject(kind)

    def inject(self, kind: str) -> None:
        handoff, lifecycle = self.cluster.handoff, self.cluster.lifecycle
        if kind == "transfer_fail":
            n = self.rng.randint(1, 3)
            handoff.inject_faults(n)
            self._note(kind, f"the next {n} transfers fail")
        elif kind == "transfer_stall":
            n, stall = self.rng.randint(1, 2), 2 * self.cluster.cfg.transfer_timeout_s
            handoff.inject_faults(n, stall_s=stall)
            self._note(kind, f"the next {n} transfers hang {stall:g} s")
        elif kind == "kill":
            self._kill()
        elif kind == "flip":
            active = [i.id for i in self.cluster.instances.values() if i.state == "active"]
            if active:
                self.cluster.spawn(self._flip(self.rng.choice(sorted(active))))

    def _kill(self) -> None:
        active = [i for i in self.cluster.instances.values() if i.state == "active"]
        spare = [i for i in active if sum(j.role == i.role for j in active) > 1]
        if not spare:
            self._note("kill_skipped", "no instance whose role has another active one")
            return
        inst = self.rng.choice(sorted(spare, key=lambda i: i.id))
        hit = [(h, len(h.token_times)) for h in self.cluster.requests.values() if h.phase != "done" and (
            (h.instance_id == inst.id and h.phase in ("prefill", "decode"))
            or (h.phase == "transfer" and h.prefill_instance == inst.id))]
        self.kills.append(Kill(inst.id, inst.role, self.cluster.clock.now(), hit))
        self.cluster.lifecycle.kill(inst.id, "soak: killed")
        self._note("kill", f"{inst.id} ({inst.role}), {len(hit)} requests on it")
        task = asyncio.ensure_future(self._readd(inst.id, inst.role, self.rng.uniform(*self.cfg.readd_after_s)))
        self._readds.add(task)
        task.add_done_callback(self._readds.discard)

    async def _readd(self, iid: str, role: str, after_s: float) -> None:
        try:
            await asyncio.wait_for(self._now.wait(), after_s)
        except asyncio.TimeoutError:
            pass
        await self._replace(iid, role)

    async def _replace(self, iid: str, role: str) -> None:
        """A failed instance removed (no drain: its device and pool are freed) and a new one of its
        role added."""
        self.removed.append(weakref.ref(self.cluster.instances[iid].device))
        await self.cluster.lifecycle.remove(iid)
        new = await self.cluster.lifecycle.add(role)
        self._note("readd", f"{iid} removed, {new.id} ({role}) added")

    async def _flip(self, iid: str) -> None:
        try:
            record = await self.cluster.lifecycle.flip(iid, reason="soak")
        except InstanceError as e:
            self._note("flip_refused", str(e))
            return
        self._note("flip", f"{iid} {record['from']} -> {record['to']} (drain {record['drain_s']:.2f} s)")

    async def settle(self) -> None:
        """The re-adds still due: done now, so the cluster ends at its full size."""
        self._now.set()
        await asyncio.gather(*self._readds, return_exceptions=True)
        for inst in [i for i in self.cluster.instances.values() if i.state == "failed"]:
            await self._replace(inst.id, inst.role)

    def removed_alive(self) -> int:
        """Removed instances whose device (and with it the KV pool) something still holds: 0
        unless a reference or a cycle keeps a pool past its instance (no collection is forced)."""
        return sum(ref() is not None for ref in self.removed)

    def kill_report(self) -> list[dict]:
        return [{"instance": k.instance, "role": k.role, "at_s": k.at - self.base, "requests_hit": len(k.hit),
                 "recovery_s": k.recovery_s()} for k in self.kills]
