"""``aserve bench engine``: the engine's speed, side by side in one run on one device and dtype.

- prefill: tokens/s of one chunk of 32 .. 2048 tokens; ``saturate_chunk`` is the smallest size
  within 10% of the best tokens/s (TetriInfer's accelerator-saturate threshold, its Figure 2),
  at this run's threads (serving derives its chunk from ``aserve profile device`` at the
  instances' threads instead);
- decode: step time at batch 1, 8, 32, 64 with 512 tokens of context each (the cache holds
  random values: a step's cost does not depend on them);
- generate: the same 32 prompts (~128 tokens, 128 new tokens, greedy) through transformers'
  ``generate`` (padded batch) and through our engine;
- roofline: weight bytes / memory read bandwidth measured in this run, against the batch-1
  step. A decode step only reads weights (and a little KV), so the roofline uses what the
  machine reads per second (``read_bandwidth``); the copy bandwidth STREAM-style probes report
  (read + write counted) is measured and printed beside it, with the ratio it would give. On a
  shared machine memory speed drifts within minutes (the read probe gave 27 and 46 GB/s in two
  runs an hour apart), so the step and the probes are measured in interleaved rounds and the
  ratio is the median of the rounds' own ratios; every round is in the JSON.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from datetime import date
from typing import Optional

import torch
from rich.console import Console
from rich.table import Table

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.engine.offline import LLM
from aserve.devices.torch_device import build_runner, uses_cuda_graphs
from scheduling.step import GREEDY, SeqStep, StepPlan
from model.attention import pick_backend
from scheduling.request import SamplingParams

PREFILL_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 8, 32, 64)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn, reps: int, device: str) -> float:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_prefill(runner, blocks, device, sizes, reps) -> dict:
    out = {}
    for n in sizes:
        block_ids = blocks.allocate(-(-n // blocks.block_size))
        ids = tuple(torch.randint(100, 30000, (n,)).tolist())
        step = StepPlan((SeqStep("p", ids, 0, tuple(block_ids), GREEDY),))
        dt = _median_time(lambda: runner.execute(step), reps, device)
        blocks.free(block_ids)
        out[n] = {"seconds": dt, "tokens_per_s": n / dt}
    best = max(v["tokens_per_s"] for v in out.values())
    saturate = min(n for n, v in out.items() if v["tokens_per_s"] >= 0.9 * best)
    return {"chunks": out, "saturate_chunk": saturate}


def bench_decode(runner, blocks, device, batches, ctx, reps) -> dict:
    out = {}
    for b in batches:
        tables = [blocks.allocate(-(-(ctx + 1) // blocks.block_size)) for _ in range(b)]
        step = StepPlan(tuple(SeqStep(f"d{i}", (7,), ctx, tuple(t), GREEDY) for i, t in enumerate(tables)))
        dt = _median_time(lambda: runner.execute(step), reps, device)
        for t in tables:
            blocks.free(t)
        out[b] = {"step_ms": dt * 1000, "tokens_per_s": b / dt}
    return out


def step_kernels(runner, blocks, ctx: int) -> Optional[dict]:
    """What an eager batch-1 decode step (the one its graph replays) launches on the GPU: the
    kernels' count and their summed device time (torch.profiler; None where it reads no CUDA
    kernels). Against the replayed step's time it says whether the kernels' own time, not the
    launches, is what is left."""
    from torch.profiler import ProfilerActivity, profile

    table = blocks.allocate(-(-(ctx + 1) // blocks.block_size))
    step = StepPlan((SeqStep("k", (7,), ctx, tuple(table), GREEDY),))
    try:
        runner.execute(step)
        _sync(runner.device.type)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(step)
            _sync(runner.device.type)
    except RuntimeError as e:  # a machine whose profiler cannot read the GPU: the bench goes on without it
        return {"error": str(e)[:200]}
    finally:
        blocks.free(table)
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    if not kernels:
        return None
    busy = sum(e.time_range.elapsed_us() for e in kernels)  # microseconds
    return {"count": len(kernels), "device_ms": busy / 1000, "mean_us": busy / len(kernels)}


def copy_bandwidth(device: str, nbytes: int = 1 << 30, rounds: int = 3) -> float:
    """Bytes/s of a large tensor copy (read + write counted): the best of ``rounds`` fresh pairs
    of buffers, as STREAM reports its best. On the 2-core CPU machine a process copied its first
    pair at ~45 GB/s and later ones at ~75 in one run, 42-45 throughout in others; and while the
    copy gave 43-45 GB/s, reading alone gave 22-28: a copy keeps reads and writes in flight
    together, two cores' reads alone are bounded by how many misses each can keep waiting."""
    best = 0.0
    for _ in range(rounds):
        x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
        y = torch.empty_like(x)
        dt = _median_time(lambda: y.copy_(x), 5, device)
        best = max(best, 2 * x.numel() * x.element_size() / dt)
        del x, y
    return best


def read_bandwidth(device: str, nbytes: int = 1 << 30, rounds: int = 3) -> float:
    """Bytes/s of reading a large buffer once: the best of ``rounds`` fresh buffers. On a CPU
    with our kernels, ``model.native``'s read pass (the packed products' own loads and L2
    prefetch, so the roofline is not below what the kernels can do); elsewhere a sum, which on
    CUDA is bound by memory reads."""
    from model import native

    best = 0.0
    cpu = not device.startswith("cuda")
    for _ in range(rounds):
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        read = (lambda: native.load().read_pass(x)) if cpu and native.available() else (lambda: x.sum())
        best = max(best, nbytes / _median_time(read, 5, device))
        del x
    return best


def bench_roofline(runner, blocks, device: str, wbytes: int, rounds: int, ctx: int, reps: int, nbytes: int) -> dict:
    """The batch-1 decode step (``ctx`` tokens of context) against the weight-read roofline, in
    ``rounds`` rounds of: the step's median over ``reps``, a read pass, a copy. Each round's ratio
    compares figures taken within a second of each other; the result is the rounds' median."""
    got = []
    for _ in range(rounds):
        step_ms = bench_decode(runner, blocks, device, (1,), ctx, reps)[1]["step_ms"]
        read, copy = read_bandwidth(device, nbytes, rounds=1), copy_bandwidth(device, nbytes, rounds=1)
        got.append({"step_ms": step_ms, "read_gb_s": read / 1e9, "copy_gb_s": copy / 1e9,
                    "vs_roofline": step_ms / (wbytes / read * 1000), "vs_copy_roofline": step_ms / (wbytes / copy * 1000)})
    read = statistics.median(r["read_gb_s"] for r in got) * 1e9
    return {"roofline_rounds": got, "memory_bandwidth_gb_s": read / 1e9, "roofline_decode_step_ms": wbytes / read * 1000,
            "decode_step_vs_roofline": statistics.median(r["vs_roofline"] for r in got),
            "copy_bandwidth_gb_s": statistics.median(r["copy_gb_s"] for r in got),
            "decode_step_vs_copy_roofline": statistics.median(r["vs_copy_roofline"] for r in got)}


def weight_bytes(model: torch.nn.Module) -> int:
    # tied embeddings are read once per step, by the LM head; RoPE tables are buffers, not weights
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_generate(bundle: ModelBundle, cfg: EngineConfig, num_prompts=32, prompt_len=128, new_tokens=128) -> dict:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 30000, (num_prompts, prompt_len), generator=g)
    hf = AutoModelForCausalLM.from_pretrained(bundle.path, dtype=bundle.dtype).to(cfg.device).eval()
    ids = prompts.to(cfg.device)
    with torch.inference_mode():
        hf.generate(ids[:2, :8], attention_mask=torch.ones_like(ids[:2, :8]), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)
        _sync(cfg.device)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)
        _sync(cfg.device)
        hf_s = time.perf_counter() - t0
    del hf
    total = num_prompts * new_tokens
    ours_s = _generate_s(LLM(cfg, bundle=bundle), prompts, new_tokens)
    out = {"hf_generate_tokens_per_s": total / hf_s, "aserve_generate_tokens_per_s": total / ours_s,
           "generate_speedup": hf_s / ours_s, "hf_generate_s": hf_s, "aserve_generate_s": ours_s}
    if uses_cuda_graphs(cfg):  # the same without graphs, beside
        eager_s = _generate_s(LLM(dataclasses.replace(cfg, enforce_eager=True), bundle=bundle), prompts, new_tokens)
        out.update({"aserve_generate_eager_tokens_per_s": total / eager_s, "aserve_generate_eager_s": eager_s})
    return out


def _generate_s(llm: LLM, prompts: torch.Tensor, new_tokens: int) -> float:
    """Seconds ``llm`` takes to generate ``new_tokens`` greedy tokens for each prompt (after a
    two-token warm-up)."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompts[0, :8].tolist()], SamplingParams(max_tokens=2, temperature=0))
    t0 = time.perf_counter()
    outs = llm.generate([p.tolist() for p in prompts], sp)
    seconds = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in outs) == prompts.shape[0] * new_tokens
    return seconds


def run_engine_bench(cfg: EngineConfig, json_path: str | None, quick: bool = False) -> int:
    console = Console()
    if cfg.device == "cpu" and cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    bundle = ModelBundle.load(cfg)
    runner, blocks = build_runner(bundle, cfg)
    reps = 2 if quick else 5
    sizes = PREFILL_SIZES[:3] if quick else PREFILL_SIZES
    batches = DECODE_BATCHES[:2] if quick else DECODE_BATCHES
    with console.status("prefill chunks"):
        prefill = bench_prefill(runner, blocks, cfg.device, sizes, reps)
    with console.status("decode steps"):
        decode = bench_decode(runner, blocks, cfg.device, batches, 128 if quick else 512, reps * 2)
    graphs = runner.graphs
    decode_eager, kernels = None, None
    if graphs is not None:  # the same steps eagerly, side by side, and what one step launches
        runner.graphs = None
        with console.status("decode steps, eager"):
            decode_eager = bench_decode(runner, blocks, cfg.device, batches, 128 if quick else 512, reps * 2)
            kernels = step_kernels(runner, blocks, 128 if quick else 512)
        runner.graphs = graphs
    wbytes = weight_bytes(bundle.model)
    with console.status("batch-1 step against memory bandwidth, interleaved"):
        roof = bench_roofline(runner, blocks, cfg.device, wbytes, 2 if quick else 5, 128 if quick else 512, reps * 2,
                              1 << 28 if quick else 1 << 30)
    with console.status("generate: transformers vs aserve"):
        gen = bench_generate(bundle, cfg, *((4, 32, 16) if quick else (32, 128, 128)))
    result = {
        "machine": _machine(cfg.device), "date": date.today().isoformat(), "device": cfg.device,
        "dtype": str(bundle.dtype).removeprefix("torch."), "kernels": bundle.kernels,
        "attention": pick_backend(cfg.attention, cfg.device, bundle.kernels != "fallback", cfg.block_size, bundle.dtype), "threads": torch.get_num_threads(),
        "model": str(bundle.path.name), "prefill": prefill["chunks"], "saturate_chunk": prefill["saturate_chunk"],
        "decode": decode, "weight_bytes": wbytes, **roof, **gen,
    }
    if graphs is not None:
        result.update({"cuda_graphs": graphs.report.describe(), "decode_eager": decode_eager,
                       "decode_step_kernels": kernels})
    _print(console, result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"wrote {json_path}")
    return 0


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _print(console: Console, r: dict) -> None:
    t = Table(title=f"prefill ({r['dtype']}, {r['device']}, kernels {r['kernels']}, {r['threads']} threads)")
    t.add_column("chunk"), t.add_column("ms", justify="right"), t.add_column("tokens/s", justify="right")
    for n, v in r["prefill"].items():
        t.add_row(str(n), f"{v['seconds'] * 1000:.1f}", f"{v['tokens_per_s']:.0f}")
    console.print(t)
    console.print(f"saturate_chunk = {r['saturate_chunk']}")
    t = Table(title="decode (512 tokens of context each)")
    t.add_column("batch"), t.add_column("step ms", justify="right"), t.add_column("tokens/s", justify="right")
    for b, v in r["decode"].items():
        t.add_row(str(b), f"{v['step_ms']:.1f}", f"{v['tokens_per_s']:.0f}")
    console.print(t)
    if r.get("decode_eager"):
        t = Table(title=f"decode: CUDA graphs against eager ({r['cuda_graphs']})")
        for c in ("batch", "graphs ms", "eager ms", "eager / graphs"):
            t.add_column(c, justify="right")
        for b, v in r["decode"].items():
            e = r["decode_eager"][b]["step_ms"]
            t.add_row(str(b), f"{v['step_ms']:.2f}", f"{e:.2f}", f"{e / v['step_ms']:.1f}")
        console.print(t)
        k = r.get("decode_step_kernels")
        if k and "count" in k:
            console.print(f"an eager batch-1 step launches {k['count']} kernels, {k['device_ms']:.2f} ms of device time "
                          f"({k['mean_us']:.1f} us each)")
    t = Table(title="batch-1 step against the weight-read roofline, interleaved rounds")
    for c in ("step ms", "read GB/s", "x roofline", "copy GB/s", "x copy roofline"):
        t.add_column(c, justify="right")
    for x in r["roofline_rounds"]:
        t.add_row(f"{x['step_ms']:.2f}", f"{x['read_gb_s']:.1f}", f"{x['vs_roofline']:.2f}", f"{x['copy_gb_s']:.1f}",
                  f"{x['vs_copy_roofline']:.2f}")
    console.print(t)
    t = Table(title="side by side")
    t.add_column("figure"), t.add_column("value", justify="right")
    for k in ("hf_generate_tokens_per_s", "aserve_generate_tokens_per_s", "aserve_generate_eager_tokens_per_s",
              "generate_speedup", "memory_bandwidth_gb_s",
              "roofline_decode_step_ms", "decode_step_vs_roofline", "copy_bandwidth_gb_s",
              "decode_step_vs_copy_roofline"):
        if k in r:
            t.add_row(k, f"{r[k]:.2f}")
    console.print(t)
