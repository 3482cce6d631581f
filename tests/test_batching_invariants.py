"""Coupled batching policies (sarathi, vllm, alise) under random load, vLLM-CPU-test style.

A fake model drives each scheduler: every request emits token 1 until it reaches its target
length. ``FakeKV`` plays the runner's KV pool: it applies swap-outs, then swap-ins, then writes
each scheduled token's (request, position, token) into its slot, and before writing checks that
every token the scheduler claims is cached is really there. A block given to two requests, a
lost swap or a wrong recompute shows up as a mismatch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from scheduling import registry
from scheduling.alise import AliseConfig, AliseScheduler
from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.coupled import BatchingConfig, StepRoom
from scheduling.request import LengthRange, Request, SamplingParams
from scheduling.step import StepOutput

BLOCK_SIZE = 4
MIXES = {  # (prompt tokens, output tokens) ranges
    "short": ((1, 12), (1, 10)),
    "long": ((20, 60), (20, 60)),
    "mixed": ((1, 60), (1, 60)),
}


@dataclass
class Workload:
    reqs: list[Request]
    targets: dict[str, int]  # output tokens each request generates before "stop"
    arrive: dict[str, int]  # step at which it is added
    aborts: dict[str, tuple[int, bool]] = field(default_factory=dict)  # step, mid-step?


def make_workload(seed: int, mix: str, n: int = 30, predict: bool = False, abort_p: float = 0.0,
                  spread: int = 40) -> Workload:
    """``n`` requests arriving over ``spread`` steps; predictions (when asked) are often wrong."""
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = MIXES[mix]
    reqs, targets, arrive, aborts = [], {}, {}, {}
    for i in range(n):
        rid, target = f"r{i}", rng.randint(o_lo, o_hi)
        prompt = [rng.randint(2, 999) for _ in range(rng.randint(p_lo, p_hi))]
        predicted = None
        if predict:  # under-predict a third of the time, so predictions get outgrown
            hi = max(2, int(target * rng.choice([0.3, 0.9, 1.5, 3.0])) + 1)
            predicted = LengthRange(max(0, hi - 8), hi)
        reqs.append(Request(rid, prompt, SamplingParams(max_tokens=target + rng.randint(0, 8)),
                            predicted=predicted))
        targets[rid], arrive[rid] = target, rng.randint(0, spread)
        if rng.random() < abort_p:
            aborts[rid] = (arrive[rid] + rng.randint(0, 25), rng.random() < 0.5)
    return Workload(reqs, targets, arrive, aborts)


class FakeKV:
    """The runner's pool as a dict: slot -> (owner, position, token id). The owner is the request,
    or its prefix group: siblings may read each other's prompt blocks (scheduling/prefix.py), but
    nobody may write into a block another request also holds."""

    def __init__(self, block_size: int):
        self.bs, self.device, self.host = block_size, {}, {}

    def _copy(self, src: dict, dst: dict, pairs) -> None:
        for a, b in pairs:
            for off in range(self.bs):
                dst[b * self.bs + off] = src.get(a * self.bs + off)

    def execute(self, out, requests: dict[str, Request], blocks=None) -> None:
        self._copy(self.device, self.host, out.swap_out)
        self._copy(self.host, self.device, out.swap_in)
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            for pos in range(req.num_computed_tokens + n):
                block = req.block_ids[pos // self.bs]
                slot = block * self.bs + pos % self.bs
                want = (req.prefix_group or rid, pos, req.token_id_at(pos))
                if pos < req.num_computed_tokens:
                    assert self.device.get(slot) == want, f"{rid}: cached token {pos} lost"
                else:
                    assert blocks is None or blocks.ref_count(block) == 1, f"{rid} writes into shared block {block}"
                    self.device[slot] = want


@dataclass
class Run:
    outputs: list = field(default_factory=list)
    waits: dict[str, float] = field(default_factory=dict)  # longest wait of each request
    max_in_system: int = 0
    steps: int = 0


def drive(sched, work: Workload, clock: FakeClock, dt: float = 0.04, check=None,
          max_steps: int = 20_000) -> Run:
    """Run the engine loop (schedule -> runner -> update -> stop checks -> finish) to the end.
    ``check(sched, out, before)`` sees each step; ``before`` is every live request's
    ``(in_prefill, status)`` just before ``schedule()``."""
    run, kv, step = Run(), FakeKV(sched.blocks.block_size), 0
    pending = sorted(work.reqs, key=lambda r: work.arrive[r.request_id])
    table = {r.request_id: r for r in work.reqs}
    waiting_since: dict[str, float] = {}
    while pending or sched.has_work():
        assert step < max_steps, "no progress"
        while pending and work.arrive[pending[0].request_id] <= step:
            req = pending.pop(0)
            sched.add_request(req)
            waiting_since[req.request_id] = clock.now()
        _abort(sched, work, step, mid=False)
        run.max_in_system = max(run.max_in_system, len(sched.requests))
        if sched.has_work():
            before = {rid: (r.in_prefill, r.status) for rid, r in sched.requests.items()}
            out = sched.schedule()
            _track_waits(sched, out, clock.now(), waiting_since, run.waits)
            if check:
                check(sched, out, before)
            kv.execute(out, table, sched.blocks)
            _abort(sched, work, step, mid=True)
            sampled = {rid: 1 for rid, n in out.num_scheduled_tokens.items()
                       if table[rid].num_computed_tokens + n == table[rid].num_tokens}
            got = sched.update(out, StepOutput(sampled)).tokens
            run.outputs.append(out)
            clock.advance(dt)
            for req in got:
                req.token_times.append(clock.now())
                assert req.num_output_tokens <= work.targets[req.request_id]
                if req.num_output_tokens == work.targets[req.request_id]:
                    sched.finish(req, "stop")
        else:
            clock.advance(dt)
        step += 1
    run.steps = step
    return run


def _abort(sched, work: Workload, step: int, mid: bool) -> None:
    for rid, (at, at_mid) in work.aborts.items():
        if at == step and at_mid == mid:
            sched.abort(rid)


def _track_waits(sched, out, now: float, waiting_since: dict, waits: dict) -> None:
    """A wait runs from arrival, or from the first step a request is left out, until the step
    that schedules it again."""
    for rid in sched.requests:
        if rid in out.num_scheduled_tokens:
            if rid in waiting_since:
                waits[rid] = max(waits.get(rid, 0.0), now - waiting_since.pop(rid))
        else:
            waiting_since.setdefault(rid, now)


def make_scheduler(policy: str, num_blocks: int = 48, budget: int = 32, max_seqs: int = 8,
                   clock: FakeClock | None = None, host_blocks: int = 32, **config):
    blocks, batching = BlockManager(num_blocks, BLOCK_SIZE), BatchingConfig(budget, max_seqs)
    if policy != "alise":
        return registry.get("batching", policy)(blocks, batching)
    return AliseScheduler(blocks, batching, clock, alise=AliseConfig(**config),
                          host_blocks=BlockManager(host_blocks, BLOCK_SIZE) if host_blocks else None)


def assert_all_done(sched, work: Workload) -> None:
    """Blocks back to baseline; each request either aborted or with exactly its target."""
    assert sched.blocks.num_free == sched.blocks.num_blocks
    host = getattr(sched, "host", None)
    assert host is None or host.num_free == host.num_blocks
    assert not sched.requests and not sched.running and not sched.waiting
    for req in work.reqs:
        assert req.finished
        if req.finish_reason != "abort":
            assert req.num_output_tokens == work.targets[req.request_id], req.request_id


# ---- sarathi ------------------------------------------------------------------------------
def check_stall_free(sched, out, before) -> None:
    """Within budget, and every request decoding before the step is in it or was preempted."""
    assert out.num_real_tokens <= sched.max_num_batched_tokens
    for rid, (in_prefill, status) in before.items():
        if status.name == "RUNNING" and not in_prefill:
            assert rid in out.num_scheduled_tokens or rid in out.preempted_ids, f"decode {rid} stalled"
    for req in sched.running:
        if req.num_uncomputed_tokens == 1:
            assert req.request_id in out.num_scheduled_tokens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_sarathi_budget_and_no_stalled_decode(seed, mix):
    sched, work = make_scheduler("sarathi"), make_workload(seed, mix, abort_p=0.15)
    drive(sched, work, FakeClock(), check=check_stall_free)
    assert_all_done(sched, work)


def test_sarathi_preempts_under_block_pressure():
    total = 0
    for seed in range(4):
        sched, work = make_scheduler("sarathi", num_blocks=40), make_workload(seed, "long")
        drive(sched, work, FakeClock(), check=check_stall_free)
        assert_all_done(sched, work)
        total += sched.num_preemptions
    assert total > 0, "the workload must exercise preemption"


# a step's seconds as a cost model prices it: a fixed time, a row's, a decode's context token's,
# a prompt's query-key pair's
def _toy_step_s(rows: int, start: int, decodes: int, context: int) -> float:
    return 0.01 + 1e-3 * (rows + decodes) + 1e-5 * context + 1e-6 * rows * (start + (rows + 1) / 2)


def test_step_room_is_the_most_rows_within_the_limit():
    room = StepRoom(0.3, _toy_step_s, tile=16)
    n = room.rows(10, 3000, 0, 10_000)
    assert n % 16 == 0 and _toy_step_s(n, 0, 10, 3000) <= 0.3 < _toy_step_s(n + 16, 0, 10, 3000)
    assert room.rows(10, 3000, 0, 100) == 100  # all it is asked for fits
    assert room.rows(10, 3000, 500, 10_000) < n  # later in a prompt, each row reads more keys
    assert room.rows(10, 40_000, 0, 10_000) == 0  # the decodes alone fill the limit
    with pytest.raises(ValueError, match="limit_s"):
        StepRoom(0.0, _toy_step_s)
    with pytest.raises(ValueError, match="alone_s"):
        StepRoom(0.3, _toy_step_s, alone_s=0.0)


def test_a_step_with_no_decodes_fills_its_own_limit():
    """``alone_s`` is the limit of a step with no decodes; a step with any decode keeps
    ``limit_s``; without ``alone_s`` every step keeps ``limit_s``."""
    room, one = StepRoom(0.05, _toy_step_s, alone_s=0.3), StepRoom(0.05, _toy_step_s)
    alone = room.rows(0, 0, 0, 10_000)
    assert _toy_step_s(alone, 0, 0, 0) <= 0.3 < _toy_step_s(alone + 32, 0, 0, 0)  # the most, to a tile's rounding
    assert one.rows(0, 0, 0, 10_000) < alone
    assert room.rows(1, 100, 0, 10_000) == one.rows(1, 100, 0, 10_000) < alone
    assert room.limit(0) == 0.3 and room.limit(1) == one.limit(0) == 0.05


def test_a_lone_prompt_runs_in_fewer_steps_than_one_beside_decodes():
    """Sized steps at a short limit with a longer one for steps with no decodes: a prompt alone
    runs in the steps the longer limit allows; the same prompt beside a decode is cut to the
    short limit's rows, the budget a floor."""
    def run(decoding: bool) -> list[int]:
        room = StepRoom(0.05, _toy_step_s, alone_s=0.3)
        sched = registry.get("batching", "sarathi")(BlockManager(2000, 16), BatchingConfig(32, 8, step_room=room))
        if decoding:
            sched.add_request(Request("d", [5] * 20, SamplingParams(max_tokens=500)))
            while not sched.requests["d"].output_token_ids:
                out = sched.schedule()
                sched.update(out, StepOutput(sampled={rid: 7 for rid in out.sampled_ids}))
        sched.add_request(Request("p", [9] * 400, SamplingParams(max_tokens=2)))
        chunks = []
        while not sched.requests["p"].output_token_ids:
            out = sched.schedule()
            chunks.append(out.num_scheduled_tokens["p"])
            sched.update(out, StepOutput(sampled={rid: 7 for rid in out.sampled_ids}))
        return chunks

    alone, beside = run(False), run(True)
    assert sum(alone) == sum(beside) == 400
    assert len(alone) < len(beside)
    assert max(beside) <= max(32 - 1, StepRoom(0.05, _toy_step_s).rows(1, 21, 0, 400))


def test_sized_steps_give_prompts_what_short_decodes_leave():
    """Beside 4 decodes at short contexts a 200-token prompt runs whole though the budget is 32;
    beside decodes whose contexts fill the limit it gets the budget's rows, as fixed steps give."""
    def scheduler():
        return registry.get("batching", "sarathi")(BlockManager(2000, 16),
                                                   BatchingConfig(32, 8, step_room=StepRoom(0.3, _toy_step_s)))

    def decoding(sched, prompt_len):
        for i in range(4):
            sched.add_request(Request(f"d{i}", [5] * prompt_len, SamplingParams(max_tokens=50)))
        while not all(sched.requests[f"d{i}"].output_token_ids for i in range(4)):  # their prompts
            out = sched.schedule()
            sched.update(out, StepOutput(sampled={rid: 7 for rid in out.sampled_ids}))
        sched.add_request(Request("p", [9] * 200, SamplingParams(max_tokens=5)))
        return sched.schedule().num_scheduled_tokens

    short = decoding(scheduler(), 20)
    assert short["p"] == 200 and all(short[f"d{i}"] == 1 for i in range(4))
    long = decoding(scheduler(), 7000)  # 4 x 7001 tokens of context: 0.28 s of a 0.3 s step
    assert long["p"] == 32 - 4  # the budget's rows: no room beyond them


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_sized_sarathi_steps_stay_within_the_room(seed, mix):
    """With a step room every step is within its limit (or within the budget, the floor), no
    decode stalls, and every request ends with its tokens and blocks back."""
    room = StepRoom(0.06, _toy_step_s, alone_s=0.09)
    sched = registry.get("batching", "sarathi")(BlockManager(48, BLOCK_SIZE), BatchingConfig(32, 8, step_room=room))
    floor = sched.max_num_batched_tokens

    def check(sched, out, before):
        decodes = [rid for rid, (in_prefill, _) in before.items()
                   if rid in out.num_scheduled_tokens and out.num_scheduled_tokens[rid] == 1 and not in_prefill]
        rows = out.num_real_tokens - len(decodes)
        context = sum(sched.requests[rid].num_tokens for rid in decodes if rid in sched.requests)
        limit = room.limit(len(decodes))
        assert out.num_real_tokens <= floor or _toy_step_s(rows, 0, len(decodes), context) <= limit + 1e-9
        for rid, (in_prefill, status) in before.items():
            if status.name == "RUNNING" and not in_prefill:
                assert rid in out.num_scheduled_tokens or rid in out.preempted_ids, f"decode {rid} stalled"

    drive(sched, make_workload(seed, mix, abort_p=0.15), FakeClock(), check=check)
    assert sched.blocks.num_free == sched.blocks.num_blocks


# ---- vllm ---------------------------------------------------------------------------------
def check_prefill_or_decode(sched, out, before) -> None:
    kinds = {before[rid][0] for rid in out.num_scheduled_tokens}
    assert len(kinds) <= 1, "vllm mixed prefill and decode in one iteration"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_vllm_never_mixes_prefill_and_decode(seed, mix):
    sched, work = make_scheduler("vllm"), make_workload(seed, mix, abort_p=0.15)
    run = drive(sched, work, FakeClock(), check=check_prefill_or_decode)
    assert_all_done(sched, work)
    assert any(len(o.num_scheduled_tokens) > 1 for o in run.outputs), "batches must form"


# ---- alise --------------------------------------------------------------------------------
def check_alise(sched, out, before) -> None:
    assert out.num_real_tokens <= sched.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    assert not set(out.preempted_ids) & out.num_scheduled_tokens.keys()
    for d in out.kv_decisions:  # the expected-wait rule (None: evicted for a better-ranked job)
        if d.action == "swap_out" and d.ewt_s is not None:
            assert d.ewt_s >= sched.alise.swap_after_s
        if d.action == "keep":  # kept though long: only when the host had no room (test_alise)
            assert d.ewt_s is not None
        if d.action == "swap_in" and d.request_id not in out.num_scheduled_tokens:
            assert d.ewt_s < sched.alise.swap_after_s / 2  # prefetch


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_alise_invariants_and_aging_bound(seed, mix):
    clock, cfg = FakeClock(), dict(aging_s=0.5, swap_after_s=0.5)
    sched = make_scheduler("alise", clock=clock, **cfg)
    work = make_workload(seed, mix, predict=True, abort_p=0.15)
    run = drive(sched, work, clock, dt=0.04, check=check_alise)
    assert_all_done(sched, work)
    bound = sched.alise.aging_bound_s(0.04, run.max_in_system)
    assert max(run.waits.values()) <= bound


def test_alise_exercises_every_kv_action():
    """Across a few pressured runs, jobs are kept, swapped out and in, and recomputed."""
    actions = set()
    for seed in range(4):
        clock = FakeClock()
        sched = make_scheduler("alise", num_blocks=40, host_blocks=12, clock=clock, swap_after_s=0.3)
        work = make_workload(seed, "mixed", predict=True)
        run = drive(sched, work, clock, check=check_alise)
        assert_all_done(sched, work)
        actions |= {d.action for o in run.outputs for d in o.kv_decisions}
    assert actions == {"keep", "swap_out", "swap_in", "recompute"}


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "alise"])
def test_abort_everything_mid_run_frees_all_blocks(policy):
    clock = FakeClock()
    sched, work = make_scheduler(policy, clock=clock), make_workload(7, "mixed", predict=True, spread=5)
    for req in work.reqs:
        sched.add_request(req)
    for _ in range(15):
        out = sched.schedule()
        sched.update(out, StepOutput({rid: 1 for rid, n in out.num_scheduled_tokens.items()
                                      if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens}))
        clock.advance(0.04)
    out = sched.schedule()  # a step in flight when everything is aborted
    for req in work.reqs:
        assert sched.abort(req.request_id)
    assert sched.update(out, StepOutput({rid: 1 for rid in out.num_scheduled_tokens})).tokens == ()
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert getattr(sched, "host", None) is None or sched.host.num_free == sched.host.num_blocks
    assert not sched.has_work()
