"""Adaptive mode's control (``--mode adaptive``): where each prompt goes, whether a prefill
instance keeps the request it prefilled, late binding of prompts no instance has started, and the
rebalance of running decodes by KV migration. The prices are ``scheduling.placement.Placement``'s
(the measured step costs); this module reads the cluster's instances and requests and moves work
between them, and ``Cluster`` calls it at the points of a request's life where adaptive decides.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from aserve.cluster.handoff import Handoff
from aserve.cluster.requests import RequestHandle
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.instance import Instance
from scheduling.block_manager import blocks_needed
from scheduling.clock import Clock
from scheduling.dispatch import expected_output, predicted_total_blocks
from scheduling.placement import EntryLoad, Placement, PlacementConfig
from scheduling.prefix import cached_prefix_tokens
from scheduling.request import Request


# --kv-relief looks this many tokens ahead: a decode whose last block fills within them counts as
# needing a block. Tuned at paper scale on the synthetic workloads (docs/notes/slo-serving.md): one
# step ahead moved too late to spare a preemption in some cells, and counting one block for every
# decode (a block's worth of steps ahead) moved decodes that would not have been preempted, each
# paying a token gap (LPLD tight-tpot 6.61 -> 5.56, HPLD tight-tpot 0.536 -> 0.471 req/s a device).
RELIEF_HORIZON_STEPS = 4
# the running mean of an instance's prompt tokens a step weighs its newest step this much: about the
# last ten steps, the first tokens of a decode that the keep decision prices
RECENT_WEIGHT = 0.1


class AdaptivePlacer:
    """The adaptive decisions over ``instances`` and ``requests`` (the cluster's own tables)."""

    def __init__(self, engine: EngineConfig, cfg: ClusterConfig, clock: Clock, instances: dict[str, Instance],
                 requests: dict[str, RequestHandle], handoff: Handoff):
        self.clock, self.instances, self.requests, self.handoff = clock, instances, requests, handoff
        self.rebalance_quiet_s = cfg.rebalance_quiet_s
        self.kv_relief = cfg.kv_relief  # None: no moves against KV pressure (relieve)
        self.prefix_aware = cfg.prefix_aware_placement  # cached prefixes enter the prices
        self.placement = Placement(PlacementConfig(
            engine.max_num_batched_tokens, cfg.placement_step_s, cfg.placement_prefill_token_s,
            cfg.placement_decode_row_s, cfg.interference, keep_margin=cfg.keep_margin,
            prefill_token_budget=cfg.prefill_token_budget, ttft_slo=cfg.ttft_slo,
            slo_placement=cfg.slo_placement, slack=cfg.placement_slack, tpot_slo=cfg.tpot_slo))
        # where prompts went (and decodes a rebalance moved)
        self.placements = {"prefill": 0, "decode": 0, "kept": 0, "taken": 0, "moved": 0, "relieved": 0}
        self.moving: dict[str, tuple[str, int, str]] = {}  # request id -> (to, epoch, why: rebalance | relief)
        # each move that landed: when ("at", the cluster's clock), the request, from, to and why
        self.move_log: list[dict] = []
        self.migrating: set[str] = set()  # ... and those whose copy has begun, until it lands or fails
        self.last_arrival = float("-inf")  # when the last request arrived (the rebalance's quiet time)
        self.recent_prompt: dict[str, tuple[int, float]] = {}  # instance id -> (its prompt tokens so far, recent mean a step)

    def entry_loads(self, req: Optional[Request] = None, rooms: bool = False) -> list[EntryLoad]:
        """Adaptive: every active instance as the placement sees it (with ``req``: and how much of
        its prompt each holds cached; ``rooms``: and its decodes' TPOT rooms, which only placing a
        prompt reads)."""
        return [self._entry_load(inst, req, rooms=rooms) for inst in self.instances.values()
                if inst.state == "active" and inst.adaptive is not None]

    def _entry_load(self, inst: Instance, req: Optional[Request] = None,
                    queued_tokens: Optional[int] = None, rooms: bool = False) -> EntryLoad:
        """One instance's ``EntryLoad`` (``queued_tokens``: instead of all it has queued). The TPOT
        rooms walk every running decode, so they are read only where asked (``rooms``: placing a
        prompt); rebalance, relief and the keep decision, which run each step or each prefill,
        leave them empty."""
        queued = inst.num_queued_tokens if queued_tokens is None else queued_tokens
        return EntryLoad(inst.id, inst.role, queued, inst.adaptive.num_decoding, inst.blocks.num_free,
                         inst.blocks.block_size, self._cached(inst, req), self._tpot_rooms(inst) if rooms else (),
                         self.recent_prompt[inst.id][1] if inst.id in self.recent_prompt else 0.0)

    def observe(self, inst: Instance) -> None:
        """After each of ``inst``'s steps: the running mean of the prompt tokens its steps carry
        (``EntryLoad.recent_prompt_tokens``), weight ``RECENT_WEIGHT`` on the newest step."""
        total, mean = self.recent_prompt.get(inst.id, (inst.num_prefill_tokens, 0.0))
        step = max(0, inst.num_prefill_tokens - total)  # an instance replaced under its id counts from 0
        self.recent_prompt[inst.id] = (inst.num_prefill_tokens, mean + RECENT_WEIGHT * (step - mean))

    def _tpot_rooms(self, inst: Instance) -> tuple:
        """With the TPOT SLO known: each of ``inst``'s running decodes still within its TPOT limit,
        as (seconds of extra step time it can take, tokens left). A decode with ``k`` tokens out, its
        first ``e`` seconds ago, expecting ``L`` (the served predictor's, ``expected_output``; more than
        ``k``) keeps ``limit x (L - 1)`` over its gaps; with the ``L - k`` steps left at the instance's
        decode step as it stands (no prompt), ``limit x (L - 1) - e - (L - k) x step`` remains."""
        limit = self.placement.tpot_limit_s()
        if limit is None:
            return ()
        c, now = self.placement.config, self.clock.now()
        step = c.step_s + inst.adaptive.num_decoding * c.decode_row_s
        rooms = []
        for r in inst.adaptive.running_decodes():
            first, k = r.times.get("first_token"), r.num_output_tokens
            if first is None:
                continue
            total = max(expected_output(r), k + 1)
            room = limit * (total - 1) - (now - first) - (total - k) * step
            if room >= 0:
                rooms.append((room, total - k))
        return tuple(rooms)

    def _cached(self, inst: Instance, req: Optional[Request]) -> int:
        """Tokens of ``req``'s prompt cached on ``inst`` (0 unless placement is prefix-aware)."""
        return cached_prefix_tokens(inst.blocks, req) if req is not None and self.prefix_aware else 0

    def place(self, handle: RequestHandle) -> bool:
        """Adaptive: the instance where the prompt (or a re-run's prompt + output) costs least, its
        cached prefix there counted (a prefix cache hit is work not done)."""
        req = handle.request
        limit = self.placement.ttft_limit_s(len(req.prompt_token_ids))
        if limit is not None and req.ttft_deadline is None:  # what --slo-order queues it by, where it lands
            req.ttft_deadline = req.arrival_time + limit
        chosen = self.placement.choose(self.entry_loads(req, rooms=True), req.num_tokens)
        if chosen is None:
            return False
        self.assign(handle, self.instances[chosen.instance_id])
        self.placements[chosen.role] += 1
        return True

    @staticmethod
    def assign(handle: RequestHandle, inst: Instance) -> None:
        handle.instance_id, handle.phase = inst.id, "prefill"
        if inst.role == "prefill":
            handle.prefill_instance, handle.decode_instance = inst.id, None
        else:
            handle.prefill_instance, handle.decode_instance = None, inst.id
        inst.submit(handle.request)

    def late_bind(self, taker: Instance) -> None:
        """Adaptive: a prompt is placed where it costs least when it arrives, but room and queues
        change after (a decode instance without the blocks for it then may have them now). The
        instance that just stepped takes the oldest prompts other instances have not started
        while each costs less here (``Placement.cost_s``, a step less) than where it waits."""
        if taker.state != "active" or taker.adaptive is None:
            return
        free = taker.blocks.num_free  # first the cheap test: room for some other queue's oldest prompt
        if not any(o.adaptive is not None and o is not taker and o.state == "active"
                   and _fits(next(o.adaptive.unstarted(), None), free, o.blocks.block_size)
                   for o in self.instances.values()):
            return
        mine = self._entry_load(taker, rooms=True)
        for other in self.instances.values():
            if other is taker or other.state != "active" or other.adaptive is None:
                continue
            there, moving = None, []
            for req in other.adaptive.unstarted():
                need, n = blocks_needed(req.num_tokens + 1, mine.block_size), req.num_tokens
                if mine.free_blocks < need:
                    break
                if there is None:  # its load, priced with only the work ahead of its unstarted prompts
                    there = self._entry_load(other, queued_tokens=other.adaptive.num_started_tokens,
                                             rooms=True)
                there_now = replace(there, cached_tokens=self._cached(other, req))
                here = replace(mine, cached_tokens=self._cached(taker, req))
                if not self.placement.takes(here, there_now, n):
                    break
                moving.append(req.request_id)
                mine = replace(mine, queued_tokens=mine.queued_tokens + n, free_blocks=mine.free_blocks - need)
            for req in other.take_unstarted(moving) if moving else ():
                handle = self.requests.get(req.request_id)
                if handle is not None:
                    self.assign(handle, taker)
                    self.placements["taken"] += 1

    def landed(self, request_id: str, src: str, dst: str, why: str) -> None:
        """A planned move's KV arrived on ``dst`` (``Cluster`` calls it): counted, and logged with
        its time for the replay's timeline."""
        self.placements["moved"] += 1
        self.move_log.append({"at": self.clock.now(), "request": request_id, "from": src, "to": dst, "why": why})

    def _prune_moving(self) -> None:
        """Forget planned moves of requests that ended or were re-run since."""
        self.moving = {rid: m for rid, m in self.moving.items()
                       if rid in self.requests and self.requests[rid].epoch == m[1]}

    @staticmethod
    def _by_rest(inst: Instance) -> list:
        """``inst``'s running decodes as (expected rest, request), the longest predicted rest first."""
        return sorted(((max(1.0, expected_output(r) - r.num_output_tokens), r)
                       for r in inst.adaptive.running_decodes()), key=lambda m: -m[0])

    def rebalance(self) -> None:
        """Adaptive: once the arrivals have stopped (none for ``rebalance_quiet_s``) and no prompt
        is queued anywhere, move running decodes from the instance with the most to the one with
        the fewest (either role: an idle prefill instance's core then serves the decode tail), as
        many as ``Placement.rebalance_count`` finds pay, the longest expected rest first. Each
        leaves its instance after its next token by KV migration (``Handoff.migrate``); one batch
        of moves at a time: the next is priced once every copy of the last has landed or failed
        (priced before, the loads miss the decodes in flight and a second batch follows the first
        to the same instance, then a third moves some back). While requests keep arriving the
        placement evens the load with each new prompt, and moves cost: decodes on a prefill
        instance ride beside the next prompts' chunks, and a batch split in two pays the step's
        fixed cost twice (at paper scale on Mixed, moves at any time: P99 token gap +26%, busy +3%;
        docs/notes/adaptive.md, "Shift trace")."""
        self._prune_moving()
        if self.moving or self.migrating or self.clock.now() - self.last_arrival < self.rebalance_quiet_s:
            return
        # the loads' queued tokens, asked first as "any queued?" (found at an instance's first
        # prompt): once arrivals stop this runs every step, and summing every queue each time was
        # a third of an overloaded run's wall time (issue 57)
        active = [i for i in self.instances.values() if i.state == "active" and i.adaptive is not None]
        if len(active) < 2 or self.handoff.num_waiting or any(i.adaptive.has_queued_tokens for i in active):
            return
        loads = self.entry_loads()
        if any(i.adaptive is not None and next(i.adaptive.unstarted(), None) is not None
               for i in self.instances.values()):
            return
        incoming = {ld.instance_id: self.handoff.receiving(ld.instance_id) for ld in loads}
        loads = [replace(ld, num_decodes=ld.num_decodes + incoming[ld.instance_id]) for ld in loads]
        src = max(loads, key=lambda ld: (ld.num_decodes, ld.instance_id))
        dst = min(loads, key=lambda ld: (ld.num_decodes, ld.instance_id))
        if src.num_decodes - dst.num_decodes < 2:
            return
        inst = self.instances[src.instance_id]
        rest = self._by_rest(inst)
        moves = [(left, blocks_needed(r.num_tokens + 1, dst.block_size)) for left, r in rest]
        n = self.placement.rebalance_count(src, dst, moves)
        for rid in inst.migrate_decodes({r.request_id for _, r in rest[:n]}):
            self.moving[rid] = (dst.instance_id, self.requests[rid].epoch, "rebalance")

    def relieve(self) -> None:
        """Adaptive ``--kv-relief`` (on by default): a move instead of a preemption. An instance whose
        free blocks, less the copies on their way in, no longer cover the blocks its running decodes
        start within the next ``RELIEF_HORIZON_STEPS`` tokens is about to preempt one; its decode
        with the longest predicted rest (the served predictor's, ``expected_output``) leaves after
        its next token by KV migration to the instance with the most spare blocks (free, less one
        for each of its decodes, each copy on its way in and its queued prompts' blocks), if that
        one keeps ``kv_relief`` spare beyond the decode's KV. One move at a time, as rebalance's
        (the loads are priced again once it has landed); arrivals do not hold it back, as they do
        rebalance. A move costs its decode a token gap (the copy and the receiver's next step), so
        it is made only where a block is short within a few steps, not wherever the pool is
        merely full (docs/notes/slo-serving.md, "A move instead of a preemption")."""
        self._prune_moving()
        if self.moving or self.migrating:
            return
        # it runs after every step, so the instances short of blocks are found before the loads
        # (which sum every queue: a fifth of an overloaded sim replay's wall time when asked each
        # step), and by the counts no queue is walked for first: a decode needs at most one block
        # within the horizon, and the running decodes are at most the running requests
        short_ids = {i.id for i in self.instances.values()
                     if i.state == "active" and i.adaptive is not None
                     and i.blocks.num_free - self.handoff.receiving(i.id) < i.num_running
                     and self._free_after_horizon(i) < 0}
        if not short_ids:
            return
        loads = self.entry_loads()
        if len(loads) < 2:
            return
        receiving = {ld.instance_id: self.handoff.receiving(ld.instance_id) for ld in loads}
        short = [ld for ld in loads if ld.instance_id in short_ids and ld.num_decodes > 0
                 and ld.free_blocks - receiving[ld.instance_id] < ld.num_decodes]
        if not short:
            return
        spare = {ld.instance_id: ld.free_blocks - ld.num_decodes - receiving[ld.instance_id]
                 - -(-ld.queued_tokens // ld.block_size) for ld in loads}
        src = min(short, key=lambda ld: (spare[ld.instance_id], ld.instance_id))
        dst = max(loads, key=lambda ld: (spare[ld.instance_id], ld.instance_id))
        inst = self.instances[src.instance_id]
        rest = self._by_rest(inst)
        if not rest:
            return
        r = rest[0][1]
        if spare[dst.instance_id] < blocks_needed(r.num_tokens + 1, dst.block_size) + self.kv_relief:
            return
        for rid in inst.migrate_decodes({r.request_id}):
            self.moving[rid] = (dst.instance_id, self.requests[rid].epoch, "relief")
            self.placements["relieved"] += 1

    def _free_after_horizon(self, inst: Instance) -> int:
        """The instance's free blocks less the copies on their way in and one for each running
        decode whose last block fills within ``RELIEF_HORIZON_STEPS`` tokens."""
        bs = inst.blocks.block_size
        need = sum((-r.num_tokens) % bs < RELIEF_HORIZON_STEPS for r in inst.adaptive.running_decodes())
        return inst.blocks.num_free - self.handoff.receiving(inst.id) - need

    def keeps(self, instance: Instance, req: Request) -> bool:
        """Adaptive: whether a prefill instance keeps a prompt it just prefilled and decodes it
        (``Placement.keep_local``); a draining instance keeps nothing."""
        if instance.adaptive is None or req.num_output_tokens != 1:
            return False  # a migrating decode (more tokens) must leave
        loads = {ld.instance_id: ld for ld in self.entry_loads()}
        src = loads.get(instance.id)
        if src is None:
            return False
        need = predicted_total_blocks(req, src.block_size)
        return self.placement.keep_local(src, [ld for ld in loads.values() if ld.role == "decode"], need,
                                         expected_output(req))


def _fits(request: Optional[Request], free_blocks: int, block_size: int) -> bool:
    return request is not None and blocks_needed(request.num_tokens + 1, block_size) <= free_blocks
