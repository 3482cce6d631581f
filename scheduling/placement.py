"""The adaptive mode's global dispatch: where a new prompt is prefilled, and whether a prefilled
request stays where it was prefilled (issue 24: conditional disaggregation).

Every instance of ``--mode adaptive`` can prefill in chunks (scheduling/hybrid.py), so a prompt
may go to a prefill instance (its KV then moves to a decode instance) or straight to a decode
instance (its KV never moves). The choice is made from estimates, not from a prompt length:

    steps(i)   = (queued_i + P) / share_i           share_i = max(min_chunk, budget - decodes_i)
    step_s(i)  = step_s + decodes_i · decode_row_s + share_i · prefill_token_s
    ttft(i)    = steps(i) · step_s(i)               (the prompt's wait and its own chunks)
    harm(i)    = decodes_i · P · prefill_token_s    (what its chunks add to the running decodes)
    cost(i)    = ttft(i) + interference · harm(i)

and the prompt goes to the cheapest instance (ties: prefill instances first, then by id). With
prefix caching, P is the prompt's part not cached there (``EntryLoad.cached_tokens``): an instance
that holds the conversation's earlier turns (a decode instance that served the last turn among
them) computes only the new tokens, and the cost says whether that beats a shorter queue. A light
prompt beside an idle prefill instance goes there (no decodes to slow); a heavy one goes to a
decode instance only when the prefill side's queue is long enough that waiting for it costs more
than the decodes' slowdown. ``step_s``, ``decode_row_s`` and ``prefill_token_s`` come from the
device's measured cost model (``aserve profile device``; a simulated device's profile). The
same cost decides, until a prompt starts, whether another instance takes it over (the cluster's
late binding: ``cost_s`` here, a step less, against ``cost_s`` with only the work ahead of it
where it waits).

``keep_local``: a prefill instance keeps the request it just prefilled and decodes it itself when
no decode instance has room for it (its KV would otherwise sit idle, waiting), or when a
hand-over would not pay. By default (``keep_margin`` None) that is priced with the same costs:

    work(i)    = min(queued_i, share_i) · prefill_token_s    (prompt seconds in each of its steps)
    gain(d)    = L · (2 · (decodes_p - decodes_d) · decode_row_s + work(p) - work(d))
    hand over to some d with room when gain(d) > step_s(d)   (the token gap a move costs)

where L is the request's expected output (its predicted bucket's middle, else ``max_tokens``):
each of its tokens comes a row and a prompt share sooner where it moves, and its neighbours
there pay the row it no longer adds here. Where a row costs little against a step (a V100) the
rule moves whatever evens out the batches or leaves a prefill instance's prompt chunks; where a
row costs (this CPU) it keeps unless the batches differ. An integer ``keep_margin`` (``--keep-
margin``) keeps instead while the instance runs fewer than that many decodes more than the least
busy decode instance: round 1's rule, kept for comparison.

With the TPOT SLO known, before all that: a decode kept at a prefill instance rides beside the
prompts it chunks, so it is handed over where its token there would pass the TPOT limit and some
decode instance with room decodes it within the limit:

    kept(i)    = step_s + (decodes_i + 1) · decode_row_s + min(recent_i, share_i) · prefill_token_s
    hand over when kept(p) > limit and kept(d) <= limit for every d with room, none with a prompt queued

where recent_i is the running mean of the prompt tokens i's steps carried (``EntryLoad.
recent_prompt_tokens``; the cluster weighs the newest step 0.1). The prompts an instance will
chunk next are not known when it decides; its recent steps are the estimate. A decode instance
with a prompt queued is no refuge: with no decode of its own it runs a prompt whole, and a decode
that lands meanwhile waits for that step (at paper scale, HPLD's 2,000-token prompts: first gaps of
0.26-0.69 s against a 0.2 s token-gap limit when that was left out). Every decode instance with
room must qualify, since the hand-over picks among them by its own rule. At the Azure
conversation trace's tight-TPOT corner on this CPU (limit 2 batch-1 steps, 17 ms; a step with a
prompt chunk 23 ms) the priced rule kept 70 of 95 prefills beside the chunks that followed, and
they were the requests that missed TPOT (docs/notes/goodput.md, "Kept beside chunks").

``rebalance_count``: once requests stop arriving and no prompt is queued anywhere, an instance's
running decodes may move to a less busy instance of either role (an idle prefill instance's core
would otherwise sit out the tail), by the same KV migration a flip uses (the cluster decides
when). Each move is priced with ``handover_gain_s`` (its expected remaining output for L), one at
a time, the two loads updated after each, so the batches even out and a move that saves less than
it costs is not made. A move to an idle
instance also wakes it: it runs L steps it would not have run, L · step_s of busy time (what
perf/$ counts), so that move must save more than that too: 2 · (decodes_src - 1) · decode_row_s
> step_s, roughly. On this CPU (a row ~0.3 of a step) three decodes are enough; on a V100 with
OPT-13B (a row ~3% of a step) it takes twenty.

SLO-driven placement (issue 55; ``slo_placement``, with the TTFT SLO in force as ``ttft_slo``):
a prompt's TTFT limit is a multiple of its unloaded prefill plus decode steps (the corner's rule,
aserve/replay/slo.py, on these costs); of the instances where its estimated ``ttft`` keeps
``slack`` of that limit, it goes to the one whose running decodes its chunks slow least
(``harm``), then to a prefill instance whose free blocks hold its queue and the prompt, then to
the sooner TTFT, so prompts stay on the prefill-heavy side while its queue allows and spill to the
decode-heavy instances only when waiting there would spend the prompt's slack (TaiChi's rule);
where none keeps the slack, the cheapest by ``cost`` as above. Late binding keeps the same rule. The prefill instance comes before the sooner
TTFT where both harm alike (typically: no decode on either yet): the decode instance is where the
prefill side's requests go next, and a prompt chunked there shares its steps with them. Not where
the prefill instance's pool cannot hold its queue: the queue then waits for blocks its kept decodes
hold, which ``ttft`` does not price (on V100s, Mixed at tight TPOT, estimates 3-7x short). On this
CPU, where a prompt token costs 8% of a step and a decode row 16%, it took Azure conversation at
the tight-TPOT corner from 0.71x the static split to 1.09x (docs/notes/goodput.md, "Role first"
and "The real CPU rows"); on a V100 (1% and 3%) the grid's cells moved a knee step either way.

With the TPOT SLO known as well (``tpot_slo``, on wherever the SLO in force has a TPOT limit),
all of that runs among the instances where the prompt's chunks push the fewest running decodes
past their TPOT limit (``tpot_misses``): each decode still within its limit has a room, the step
time it can take over its predicted rest before its mean token time passes the limit, which the
prompts queued there use first; a decode that will end within a few steps sees only those steps'
chunks. Late binding never takes a prompt where it would push more decodes past than where it waits.

The default ``interference`` 0.2 comes from real pairs against sarathi on all six workloads (the
five synthetic ones and the Azure conversation trace: the tuning set; the Azure code trace is
only reported on, docs/notes/goodput.md) and a sweep at sarathi's own minutes on ``sim:`` (docs/notes/adaptive.md, "The other four workloads at
``--interference 0.2``"): 0.3, the default before, missed sarathi's P99 token gap by 3-4% on three
workloads and its TTFT at Azure's knee; a weight of 1 kept heavy prompts off the decode instance
at the price of TTFT (HPLD 3.9 s against coupled 2.6 s), 0 cost JCT.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from scheduling.block_manager import blocks_needed


@dataclass(frozen=True)
class EntryLoad:
    """One instance, as the placement sees it."""

    instance_id: str
    role: str  # prefill | decode
    queued_tokens: int  # prompt tokens waiting or being chunked there
    num_decodes: int  # requests taking a decode row of its every step
    free_blocks: int
    block_size: int
    cached_tokens: int = 0  # of the prompt being placed: its prefix already cached there (scheduling/prefix.py)
    # with the TPOT SLO known (tpot_slo): each running decode there still within its TPOT limit, as
    # (seconds of extra step time it can take before its mean token time passes the limit, tokens left)
    tpot_rooms: tuple = ()
    # prompt tokens its recent steps carried, on average (the cluster's running mean): what a decode
    # kept there will ride beside, which ``keep_local`` prices against the TPOT SLO
    recent_prompt_tokens: float = 0.0

    def __post_init__(self):
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"placement ranks prefill and decode instances, not {self.role!r}")
        assert self.queued_tokens >= 0 and self.num_decodes >= 0 and self.free_blocks >= 0


@dataclass(frozen=True)
class PlacementConfig:
    token_budget: int = 512  # rows of one hybrid step (the Sarathi budget)
    step_s: float = 0.01  # fixed seconds of any step (reading the weights)
    prefill_token_s: float = 1e-3  # seconds a prompt token adds to a step
    decode_row_s: float = 1e-3  # seconds a decode row adds to a step
    interference: float = 0.2  # weight of the decodes' slowdown against the prompt's own wait
    min_chunk: int = 16  # prompt tokens a hybrid step carries at least
    keep_margin: Optional[int] = None  # None: priced (keep_local); N: keep unless it decodes N more
    prefill_token_budget: Optional[int] = None  # prefill-role instances' own budget (None: token_budget)
    # the TTFT SLO in force, (seconds, a, b): limit(P) = seconds + a x prefill(P) + b x step, with
    # prefill(P) = step_s + P x prefill_token_s (the unloaded prompt); None: none known
    ttft_slo: Optional[tuple] = None
    slo_placement: bool = False  # place by TTFT slack (choose, takes); False: by cost alone
    slack: float = 0.5  # share of a prompt's TTFT limit its estimated TTFT may use where it harms fewer decodes
    # the TPOT SLO in force, (seconds, c): limit = seconds + c x (step_s + decode_row_s), a batch-1 decode
    # step; placement then keeps prompts from where their chunks would push running decodes past it
    # (tpot_misses); None: prompts are placed without regard to the decodes' TPOT
    tpot_slo: Optional[tuple] = None

    def __post_init__(self):
        for name in ("step_s", "prefill_token_s", "decode_row_s", "interference"):
            if getattr(self, name) < 0:
                raise ValueError(f"placement {name} must be >= 0, got {getattr(self, name)}")
        if (self.token_budget < 1 or self.min_chunk < 1 or (self.keep_margin is not None and self.keep_margin < 0)
                or (self.prefill_token_budget is not None and self.prefill_token_budget < 1)):
            raise ValueError(f"placement token_budget and min_chunk must be >= 1, got {self}")
        if self.ttft_slo is not None and (len(self.ttft_slo) != 3 or min(self.ttft_slo) < 0 or not any(self.ttft_slo)):
            raise ValueError(f"placement ttft_slo is (seconds, a, b), each >= 0 and not all 0, got {self.ttft_slo}")
        if self.tpot_slo is not None and (len(self.tpot_slo) != 2 or min(self.tpot_slo) < 0 or not any(self.tpot_slo)):
            raise ValueError(f"placement tpot_slo is (seconds, c), each >= 0 and not both 0, got {self.tpot_slo}")
        if not 0 < self.slack <= 1:
            raise ValueError(f"placement slack must be in (0, 1], got {self.slack}")
        if self.slo_placement and self.ttft_slo is None:
            raise ValueError("placement slo_placement needs the TTFT SLO (ttft_slo)")


def _uncached(load: EntryLoad, num_prompt_tokens: int) -> int:
    """Prompt tokens the instance must compute: those past its cached prefix (at least the last)."""
    return max(1, num_prompt_tokens - load.cached_tokens)


def entry_work(queued_tokens: int, num_prompt_tokens: int, cached_tokens: int = 0) -> int:
    """Coupled and disagg entry: the prompt tokens an instance would have to compute with this
    prompt placed there, its queue's and the prompt's uncached rest (its cached prefix is free).
    The least-work instance takes the prompt: with nothing cached anywhere, the least-loaded one
    as before; a cached prefix wins where it saves more than the queue it waits behind."""
    return queued_tokens + max(1, num_prompt_tokens - cached_tokens)


def entry_key(queued_tokens: int, num_prompt_tokens: int, cached_tokens: int, kv_outlook_blocks: int,
              expected_output_tokens: int, block_size: int) -> tuple[int, int]:
    """Coupled and disagg entry's ranking: first the KV blocks the instance would lack for this
    prompt and ``expected_output_tokens`` out (0 where it does not decode) while its own requests
    decode (``kv_outlook_blocks``: ``Scheduler.kv_outlook``), then ``entry_work``. The whole
    prompt counts, cached prefix included: ``kv_outlook`` counts unheld cached blocks as free,
    and taking them takes them from there. Where the pool is the limit, a cached prefix saves
    compute but waits for blocks: on four V100s cut to 2,560 tokens of KV each (multi-turn chat,
    two or three requests a pool) placing by work alone sent turns to the instance holding their
    history beside two running requests (queue p90 3.3 s against 0.04 s least-loaded) and
    caching lost to no cache; ranked by room first, 0.035 s, and caching wins. The cluster passes
    an outlook floored at minus a whole pool (``kv_outlook(..., floor)``): past that, instances
    count as equally full and the least work decides."""
    need = blocks_needed(num_prompt_tokens + expected_output_tokens, block_size)  # cached blocks count as free
    return max(0, need - kv_outlook_blocks), entry_work(queued_tokens, num_prompt_tokens, cached_tokens)


class Placement:
    """Ranks instances for a prompt of ``num_prompt_tokens``; pure, so tests feed it loads."""

    def __init__(self, config: PlacementConfig = PlacementConfig()):
        self.config = config

    def share(self, load: EntryLoad) -> int:
        """Prompt tokens one of the instance's steps carries beside its decodes."""
        return max(self.config.min_chunk, self.budget(load.role) - load.num_decodes)

    def budget(self, role: str) -> int:
        """Rows of one step of a ``role`` instance."""
        c = self.config
        return c.prefill_token_budget or c.token_budget if role == "prefill" else c.token_budget

    def ttft_s(self, load: EntryLoad, num_prompt_tokens: int) -> float:
        """Seconds until the prompt's last chunk has run there."""
        c, share = self.config, self.share(load)
        steps = (load.queued_tokens + _uncached(load, num_prompt_tokens)) / share
        return steps * (c.step_s + load.num_decodes * c.decode_row_s + share * c.prefill_token_s)

    def harm_s(self, load: EntryLoad, num_prompt_tokens: int) -> float:
        """Seconds the prompt's chunks add to the running decodes there, summed over them."""
        return load.num_decodes * _uncached(load, num_prompt_tokens) * self.config.prefill_token_s

    def cost_s(self, load: EntryLoad, num_prompt_tokens: int) -> float:
        return self.ttft_s(load, num_prompt_tokens) + self.config.interference * self.harm_s(load, num_prompt_tokens)

    def ttft_limit_s(self, num_prompt_tokens: int) -> Optional[float]:
        """The prompt's TTFT limit under the SLO in force (None: none)."""
        if self.config.ttft_slo is None:
            return None
        c = self.config
        seconds, a, b = c.ttft_slo
        return seconds + a * (c.step_s + num_prompt_tokens * c.prefill_token_s) + b * c.step_s

    def tpot_limit_s(self) -> Optional[float]:
        """A decode's TPOT limit under the SLO in force, on these costs (None: none)."""
        if self.config.tpot_slo is None:
            return None
        c = self.config
        seconds, scale = c.tpot_slo
        return seconds + scale * (c.step_s + c.decode_row_s)

    def tpot_misses(self, load: EntryLoad, num_prompt_tokens: int) -> int:
        """Running decodes there that the prompt's chunks would push past their TPOT limit: those
        whose room (``EntryLoad.tpot_rooms``) the prompts queued there leave, and the prompt's own
        chunks then fill. A decode sees the queued chunks and the prompt's while it runs: all of
        them, or one share a step for the tokens it has left, whichever is less."""
        if not load.tpot_rooms:
            return 0
        c, share = self.config, self.share(load)
        before = load.queued_tokens * c.prefill_token_s
        after = before + _uncached(load, num_prompt_tokens) * c.prefill_token_s
        n = 0
        for room, left in load.tpot_rooms:
            cap = left * share * c.prefill_token_s
            n += min(before, cap) <= room < min(after, cap)
        return n

    def choose(self, loads: Sequence[EntryLoad], num_prompt_tokens: int) -> Optional[EntryLoad]:
        """The instance that can hold the prompt's KV now (a prefill instance queues it in any
        case) where it costs least; None if there is none. With ``slo_placement`` (the TTFT SLO known): of the
        instances where the estimated TTFT keeps ``slack`` of the limit, the one whose running
        decodes its chunks slow least (``harm_s``; then a prefill instance whose blocks hold its
        queue and the prompt, ``queue_fits``; then the sooner TTFT), so prompts stay off the
        decode-heavy instances while the prefill side's queue allows; where none keeps it, the
        cheapest (the prompt's own wait first). With the TPOT SLO known (``tpot_slo``), all that
        among the instances where its chunks push the fewest running decodes past their TPOT limit
        (``tpot_misses``)."""
        need = blocks_needed(num_prompt_tokens + 1, loads[0].block_size) if loads else 0
        fit = [ld for ld in loads if ld.role == "prefill" or ld.free_blocks >= need]
        if not fit:
            return None
        if self.config.tpot_slo is not None:  # first: where its chunks push the fewest decodes past TPOT
            misses = {ld.instance_id: self.tpot_misses(ld, num_prompt_tokens) for ld in fit}
            least = min(misses.values())
            fit = [ld for ld in fit if misses[ld.instance_id] == least]
        limit = self.ttft_limit_s(num_prompt_tokens) if self.config.slo_placement else None
        if limit is not None:
            ttft = {ld.instance_id: self.ttft_s(ld, num_prompt_tokens) for ld in fit}
            ok = [ld for ld in fit if ttft[ld.instance_id] <= self.config.slack * limit]
            if ok:
                return min(ok, key=lambda ld: (self.harm_s(ld, num_prompt_tokens),
                                               not (ld.role == "prefill" and self.queue_fits(ld, num_prompt_tokens)),
                                               ttft[ld.instance_id], ld.instance_id))
        return min(fit, key=lambda ld: (self.cost_s(ld, num_prompt_tokens), ld.role != "prefill", ld.instance_id))

    @staticmethod
    def queue_fits(load: EntryLoad, num_prompt_tokens: int) -> bool:
        """Whether the instance's free blocks hold its queued prompts and this one."""
        return load.free_blocks >= blocks_needed(load.queued_tokens + _uncached(load, num_prompt_tokens), load.block_size)

    def takes(self, taker: EntryLoad, there: EntryLoad, num_prompt_tokens: int) -> bool:
        """Late binding: whether ``taker`` takes over an unstarted prompt waiting at ``there``
        (``queued_tokens``: only the work ahead of it): where it costs a step less here. With
        ``slo_placement``, a prompt whose chunks would slow more decodes here moves only once its wait
        there no longer keeps ``slack`` of its limit (``choose``'s rule, kept after arrival). With
        ``tpot_slo``, never where its chunks push more decodes past TPOT than where it waits."""
        n = num_prompt_tokens
        if self.cost_s(taker, n) + self.config.step_s >= self.cost_s(there, n):
            return False
        if self.config.tpot_slo is not None and self.tpot_misses(taker, n) > self.tpot_misses(there, n):
            return False
        limit = self.ttft_limit_s(n) if self.config.slo_placement else None
        if limit is None or self.harm_s(taker, n) <= self.harm_s(there, n):
            return True
        return self.ttft_s(there, n) > self.config.slack * limit

    def prompt_work_s(self, load: EntryLoad) -> float:
        """Prompt seconds in each of the instance's coming steps (its queued chunks, within its share)."""
        return min(load.queued_tokens, self.share(load)) * self.config.prefill_token_s

    def step_time_s(self, load: EntryLoad) -> float:
        """Seconds of the instance's next step as it stands: fixed, a row a decode, its prompt share."""
        return self.config.step_s + load.num_decodes * self.config.decode_row_s + self.prompt_work_s(load)

    def handover_gain_s(self, src: EntryLoad, dst: EntryLoad, expected_tokens: float) -> float:
        """Seconds the request and its neighbours save over its decode if it moves from ``src``
        to ``dst``, less the token gap the move costs (one of ``dst``'s steps)."""
        c = self.config
        per_token = (2 * (src.num_decodes - dst.num_decodes) * c.decode_row_s
                     + self.prompt_work_s(src) - self.prompt_work_s(dst))
        return expected_tokens * per_token - self.step_time_s(dst)

    def kept_token_s(self, src: EntryLoad) -> float:
        """Seconds a token of a decode kept at ``src`` takes: a step with one decode more, beside
        the prompt tokens its recent steps carried (``recent_prompt_tokens``, within its share)."""
        c = self.config
        prompt = min(src.recent_prompt_tokens, self.share(replace(src, num_decodes=src.num_decodes + 1)))
        return self.decode_step_s(src) + prompt * c.prefill_token_s

    def decode_step_s(self, load: EntryLoad) -> float:
        """Seconds of the instance's decode-only step with one decode more."""
        return self.config.step_s + (load.num_decodes + 1) * self.config.decode_row_s

    def keep_local(self, src: EntryLoad, decode_loads: Sequence[EntryLoad], need_blocks: int,
                   expected_tokens: float = 1.0) -> bool:
        """Whether a prefill instance keeps a request it prefilled (``need_blocks``: its prompt
        plus predicted output; ``expected_tokens``: its expected output) and decodes it itself:
        when no decode instance has the room (its KV would sit idle here, waiting for some), or
        when no hand-over pays (module docstring). With an integer ``keep_margin``: unless it
        runs that many decodes more than the least busy decode instance. With the TPOT SLO known,
        first: hand over where a token here (``kept_token_s``) would pass its limit and every
        decode instance with room (the hand-over picks among them by its own rule) has no prompt
        queued and keeps a token within it."""
        room = [ld for ld in decode_loads if ld.free_blocks >= need_blocks]
        if not room:
            return True
        limit = self.tpot_limit_s()
        if (limit is not None and self.kept_token_s(src) > limit
                and all(ld.queued_tokens == 0 and self.kept_token_s(ld) <= limit for ld in room)):
            return False  # beside its recent prompts it would miss TPOT; a decode instance's steps keep it
        if self.config.keep_margin is not None:
            return all(src.num_decodes < ld.num_decodes + self.config.keep_margin for ld in decode_loads)
        return all(self.handover_gain_s(src, ld, expected_tokens) <= 0 for ld in room)

    def rebalance_count(self, src: EntryLoad, dst: EntryLoad, moves: Sequence[tuple[float, int]]) -> int:
        """How many of ``moves`` (each: a running decode's expected remaining output and the
        blocks its KV needs, best first) go from ``src`` (whose ``num_decodes`` counts them) to
        ``dst``: while each one's hand-over gain, with the loads as the moves before it left them
        and its neighbours for ``src``, is positive (larger than the busy time it adds where
        ``dst`` is idle) and ``dst`` has the blocks. Only between instances with no prompt
        queued (``prompt_work_s`` is then 0)."""
        n = 0
        for expected, need in moves:
            others = replace(src, num_decodes=src.num_decodes - 1)  # its neighbours, without it
            # an idle receiver runs steps it would not have run: its fixed cost, every token
            woken = expected * self.config.step_s if dst.num_decodes == 0 and dst.queued_tokens == 0 else 0.0
            if need > dst.free_blocks or self.handover_gain_s(others, dst, expected) <= woken:
                break
            n += 1
            src = replace(src, num_decodes=src.num_decodes - 1, free_blocks=src.free_blocks + need)
            dst = replace(dst, num_decodes=dst.num_decodes + 1, free_blocks=dst.free_blocks - need)
        return n
