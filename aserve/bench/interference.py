"""``aserve bench interference``: TetriInfer's §2.2 study on our engine, one coupled iteration at a time.

Running prefill and decode in one batch makes them slow each other down; the paper measures it
on an A100 (its Figures 3-5). Here the same iterations run on our runner, timed on this device:

- prefill beside prefill: one light prompt (``--light`` tokens) alone, then in one iteration with
  7 and 63 more light prompts, and with 1 and 3 heavy prompts (``--heavy`` tokens): the light
  prompt's latency is the iteration's time (the paper: up to 10x with 63 neighbours);
- decode beside prefill: one decode step of a batch (``--decode-batch`` requests at ``--light``
  tokens of context) alone, then sharing its iteration with one heavy prefill (the paper: 5x);
- decode beside decode: tokens/s of a batch of light decodes (short contexts) against the same
  batch where half are heavy decodes (``--heavy-context`` tokens of context) (the paper: -16%).

Every figure is the median of ``--reps`` timed iterations after a warm-up. The KV cache holds
random values: the cost of an iteration does not depend on them.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import date
from typing import Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table

from aserve.bench.engine import _median_time
from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.torch_device import build_runner
from scheduling.step import GREEDY, SeqStep, StepPlan
from model.kv_cache import kv_bytes_per_block
from scheduling.block_manager import BlockManager


class _Steps:
    """Builds iterations over one runner's pool; every block taken is given back after each figure."""

    def __init__(self, runner, blocks: BlockManager, device: str, reps: int):
        self.runner, self.blocks, self.device, self.reps = runner, blocks, device, reps
        self.vocab = runner.model.args.vocab_size
        self._held: list[list[int]] = []
        self._n = 0

    def _table(self, num_tokens: int) -> tuple[int, ...]:
        ids = self.blocks.allocate(-(-num_tokens // self.blocks.block_size))
        self._held.append(ids)
        return tuple(ids)

    def prefill(self, n: int) -> SeqStep:
        self._n += 1
        ids = tuple(torch.randint(min(100, self.vocab - 1), min(30000, self.vocab), (n,)).tolist())
        return SeqStep(f"p{self._n}", ids, 0, self._table(n), GREEDY)

    def decode(self, context: int) -> SeqStep:
        self._n += 1
        return SeqStep(f"d{self._n}", (7,), context, self._table(context + 1), GREEDY)

    def time(self, seqs: Sequence[SeqStep]) -> float:
        step = StepPlan(tuple(seqs))
        try:
            return _median_time(lambda: self.runner.execute(step), self.reps, self.device)
        finally:
            for ids in self._held:
                self.blocks.free(ids)
            self._held.clear()


def measure(steps: _Steps, light: int, heavy: int, decode_batch: int, heavy_context: int) -> dict:
    """The three studies; seconds per iteration and the slowdowns against the lone case."""
    p = steps.prefill
    alone = steps.time([p(light)])
    prefill = {"light_alone_s": alone}
    for k in (7, 63):
        prefill[f"light_with_{k}_light_s"] = steps.time([p(light) for _ in range(k + 1)])
    for k in (1, 3):
        prefill[f"light_with_{k}_heavy_s"] = steps.time([p(light)] + [p(heavy) for _ in range(k)])
    prefill["slowdowns"] = {k[:-2]: v / alone for k, v in prefill.items() if k != "light_alone_s"}

    d = steps.decode
    step_alone = steps.time([d(light) for _ in range(decode_batch)])
    step_mixed = steps.time([d(light) for _ in range(decode_batch)] + [p(heavy)])
    decode = {"step_alone_s": step_alone, "step_with_heavy_prefill_s": step_mixed,
              "slowdown": step_mixed / step_alone}

    half = decode_batch // 2
    light_tps = decode_batch / steps.time([d(light) for _ in range(decode_batch)])
    mixed_tps = decode_batch / steps.time([d(light) for _ in range(decode_batch - half)]
                                          + [d(heavy_context) for _ in range(half)])
    mix = {"all_light_tokens_per_s": light_tps, "half_heavy_tokens_per_s": mixed_tps,
           "throughput_drop": 1 - mixed_tps / light_tps}
    return {"prefill_beside_prefill": prefill, "decode_beside_prefill": decode, "decode_beside_decode": mix}


def run_interference_bench(cfg: EngineConfig, light: int = 128, heavy: int = 1024, decode_batch: int = 32,
                           heavy_context: int = 2048, reps: int = 5, json_path: Optional[str] = None,
                           console: Optional[Console] = None) -> dict:
    for name, v in (("--light", light), ("--heavy", heavy), ("--decode-batch", decode_batch),
                    ("--heavy-context", heavy_context), ("--reps", reps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if heavy <= light or heavy_context <= light:
        raise ValueError(f"--heavy ({heavy}) and --heavy-context ({heavy_context}) must exceed --light ({light})")
    console = console or Console()
    if cfg.device == "cpu" and cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    bundle = ModelBundle.load(cfg)
    largest = max(64 * light + heavy, 3 * heavy + light, decode_batch * (heavy_context + 1) + heavy)
    # one block of slack per request (each starts a fresh block), and 10% on top
    num_blocks = -(-largest // cfg.block_size) + 64 + decode_batch
    need_gb = num_blocks * kv_bytes_per_block(bundle.args, cfg.block_size, bundle.dtype) / 2**30 * 1.1
    runner, blocks = build_runner(bundle, dataclasses.replace(cfg, kv_cache_gb=max(cfg.kv_cache_gb, need_gb)))
    with console.status("timing iterations"):
        result = measure(_Steps(runner, blocks, cfg.device, reps), light, heavy, decode_batch, heavy_context)
    result["setup"] = {"model": cfg.model, "dtype": str(bundle.dtype).replace("torch.", ""), "device": cfg.device,
                       "threads": torch.get_num_threads() if cfg.device == "cpu" else None, "light": light,
                       "heavy": heavy, "decode_batch": decode_batch, "heavy_context": heavy_context, "reps": reps,
                       "date": date.today().isoformat()}
    _print(result, console)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _print(r: dict, console: Console) -> None:
    s = r["setup"]
    t = Table(title=f"interference ({s['dtype']}, {s['device']}): light {s['light']}, heavy {s['heavy']} tokens")
    t.add_column("case")
    t.add_column("iteration ms", justify="right")
    t.add_column("vs alone", justify="right")
    t.add_column("paper (A100)", justify="right")
    p = r["prefill_beside_prefill"]
    t.add_row("light prefill alone", f"{p['light_alone_s'] * 1e3:.1f}", "1.00x", "")
    paper = {"light_with_7_light": "", "light_with_63_light": "~10x", "light_with_1_heavy": "", "light_with_3_heavy": ""}
    for k, label in (("light_with_7_light", "+ 7 light prefills"), ("light_with_63_light", "+ 63 light prefills"),
                     ("light_with_1_heavy", "+ 1 heavy prefill"), ("light_with_3_heavy", "+ 3 heavy prefills")):
        t.add_row(label, f"{p[k + '_s'] * 1e3:.1f}", f"{p['slowdowns'][k]:.2f}x", paper[k])
    d = r["decode_beside_prefill"]
    t.add_row(f"decode step, batch {s['decode_batch']}", f"{d['step_alone_s'] * 1e3:.1f}", "1.00x", "")
    t.add_row("  + 1 heavy prefill", f"{d['step_with_heavy_prefill_s'] * 1e3:.1f}", f"{d['slowdown']:.2f}x", "~5x")
    m = r["decode_beside_decode"]
    t.add_row("decode tok/s, all light", f"{m['all_light_tokens_per_s']:.0f} tok/s", "", "")
    t.add_row(f"  half heavy ({s['heavy_context']} ctx)", f"{m['half_heavy_tokens_per_s']:.0f} tok/s",
              f"-{m['throughput_drop'] * 100:.0f}%", "-16%")
    console.print(t)
