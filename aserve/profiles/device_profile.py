"""``aserve profile device``: this machine's engine measured into a ``CostModel``.

What is timed (each point: one warm-up, then ``reps`` runs, the median), on one runner with the
instance's torch threads:

    linear(T)      T decode rows with one token of context each (attention negligible), T on a grid
    attn_decode    16 decode rows at 256 .. 2,048 tokens of context: time - linear(16), per token read
    attn_prefill   chunks of 128 and 512 tokens after 0 and 1,024 cached: time - linear(n) fitted
    logits_row     as -saving · n + per_pair · pairs (``fit_prefill``; a chunk mid-prompt samples
                   no row): a prompt row that samples nothing costs less than the decode row
                   ``linear`` timed (the LM head, its own attention call, its sampler: ``CostModel``
                   takes the saving back); the saving is at least the LM head's alone, timed on 1
                   and 64 rows (kept in meta)
    contention     a 16-row decode step alone, and while a second runner on another thread
                   prefills without pause, alternated three times, the median ratio (only when
                   the machine has the cores for both)

then the fit is checked against steps it was not fitted on (prompt chunks at other sizes, one
after cached tokens and one from position 0, decode batches of another size, a Sarathi hybrid
iteration) and their errors printed and kept in the profile's ``meta``.

A profile is taken at rest (aserve/profiles/rest.py): other processes' CPU use is read for a
second before and over the whole measurement, and the ``linear(16)`` point is timed again at
the end (the probe); ``meta["rest"]`` keeps what was seen. ``aserve profile device`` refuses to
save a profile measured on a busy machine unless ``--allow-busy`` (then every later use warns);
one measured on first need (``load_or_measure``) while busy is cached marked busy (every use warns)
and measured again by the first run that needs it on a machine at rest (a one-second look), so a
busy suite measures once, not at every start. Whoever uses a profile checks it against its instances (aserve/profiles/profile_check.py).
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from datetime import date
from typing import Callable, Optional

import torch

from aserve.profiles import profile_check, rest
from aserve.profiles.cost_model import CostModel, fit_attention, fit_prefill
from aserve.profiles.machine import cpu_flags, machine
from aserve.devices.runner import ModelRunner
from model.kv_cache import KVCache
from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.step import GREEDY, SeqStep, StepPlan

# linear(T) is concave between doublings here (the products' row blocks): on the doublings alone,
# decode steps of 8, 24, 96, 192, 384 and 768 rows were priced 3-8% long by interpolation; the
# midpoints are now timed, not interpolated
GRID = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
DECODE_BATCH = 16
PROBE_ROWS = 16  # the probe step (timed in the grid, and again at the end): 16 rows of one token of context
LOGITS_ROWS = (1, 64)
# what a measured profile holds; a cached one of an older version is measured again.
# 2 (2026-11-26): the LM head's cost a row (before: 0, and prefill attention fitted on that error)
# 3 (2026-11-30): a prompt row's saving fitted with the pairs' price (before: the LM head alone);
#   the grid's midpoints between doublings
PROFILE_VERSION = 3
DECODE_CONTEXTS = (256, 1024, 2048)
PREFILL_POINTS = ((128, 0), (128, 1024), (512, 0), (512, 1024))
CHECKS = (("prefill 256 after 512", lambda m: m.prefill_s(256, 512), "prefill", (256, 512)),
          ("prefill 384 from the start", lambda m: m.prefill_s(384, 0), "prefill", (384, 0)),
          ("decode 32 rows at 512", lambda m: m.decode_s(32, 512), "decode", (32, 512)),
          ("decode 4 rows at 1536", lambda m: m.decode_s(4, 1536), "decode", (4, 1536)),
          ("hybrid 256: 32 decodes + 224 at 512", lambda m: m.hybrid_s(256, 32, 512), "hybrid", (256, 32, 512)))
Tick = Callable[[str], None]


class _Steps:
    """Steps of given shapes over one runner's pool; blocks are taken and given back per step."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, reps: int):
        self.runner, self.blocks, self.reps = runner, blocks, reps
        self.vocab = runner.model.args.vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def _ids(self, n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, self.vocab, (n,), generator=self.gen).tolist())

    def plan(self, chunks=(), decodes=()) -> tuple[StepPlan, list[list[int]]]:
        """``chunks``: (tokens, start) mid-prompt; ``decodes``: contexts (their KV is whatever the
        pool holds: a step's cost does not depend on the values)."""
        bs, held, seqs = self.blocks.block_size, [], []
        for i, (n, start) in enumerate(chunks):
            held.append(self.blocks.allocate(blocks_needed(start + n, bs)))
            seqs.append(SeqStep(f"c{i}", self._ids(n), start, tuple(held[-1])))
        for i, ctx in enumerate(decodes):
            held.append(self.blocks.allocate(blocks_needed(ctx, bs)))
            seqs.append(SeqStep(f"d{i}", self._ids(1), ctx - 1, tuple(held[-1]), GREEDY))
        return StepPlan(tuple(seqs)), held

    def time(self, chunks=(), decodes=()) -> float:
        plan, held = self.plan(chunks, decodes)
        try:
            self.runner.execute(plan)
            times = []
            for _ in range(self.reps):
                times.append(self.runner.execute(plan).forward_s)
            return statistics.median(times)
        finally:
            for ids in held:
                self.blocks.free(ids)


def pool_for(model: torch.nn.Module, dtype: torch.dtype, device: str, num_blocks: Optional[int] = None,
             block_size: int = 16) -> tuple[ModelRunner, BlockManager]:
    """A runner whose pool holds the largest step measured: the grid's rows, or the decode
    batch at the longest context (or ``num_blocks``)."""
    num_blocks = num_blocks or max(GRID[-1], DECODE_BATCH * blocks_needed(max(DECODE_CONTEXTS), block_size),
                                   32 * blocks_needed(1536, block_size)) + 8
    kv = KVCache(model.args, num_blocks, block_size, dtype, device)
    return ModelRunner(model, kv, device), BlockManager(num_blocks, block_size)


def measure(model: torch.nn.Module, dtype: torch.dtype, device: str, threads: int, reps: int = 3,
            tick: Optional[Tick] = None, meta: Optional[dict] = None) -> CostModel:
    """Time the points (module doc) with ``threads`` torch threads; the fitted model, its checks
    and what was measured in ``meta``."""
    tick = tick or (lambda _label: None)
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    first = rest.sample()
    try:
        runner, blocks = pool_for(model, dtype, device)
        steps = _Steps(runner, blocks, reps)
        linear = []
        for n in GRID:
            tick(f"{n} rows")
            linear.append(steps.time(decodes=[1] * n))
        tick("logits")
        lm_head_row = _logits_row_s(runner, dtype, reps)
        partial = CostModel(GRID, tuple(linear), 0.0, 0.0)
        decode_points = []
        for ctx in DECODE_CONTEXTS:
            tick(f"{DECODE_BATCH} decodes at {ctx}")
            decode_points.append((DECODE_BATCH * (ctx - 1), steps.time(decodes=[ctx] * DECODE_BATCH)
                                  - partial.linear(DECODE_BATCH)))
        prefill_points = []
        for n, start in PREFILL_POINTS:
            tick(f"chunk {n} after {start}")
            prefill_points.append((n, CostModel.prefill_pairs(n, start),  # a chunk mid-prompt: no row samples
                                   steps.time(chunks=[(n, start)]) - partial.linear(n)))
        logits_row, attn_prefill = fit_prefill(prefill_points, floor=lm_head_row)
        fitted = CostModel(GRID, tuple(linear), attn_prefill, fit_attention(decode_points), logits_row_s=logits_row)
        tick("contention")
        measured_contention = _contention(model, dtype, device, threads, steps)
        contention, contention_pairs = measured_contention or (None, None)
        checks = _checks(fitted, steps, tick)
        tick("probe")  # the first probe was the grid's point at PROBE_ROWS, minutes ago
        probe_last = steps.time(decodes=[1] * PROBE_ROWS)
    finally:
        torch.set_num_threads(before)
    seen = {"others_cores_during": rest.others_cores(first, rest.sample()),
            "probe_first_s": linear[GRID.index(PROBE_ROWS)], "probe_last_s": probe_last}
    info = {**(meta or {}), "threads": threads, "cpu_flags": cpu_flags(),
            "date": date.today().isoformat(), "reps": reps, "checks": checks, "lm_head_row_s": lm_head_row,
            "contention_measured": contention is not None, "contention_pairs": contention_pairs,
            "rest": seen, **identity()}
    return CostModel(GRID, tuple(linear), fitted.attn_prefill_s, fitted.attn_decode_s, contention or 0.0, info,
                     logits_row_s=logits_row)


def identity() -> dict:
    """What a saved profile must match to be used on this machine as it is: the machine, the
    measurement's version, and our C++ kernels' sources (``model.native.kernels_build``: their
    version and a digest of their text; a step's cost changes with them: widened products made a
    16-row decode 1.2x faster)."""
    from model import native

    return {"machine": machine(), "version": PROFILE_VERSION, "kernels_build": native.kernels_build()}


def _logits_row_s(runner: ModelRunner, dtype: torch.dtype, reps: int) -> float:
    """One row's logits (the model's LM head, timed alone on ``LOGITS_ROWS`` rows): the slope."""
    model, device = runner.model, runner.device
    on_cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        for n in LOGITS_ROWS:
            hidden = torch.randn(n, model.args.hidden_size, generator=gen).to(device=device, dtype=dtype)
            runs = []
            for _ in range(reps + 1):  # the first is the warm-up
                if on_cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                model.logits(hidden)
                if on_cuda:
                    torch.cuda.synchronize(device)
                runs.append(time.perf_counter() - t0)
            times.append(statistics.median(runs[1:]))
    return max(0.0, (times[-1] - times[0]) / (LOGITS_ROWS[-1] - LOGITS_ROWS[0]))


CONTENTION_PAIRS = 3  # alone / beside pairs, alternated: one pair once read 0% on a VM whose runs showed +12-20%


def _contention(model, dtype, device: str, threads: int, steps: _Steps,
                pairs: int = CONTENTION_PAIRS) -> Optional[tuple[float, list]]:
    """How much slower a decode step runs while another runner prefills without pause, the median
    over ``pairs`` alternations of the step alone and beside it (each side its own median of
    ``reps``), and every pair's ratio; None where the machine lacks the cores to run both (or off
    the CPU). The neighbour is parked between its steps while the step is timed alone."""
    if device != "cpu" or (os.cpu_count() or 1) < 2 * threads:
        return None
    other, other_blocks = pool_for(model, dtype, device, num_blocks=blocks_needed(512, 16))
    neighbour = _Steps(other, other_blocks, 1)
    plan, held = neighbour.plan(chunks=[(512, 0)])
    stop, go, parked = threading.Event(), threading.Event(), threading.Event()

    def busy() -> None:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            while not stop.is_set():
                if not go.is_set():
                    parked.set()
                    go.wait(0.05)
                    continue
                parked.clear()
                other.execute(plan)
        parked.set()

    worker = threading.Thread(target=busy, name="profile-neighbour", daemon=True)
    worker.start()
    ratios = []
    try:
        for _ in range(pairs):
            go.clear()
            parked.wait()  # its step in flight has finished
            alone = steps.time(decodes=[1024] * DECODE_BATCH)
            go.set()
            time.sleep(0.3)  # the neighbour is mid-chunk before the first timed step
            ratios.append(steps.time(decodes=[1024] * DECODE_BATCH) / alone)
    finally:
        stop.set()
        go.set()
        worker.join()
    return max(0.0, statistics.median(ratios) - 1.0), [round(r - 1.0, 4) for r in ratios]


def _checks(model: CostModel, steps: _Steps, tick: Tick) -> list[dict]:
    """Steps the fit never saw, measured and predicted."""
    out = []
    for label, predict, kind, args in CHECKS:
        tick(label)
        if kind == "prefill":
            measured = steps.time(chunks=[args])
        elif kind == "decode":
            measured = steps.time(decodes=[args[1]] * args[0])
        else:
            budget, batch, ctx = args
            measured = steps.time(chunks=[(budget - batch, ctx)], decodes=[ctx] * batch)
        predicted = predict(model)
        out.append({"step": label, "measured_s": measured, "predicted_s": predicted,
                    "error": predicted / measured - 1.0})
    return out


def num_points() -> int:
    return len(GRID) + 1 + len(DECODE_CONTEXTS) + len(PREFILL_POINTS) + 1 + len(CHECKS) + 1


# saved profiles measured busy that this process looked at once and kept (the machine was busy then too)
_KEPT_BUSY: dict[tuple, CostModel] = {}


def load_or_measure(cfg, threads: int, quiet: bool = False) -> CostModel:
    """The saved profile of ``cfg``'s model, device and dtype at ``threads``, or measured now (with
    a progress line on stderr) and saved: the first run that needs it pays about half a minute.
    A saved one of other ISA flags, or measured with another attention backend or kernels than
    ``cfg``'s, is measured again (as one of another machine is). What the profile used does not
    record or was not sure of (busy, old) is said once on stderr."""
    from aserve.profiles.profile_store import cost_model

    key = (cfg.cache_dir, cfg.model, cfg.device, cfg.dtype, cfg.attention, cfg.kernels, threads)
    cost = _KEPT_BUSY.get(key) or cost_model(cfg.cache_dir, cfg.model, cfg.device, cfg.dtype, threads, machine(),
                                             PROFILE_VERSION)
    flags = cpu_flags()
    if cost is not None and (cost.meta.get("cpu_flags", flags) != flags or profile_check.mismatches(
            cost.meta, profile_check.instance_fields(cfg, threads, cost.meta, same_machine=True))):
        cost = None
    why = "once, for the chunk size and the token budget"
    if cost is not None and cost.meta.get("kernels_build") != identity()["kernels_build"]:
        cost, why = None, "again: aserve's kernels changed since the saved one was measured"
    if cost is not None and key not in _KEPT_BUSY and not cost.meta.get("rest", {}).get("at_rest", True):
        if rest.verdict(rest.look(), None)["at_rest"]:  # measured busy, and the machine is at rest now: again
            cost, why = None, "again: the saved one was measured while the machine was busy"
        else:
            _KEPT_BUSY[key] = cost
    if cost is None:
        cost = measure_and_save(cfg, threads, quiet=quiet, why=why, on_need=True)
    command = profile_check.measure_command(cfg, threads)
    for line in profile_check.load_warnings(f"this machine's profile at {threads} thread(s)", cost.meta, machine(),
                                            flags, command=command):
        profile_check.warn(line)
    return cost


def measure_and_save(cfg, threads: int, reps: int = 3, out: Optional[str] = None, quiet: bool = False,
                     why: str = "", allow_busy: bool = False, on_need: bool = False) -> CostModel:
    """Measure (progress on stderr), save in the cache (and to ``out``), print the fit and its
    checks. On a machine not at rest (aserve/profiles/rest.py): a ValueError before measuring
    (others busy in the first second) or after (nothing saved), unless ``allow_busy`` (saved, its
    meta says so) or ``on_need`` (a run that needs it now: saved marked busy, with a warning)."""
    import sys
    from dataclasses import replace

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from aserve.engine.bundle import ModelBundle
    from aserve.profiles.profile_store import save_cost_model
    from model.attention import pick_backend

    console = Console(stderr=True)
    if not quiet:
        console.print(f"aserve: profiling the engine at {threads} thread(s){' ' + why if why else ''} "
                      f"(aserve profile device)", highlight=False)
    before = rest.look()
    early = rest.verdict(before, None)
    if not (early["at_rest"] or allow_busy or on_need):
        raise ValueError(f"the machine is not at rest: {early['why'][0]}. {_BUSY_COST} Nothing measured. {_BUSY_WAYS}")
    bundle = ModelBundle.load(cfg)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    t0 = time.perf_counter()
    with Progress(*columns, console=console, transient=True, disable=quiet or not sys.stderr.isatty()) as bar:
        task = bar.add_task("profiling", total=num_points())

        def tick(label: str) -> None:
            bar.update(task, description=f"profiling: {label}", advance=1)

        attention = pick_backend(cfg.attention, cfg.device, bundle.kernels != "fallback", cfg.block_size, bundle.dtype)
        cost = measure(bundle.model, bundle.dtype, cfg.device, threads, reps, tick,
                       meta={"model": cfg.model, "device": cfg.device, "attention": attention,
                             "kernels": bundle.kernels, "dtype": str(bundle.dtype).removeprefix("torch.")})
    seen = cost.meta["rest"]
    verdict = rest.verdict(before, seen["others_cores_during"], seen["probe_first_s"], seen["probe_last_s"], allow_busy)
    cost = replace(cost, meta={**cost.meta, "rest": verdict})
    busy = "; ".join(verdict["why"])
    if busy and not (allow_busy or on_need):
        raise ValueError(f"the machine was not at rest while profiling: {busy}. {_BUSY_COST} Nothing saved. "
                         f"{_BUSY_WAYS}")
    if busy and allow_busy:
        profile_check.warn(f"the machine was not at rest while profiling ({busy}); kept anyway (--allow-busy): "
                           "every use of this profile will say so")
    path = save_cost_model(cfg.cache_dir, cfg.model, cfg.device, cfg.dtype, threads, cost)
    if out:
        cost.save(out)
    if not quiet:
        _print(console, cost, time.perf_counter() - t0, path, out)
    return cost


_BUSY_COST = ("A profile measured so times every step too slow, and so every SLO corner, token budget, chunk size "
              "and sim:local estimate read from it.")
_BUSY_WAYS = "Run it again once the other work is done, or pass --allow-busy to keep it anyway (every later use warns)."


def _print(console, cost: CostModel, seconds: float, path, out: Optional[str]) -> None:
    from rich.table import Table

    t = Table(title=f"step costs ({cost.meta.get('machine')}, {cost.meta.get('threads')} thread(s), "
                    f"{cost.meta.get('dtype')}, {cost.meta.get('attention')})")
    for col in ("rows", "linear ms", "rows/s"):
        t.add_column(col, justify="right")
    for n, sec in zip(cost.tokens, cost.linear_s):
        t.add_row(str(n), f"{sec * 1e3:.1f}", f"{n / sec:,.0f}")
    console.print(t)
    pairs = cost.meta.get("contention_pairs")
    spread = f" (median of {', '.join(f'{p:+.0%}' for p in pairs)})" if pairs else ""
    head = cost.meta.get("lm_head_row_s")
    lm_head = f" (the LM head alone {head * 1e3:.2f})" if head is not None else ""
    console.print(f"attention: {cost.attn_prefill_s * 1e9:.2f} ns per prompt query-key pair, "
                  f"{cost.attn_decode_s * 1e9:.1f} ns per decode context token; a prompt row "
                  f"{cost.logits_row_s * 1e3:.2f} ms less than a decode row{lm_head}; contention {cost.contention:+.0%}{spread} beside a busy "
                  "neighbour", highlight=False)
    checks = Table(title="the fit on steps it was not fitted on")
    for col in ("step", "measured ms", "predicted ms", "error"):
        checks.add_column(col, justify="right")
    for c in cost.meta["checks"]:
        checks.add_row(c["step"], f"{c['measured_s'] * 1e3:.1f}", f"{c['predicted_s'] * 1e3:.1f}", f"{c['error']:+.1%}")
    console.print(checks)
    seen = cost.meta["rest"]
    console.print(f"{'at rest' if seen['at_rest'] else 'NOT at rest'}: {rest.describe(seen)}", highlight=False)
    where = [str(p) for p in (path, out) if p]
    console.print(f"saturate chunk {cost.saturate_chunk()}; measured in {seconds:.0f} s; "
                  + (f"saved to {' and '.join(where)}" if where else "not saved"), highlight=False)
