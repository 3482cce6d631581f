"""``aserve profile token-budget``: the largest Sarathi token budget that meets a TBT SLO.

Sarathi-Serve (§4.3) sizes its token budget by profiling: every iteration carries the running
decodes plus a prefill chunk that fills the rest of the budget, so the budget bounds the
iteration time, and the iteration time is what every running request waits between two tokens
(TBT). Here each candidate budget B is timed as such a hybrid iteration::

    decode batch: N sequences, one token each, `context` tokens of KV each
    prefill chunk: B - N tokens continuing a prompt whose first `context` tokens are cached

Candidates are the tile times powers of two (64, 128, ... up to ``max_budget``), at least the
decode batch (a smaller budget cannot hold the decodes: Sarathi would stall them); the sweep
stops at the first candidate over the SLO, then bisects over multiples of the tile between the
last one under it and that one. Each candidate: one warm-up, then ``repeats`` timed
iterations; the median decides, the p90 is reported.

The choice (``pick_budget``) is the largest measured budget such that it *and every smaller
measured budget* meet the SLO. The budget is a maximum: the scheduler builds iterations of
every size up to it, so a larger budget that measured under the SLO after a smaller one
missed it is noise or a kernel switch, not room to spare.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aserve.config import EngineConfig
from aserve.devices.runner import ModelRunner
from scheduling.step import GREEDY, SeqStep, StepPlan
from model.kv_cache import KVCache
from scheduling.block_manager import BlockManager, blocks_needed

Measure = Callable[[int], Sequence[float]]  # budget -> seconds of each timed iteration


@dataclass(frozen=True)
class BudgetProfile:
    """What to measure; field names follow the command's flags."""

    tbt_slo_s: float
    decode_batch: int = 32
    context: int = 512
    tile: int = 64
    max_budget: int = 4096
    repeats: int = 3

    def __post_init__(self):
        if not self.tbt_slo_s > 0:  # also refuses NaN
            raise ValueError(f"--tbt-slo must be > 0 seconds, got {self.tbt_slo_s}")
        for name, value in (("decode-batch", self.decode_batch), ("context", self.context), ("tile", self.tile),
                            ("repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if not self.candidates():
            raise ValueError(f"--max-budget {self.max_budget} leaves no candidate: budgets are multiples of "
                             f"--tile {self.tile} times a power of two, at least --decode-batch {self.decode_batch}")

    def candidates(self) -> list[int]:
        """tile · 2^k up to ``max_budget``, from the first that holds the decode batch."""
        out, b = [], self.tile
        while b <= self.max_budget:
            if b >= self.decode_batch:
                out.append(b)
            b *= 2
        return out


@dataclass(frozen=True)
class Timing:
    budget: int
    seconds: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p90_s(self) -> float:
        """Nearest-rank p90 (with 3 repeats: the slowest)."""
        ordered = sorted(self.seconds)
        return ordered[math.ceil(0.9 * len(ordered)) - 1]


class NoBudgetMeetsSLO(ValueError):
    """Even the smallest candidate's iteration is slower than the SLO."""


def _passing_prefix(medians: Mapping[int, float], slo_s: float) -> Optional[int]:
    """The largest budget that, with every smaller measured one, meets the SLO (module doc)."""
    best = None
    for budget in sorted(medians):
        if medians[budget] > slo_s:
            break
        best = budget
    return best


def pick_budget(medians: Mapping[int, float], slo_s: float, tile: int) -> int:
    """The chosen budget, rounded down to a multiple of ``tile``; ``NoBudgetMeetsSLO`` (a
    ValueError) when the smallest measured budget already misses the SLO."""
    if not medians:
        raise ValueError("no budget was measured")
    best = _passing_prefix(medians, slo_s)
    if best is None:
        smallest = min(medians)
        raise NoBudgetMeetsSLO(f"no budget meets the SLO of {slo_s * 1000:.1f} ms: the smallest, {smallest} tokens, "
                               f"takes {medians[smallest] * 1000:.1f} ms")
    if best < tile:
        raise NoBudgetMeetsSLO(f"the largest budget meeting the SLO, {best} tokens, is less than one --tile of {tile}")
    return best // tile * tile


def search(measure: Measure, prof: BudgetProfile) -> dict[int, Timing]:
    """Time the candidates (module doc: sweep, then bisection); every timing, by budget."""
    timings: dict[int, Timing] = {}

    def timed(budget: int) -> bool:
        timings[budget] = Timing(budget, tuple(measure(budget)))
        return timings[budget].median_s <= prof.tbt_slo_s

    for budget in prof.candidates():
        if not timed(budget):
            break
    lo = _passing_prefix({b: t.median_s for b, t in timings.items()}, prof.tbt_slo_s)
    failed = [b for b, t in timings.items() if t.median_s > prof.tbt_slo_s]
    hi = min(failed) if failed else None
    while lo is not None and hi is not None and hi - lo > prof.tile:
        mid = (lo + hi) // 2 // prof.tile * prof.tile
        if timed(mid):
            lo = mid
        else:
            hi = mid
    return dict(sorted(timings.items()))


# ---- measuring real iterations ------------------------------------------------------------------
def hybrid_step(budget: int, prof: BudgetProfile, blocks: BlockManager, vocab_size: int,
                generator: torch.Generator) -> tuple[StepPlan, list[list[int]]]:
    """One Sarathi iteration of ``budget`` tokens (module picture) and the blocks it holds."""

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab_size, (n,), generator=generator).tolist())

    held, seqs = [], []
    for i in range(prof.decode_batch):
        held.append(blocks.allocate(blocks_needed(prof.context + 1, blocks.block_size)))
        seqs.append(SeqStep(f"d{i}", ids(1), prof.context, tuple(held[-1]), GREEDY))
    chunk = budget - prof.decode_batch
    if chunk > 0:  # mid-prompt: no token sampled
        held.append(blocks.allocate(blocks_needed(prof.context + chunk, blocks.block_size)))
        seqs.append(SeqStep("chunk", ids(chunk), prof.context, tuple(held[-1])))
    return StepPlan(tuple(seqs)), held


def runner_for(model: torch.nn.Module, dtype: torch.dtype, device: str, prof: BudgetProfile,
               block_size: int) -> tuple[ModelRunner, BlockManager]:
    """A runner whose pool holds exactly the largest iteration (the user's ``--kv-cache-gb``
    sizes a serving pool, not this measurement)."""
    num_blocks = (prof.decode_batch * blocks_needed(prof.context + 1, block_size)
                  + blocks_needed(prof.context + max(prof.candidates()), block_size))
    kv = KVCache(model.args, num_blocks, block_size, dtype, device)
    return ModelRunner(model, kv, device), BlockManager(num_blocks, block_size)


def engine_measure(runner: ModelRunner, blocks: BlockManager, prof: BudgetProfile,
                   progress: Optional[Progress] = None) -> Measure:
    """A ``Measure`` running real hybrid iterations on ``runner``: one warm-up, then
    ``prof.repeats`` timed ones (the runner's own forward time, device synchronised)."""
    generator = torch.Generator().manual_seed(0)

    def measure(budget: int) -> list[float]:
        step, held = hybrid_step(budget, prof, blocks, runner.model.args.vocab_size, generator)
        task = progress.add_task(f"budget {budget}", total=prof.repeats + 1) if progress else None
        times = []
        try:
            for i in range(prof.repeats + 1):
                out = runner.execute(step)
                if i:
                    times.append(out.forward_s)
                if progress:
                    progress.advance(task)
        finally:
            for ids in held:
                blocks.free(ids)
        return times

    return measure


def profile_token_budget(model: torch.nn.Module, dtype: torch.dtype, device: str, prof: BudgetProfile,
                         block_size: int = 16, progress: Optional[Progress] = None) -> dict[int, Timing]:
    """Every timing of the search on ``model`` (``pick_budget`` chooses from them)."""
    runner, blocks = runner_for(model, dtype, device, prof, block_size)
    return search(engine_measure(runner, blocks, prof, progress), prof)


def run_budget_profile(cfg: EngineConfig, prof: BudgetProfile, save: bool = True) -> int:
    """``aserve profile token-budget``: measure, print the table, choose, save; the chosen budget."""
    from aserve.engine.bundle import ModelBundle

    console = Console()
    if cfg.device == "cpu" and cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    bundle = ModelBundle.load(cfg)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        timings = profile_token_budget(bundle.model, bundle.dtype, cfg.device, prof, cfg.block_size, progress)
    _print(console, timings, prof, f"{bundle.path.name}, {str(bundle.dtype).removeprefix('torch.')}, {cfg.device}, "
                                    f"{torch.get_num_threads()} threads")
    budget = pick_budget({b: t.median_s for b, t in timings.items()}, prof.tbt_slo_s, prof.tile)
    console.print(f"token budget = {budget} (TBT SLO {prof.tbt_slo_s * 1000:g} ms, {prof.decode_batch} decodes "
                  f"of {prof.context} tokens of context)")
    if save:
        from aserve.profiles.profile_store import save_token_budget

        save_token_budget(cfg.cache_dir, cfg.model, cfg.device, cfg.dtype, cfg.num_threads, budget)
        console.print("saved: --batching sarathi now defaults --max-num-batched-tokens to it for this model, "
                      "device, dtype and --threads")
    else:
        console.print(f"use it with: --batching sarathi --max-num-batched-tokens {budget}")
    return budget


def _print(console: Console, timings: Mapping[int, Timing], prof: BudgetProfile, title: str) -> None:
    t = Table(title=f"hybrid iterations ({title})")
    for name in ("budget", "prefill chunk", "median ms", "p90 ms", "meets SLO"):
        t.add_column(name, justify="right")
    for b, tm in timings.items():
        t.add_row(str(b), str(max(0, b - prof.decode_batch)), f"{tm.median_s * 1000:.1f}", f"{tm.p90_s * 1000:.1f}",
                  "yes" if tm.median_s <= prof.tbt_slo_s else "no")
    console.print(t)
