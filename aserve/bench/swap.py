"""``aserve bench swap-int8``: what INT8 swap (ALISE §3, Eq. 8) costs in accuracy and saves in bytes.

Three figures, each side by side for ``swap_dtype`` same vs int8, on one model and dtype:

- **bytes per swapped block** and how many blocks ``--swap-gb`` holds in each format;
- **token agreement**: the same prompts, greedy, under ALISE with a KV pool so small that jobs
  are really swapped out and back, against a run whose pool never preempts. Per prompt, a token
  agrees when it and every token before it equal the reference (position by position up to the
  first divergence); every later token counts as disagreeing, since after a divergence the two
  runs continue different texts. Agreement = agreeing tokens / all tokens, over all prompts;
- **logit error** of one decode step computed with the prompt's KV as it was, and again after
  that KV made an INT8 round trip (swap-out, swap-in through the runner): max and mean absolute
  difference, the largest |logit| for scale, and whether the argmax (the greedy token) agrees.

The agreement depends on the schedule: the more often jobs go through the round trip, the
more near-tied greedy choices can flip (docs/notes/engine.md has runs with more and fewer swaps).
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Sequence

import torch
from rich.console import Console
from rich.table import Table

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.engine.offline import LLM
from aserve.devices.runner import ModelRunner
from scheduling.step import GREEDY, SeqStep, StepPlan
from model.kv_cache import KVCache, host_swap_space, kv_bytes_per_block, swap_bytes_per_block
from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import FakeClock
from scheduling.request import SamplingParams

PROMPT_LENGTHS = (32, 160)  # prompt token range, drawn per prompt (seeded)
# ALISE's clock per engine step: its aging (a level every 5 s) then promotes waiting jobs every
# few steps, so jobs preempt each other and go through swap often, as on this CPU under load
STEP_S = 1.0
TIGHT_POOL_JOBS = 4  # the swap runs' device pool holds this many of the largest request


def prefix_agreement(want: Sequence[int], got: Sequence[int]) -> int:
    """Tokens of ``got`` equal to ``want`` position by position before the first divergence."""
    n = 0
    for a, b in zip(want, got):
        if a != b:
            break
        n += 1
    return n


def token_agreement(want: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> float:
    """Share of tokens that agree under the first-divergence rule (module doc), over all prompts;
    a run that produced more or fewer tokens than the reference counts the difference as
    disagreeing."""
    if len(want) != len(got):
        raise ValueError(f"{len(want)} reference outputs against {len(got)} outputs")
    total = sum(max(len(w), len(g)) for w, g in zip(want, got))
    return sum(prefix_agreement(w, g) for w, g in zip(want, got)) / max(1, total)


def bench_prompts(bundle: ModelBundle, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` real prompts (the shared prompts file when present, else random ids) of
    seeded lengths in ``PROMPT_LENGTHS``."""
    from aserve.replay.trace_formats import TraceRequest
    from aserve.replay.workloads import PROMPTS_FILE, PromptBuilder

    rng = random.Random(seed)
    builder = PromptBuilder(bundle.tokenizer, PROMPTS_FILE if PROMPTS_FILE.is_file() else None, seed)
    return builder.build([TraceRequest(0.0, rng.randint(*PROMPT_LENGTHS), 1) for _ in range(num_prompts)])


def tight_swap_config(cfg: EngineConfig, bundle: ModelBundle, prompts: Sequence[Sequence[int]], max_tokens: int,
                      swap_dtype: str) -> EngineConfig:
    """ALISE with a device pool of ``TIGHT_POOL_JOBS`` times the largest request (ALISE needs
    each job to fit alone), so a few jobs run at once and the rest are preempted and swapped."""
    largest = blocks_needed(max(len(p) for p in prompts) + max_tokens, cfg.block_size)
    per_block = kv_bytes_per_block(bundle.args, cfg.block_size, bundle.dtype)
    kv_gb = (TIGHT_POOL_JOBS * largest + 0.5) * per_block / 2**30  # + half a block: never rounds a block away
    return replace(cfg, batching="alise", kv_cache_gb=kv_gb, swap_dtype=swap_dtype)


def reference_config(cfg: EngineConfig, bundle: ModelBundle, prompts: Sequence[Sequence[int]],
                     max_tokens: int) -> EngineConfig:
    """Sarathi with a pool that holds every request at once: it never preempts (ALISE would
    still swap out jobs left out of a step by the token budget when their wait looks long)."""
    blocks = sum(blocks_needed(len(p) + max_tokens, cfg.block_size) for p in prompts)
    per_block = kv_bytes_per_block(bundle.args, cfg.block_size, bundle.dtype)
    return replace(cfg, batching="sarathi", kv_cache_gb=(blocks + 0.5) * per_block / 2**30)


def run_greedy(bundle: ModelBundle, cfg: EngineConfig, prompts: Sequence[Sequence[int]],
               max_tokens: int, step_s: float = STEP_S) -> tuple[list[list[int]], int]:
    """Greedy outputs of ``prompts`` (exactly ``max_tokens`` each) and the blocks swapped out.
    ALISE's clock moves ``step_s`` per engine step: with the wall clock its aging would make
    the schedule, and so which blocks are swapped when, depend on the machine's speed and load;
    this way a run is repeatable."""
    clock = FakeClock()
    llm = LLM(cfg, bundle=bundle, clock=clock)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], sp, progress=lambda *_: clock.advance(step_s))
    assert llm.blocks.num_free == llm.blocks.num_blocks, "blocks leaked"
    return [o.token_ids for o in outs], llm.device.runner.num_swapped_out


def int8_logit_error(bundle: ModelBundle, prompts: Sequence[Sequence[int]], block_size: int = 16,
                     swap_dtype: str = "int8") -> dict:
    """One greedy decode step after each prompt, with its KV as computed and again after a
    swap-out and swap-in through ``swap_dtype`` host space (module doc)."""
    need = max(blocks_needed(len(p) + 1, block_size) for p in prompts)
    kv = KVCache(bundle.args, need, block_size, bundle.dtype, bundle.device)
    host = host_swap_space(bundle.args, block_size, bundle.dtype, need * swap_bytes_per_block(
        bundle.args, block_size, bundle.dtype, swap_dtype), swap_dtype)
    runner, blocks = ModelRunner(bundle.model, kv, bundle.device, host_kv=host), BlockManager(need, block_size)
    max_err, sum_err, count, max_logit, same_argmax = 0.0, 0.0, 0, 0.0, 0
    for p in prompts:
        ids = blocks.allocate(blocks_needed(len(p) + 1, block_size))
        first = runner.execute(StepPlan((SeqStep("p", tuple(p), 0, tuple(ids), GREEDY),))).sampled["p"]
        decode = StepPlan((SeqStep("p", (first,), len(p), tuple(ids), GREEDY),), want_logits=True)
        want = runner.execute(decode).logits["p"].float()
        runner.execute(StepPlan((), swap_out=tuple(zip(ids, range(len(ids))))))
        runner.execute(StepPlan((), swap_in=tuple(zip(range(len(ids)), ids))))
        got = runner.execute(decode).logits["p"].float()
        err = (got - want).abs()
        max_err, sum_err, count = max(max_err, err.max().item()), sum_err + err.sum().item(), count + err.numel()
        max_logit = max(max_logit, want.abs().max().item())
        same_argmax += int(got.argmax() == want.argmax())
        blocks.free(ids)
    return {"logit_max_abs_err": max_err, "logit_mean_abs_err": sum_err / count, "logit_max_abs": max_logit,
            "argmax_agreement": same_argmax / len(prompts)}


def run_swap_bench(cfg: EngineConfig, num_prompts: int = 20, max_tokens: int = 32) -> dict:
    """Every figure of the module doc for ``cfg``'s model and dtype; prints them as tables."""
    if num_prompts < 1 or max_tokens < 1:
        raise ValueError(f"num_prompts and max_tokens must be >= 1, got {num_prompts}, {max_tokens}")
    console = Console()
    if cfg.device == "cpu" and cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    bundle = ModelBundle.load(cfg)
    prompts = bench_prompts(bundle, num_prompts, cfg.seed)
    result: dict = {"dtype": str(bundle.dtype).removeprefix("torch."), "num_prompts": num_prompts,
                    "max_tokens": max_tokens}
    with console.status("reference run (no preemption)"):
        want, _ = run_greedy(bundle, reference_config(cfg, bundle, prompts, max_tokens), prompts, max_tokens)
    for swap_dtype in ("same", "int8"):
        per_block = swap_bytes_per_block(bundle.args, cfg.block_size, bundle.dtype, swap_dtype)
        with console.status(f"ALISE with swap ({swap_dtype})"):
            got, swapped = run_greedy(bundle, tight_swap_config(cfg, bundle, prompts, max_tokens, swap_dtype),
                                      prompts, max_tokens)
        result[swap_dtype] = {"bytes_per_block": per_block, "blocks_in_swap_gb": int(cfg.swap_gb * 2**30) // per_block,
                              "blocks_swapped_out": swapped, "token_agreement": token_agreement(want, got)}
    with console.status("logit error after an INT8 round trip"):
        result["int8"].update(int8_logit_error(bundle, prompts, cfg.block_size))
    _print(console, result, cfg.swap_gb)
    return result


def _print(console: Console, r: dict, swap_gb: float) -> None:
    t = Table(title=f"swap same vs int8 ({r['dtype']}, {r['num_prompts']} prompts, {r['max_tokens']} tokens, greedy, "
                    f"ALISE clock {STEP_S:g} s a step)")
    t.add_column("figure"), t.add_column("same", justify="right"), t.add_column("int8", justify="right")
    for key, label, fmt in (("bytes_per_block", "bytes per swapped block", "{:,}"),
                            ("blocks_in_swap_gb", f"blocks in --swap-gb {swap_gb:g}", "{:,}"),
                            ("blocks_swapped_out", "blocks swapped out (ALISE run)", "{:,}"),
                            ("token_agreement", "token agreement vs no preemption", "{:.2%}")):
        t.add_row(label, fmt.format(r["same"][key]), fmt.format(r["int8"][key]))
    console.print(t)
    i = r["int8"]
    console.print(f"one decode step after an INT8 round trip of the prompt's KV: max |Δlogit| "
                  f"{i['logit_max_abs_err']:.4f}, mean |Δlogit| {i['logit_mean_abs_err']:.5f} "
                  f"(max |logit| {i['logit_max_abs']:.1f}), argmax agreement {i['argmax_agreement']:.0%}")
