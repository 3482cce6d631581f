"""Decode steps replayed as CUDA graphs: one graph per (padded batch, context width) bucket.

On a GPU a decode step of the default model launches several hundred small kernels from
Python (30 layers), so its time is the launches', not the GPU's (docs/notes/cuda.md, "CUDA":
16 ms a step on an H100 at batch 1 and at batch 64, where reading the weights takes 0.09 ms).
A captured graph replays every kernel of the step with one launch, as vLLM and SGLang do per
batch size.

Every graph reads its inputs from one static buffer on the device, at offsets fixed when it was
captured. A step copies its inputs there in one host-to-device copy, replays the graph and reads
the logits the graph wrote::

    static int64 buffer, as the graph of (b rows, w blocks a row) reads it:
      [ token ids: b | positions: b | slots: b | context lengths: b | block tables: b x w ]

A step of n <= b decodes whose longest context fits in w blocks fills rows 0..n-1; rows n..b-1
are pad rows (token 0 at position 0) whose K/V goes to the pool's scratch block and which attend
to that one slot, so they touch no request's blocks. Table columns past a row's own blocks name
the scratch block too (the context length masks them).

The context width is bucketed because the attention that runs under capture (sdpa and the
reference gather each row's blocks up to the table's width; flash reads them in place) would
otherwise gather the model's whole context for every row: 8,192 tokens for a 100-token decode.

Buckets: batches ``CAPTURE_BATCHES`` up to ``max_batch``, widths doubling from ``MIN_WIDTH``
blocks up to the model's context. A pair (b, w) whose rows could not all hold more than w/2
blocks at once in the pool is not captured (such a step needs shared blocks and runs eagerly). A
step outside every bucket (more rows, a longer context), and every step with a prompt chunk,
prompt scoring (echo) or features, runs eagerly as before.

``replay=False`` runs the same padded static-buffer step eagerly, without capture: the CPU tests
check with it the layout (padding, the scratch block, offsets) that the GPU replays.

``fused=True`` (the default where it applies: ``model.fused_step.refusal``) captures buckets of up
to ``fused_step.MAX_BATCH`` rows over the fused step instead of torch's: five Triton kernels a
layer instead of about 27 (``model/fused_step.py``); larger batches capture torch's step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from model import fused_step
from model.attention import AttentionMeta
from model.fused_step import FusedStep
from model.kv_cache import KVCache

CAPTURE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 4  # blocks: the narrowest context bucket (64 tokens at the default block size)


@dataclass(frozen=True)
class CaptureReport:
    """What capturing cost, for the start-up line."""

    num_graphs: int
    batches: tuple[int, ...]
    widths: tuple[int, ...]  # blocks a row
    block_size: int
    seconds: float
    memory_bytes: int  # device memory the graphs hold (free memory before less after)
    fused: str = "off"  # the fused step: "batch 1-16" where it runs, else why not

    def describe(self) -> str:
        if not self.num_graphs:
            return "no CUDA graphs captured"
        return (f"{self.num_graphs} decode CUDA graphs (batch {self.batches[0]}-{self.batches[-1]}, context "
                f"{self.widths[0] * self.block_size}-{self.widths[-1] * self.block_size} tokens) captured in "
                f"{self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB; fused step: {self.fused}")


def capture_batches(max_batch: int) -> tuple[int, ...]:
    """``CAPTURE_BATCHES`` below ``max_batch`` (at most the largest), and ``max_batch`` itself."""
    cap = max(1, min(max_batch, CAPTURE_BATCHES[-1]))
    return tuple(b for b in CAPTURE_BATCHES if b < cap) + (cap,)


def capture_widths(max_blocks: int) -> tuple[int, ...]:
    """Widths in blocks, doubling from ``MIN_WIDTH`` until one holds ``max_blocks``."""
    widths = [MIN_WIDTH]
    while widths[-1] < max_blocks:
        widths.append(widths[-1] * 2)
    return tuple(widths)


def can_occur(batch: int, width: int, num_blocks: int) -> bool:
    """Whether a step of this bucket can occur without shared blocks: its fewest rows
    (``batch // 2 + 1``, or 1) each holding more blocks than the narrower bucket
    (``width // 2 + 1``) fit in the pool."""
    rows = 1 if batch == 1 else batch // 2 + 1
    blocks = 1 if width == MIN_WIDTH else width // 2 + 1
    return rows * blocks <= num_blocks


class DecodeGraphs:
    """Decode steps of one runner (its model and KV pool) as replayed graphs."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int, max_context: int, replay: bool = True,
                 fused: bool = True):
        if kv.scratch_block is None:
            raise ValueError("CUDA graphs need a KV pool with a scratch block (KVCache(..., scratch=True))")
        self.model, self.kv, self.replay = model, kv, replay
        self.fused: Optional[FusedStep] = None
        self.fused_refusal = fused_step.refusal(model, kv.pool.dtype, kv.device) if fused else "off (--no-fused-step)"
        if self.fused_refusal is None:
            self.fused = FusedStep(model, kv.pool, kv.block_size, max_batch)
        self.block_size = kv.block_size
        self.device = kv.device
        self.batches = capture_batches(max_batch)
        self.widths = capture_widths(-(-max_context // self.block_size))
        self.buckets = [(b, w) for b in self.batches for w in self.widths if can_occur(b, w, kv.num_blocks)]
        self.static = torch.zeros(max(4 * b + b * w for b, w in self.buckets), dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.report: Optional[CaptureReport] = None
        self.num_replays = 0

    def bucket(self, num_rows: int, num_blocks: int) -> Optional[tuple[int, int]]:
        """The smallest captured (b, w) holding ``num_rows`` rows of up to ``num_blocks`` blocks."""
        b = next((b for b in self.batches if b >= num_rows), None)
        w = next((w for w in self.widths if w >= num_blocks), None)
        if b is None or w is None or (b, w) not in self.buckets:
            return None
        return b, w

    def _forward(self, b: int, w: int) -> torch.Tensor:
        """The padded step of bucket (b, w) over the static buffer: logits [b, vocab]. The
        metadata is built here, inside the capture, so what it derives (the decode mask) is
        computed by the graph on every replay, not frozen from the capture's inputs."""
        s = self.static
        ids, positions, slots, ctx_lens = s[:b], s[b:2 * b], s[2 * b:3 * b], s[3 * b:4 * b]
        tables = s[4 * b:4 * b + b * w].view(b, w)
        if self.fused is not None and b <= self.fused.max_batch:
            return self.fused(ids, positions, slots, ctx_lens, tables)
        meta = AttentionMeta(slots, (), 0, b, self.block_size, tables, ctx_lens)
        return self.model.logits(self.model(ids, positions, meta, self.kv.pool))

    def _fill(self, b: int, w: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              tables: Sequence[Sequence[int]], ctx_lens: Sequence[int]) -> None:
        """One host-to-device copy of a step's rows, padded to (b, w) with the scratch block."""
        pad = b - len(ids)
        scratch = self.kv.scratch_block
        flat = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[scratch * self.block_size] * pad,
                *ctx_lens, *[1] * pad]
        for row in tables:
            flat += row
            flat += [scratch] * (w - len(row))
        flat += [scratch] * (w * pad)
        self.static[:len(flat)].copy_(torch.tensor(flat, dtype=torch.long), non_blocking=True)

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], ctx_lens: Sequence[int]) -> Optional[torch.Tensor]:
        """Logits [n, vocab] of a decode step of n rows (``tables``: each row's blocks covering
        its context, no more), or None where no bucket holds it (the caller runs it eagerly)."""
        key = self.bucket(len(ids), max(len(t) for t in tables))
        if key is None or (self.replay and key not in self.graphs):
            return None
        self._fill(*key, ids, positions, slots, tables, ctx_lens)
        self.num_replays += 1
        if not self.replay:
            return self._forward(*key)[:len(ids)]
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:len(ids)]

    @torch.inference_mode()
    def check_fused(self, buckets: Optional[Sequence[tuple[int, int]]] = None) -> None:
        """Run the fused step once eagerly on pad rows of each of its buckets (``buckets``: those
        given), which builds every kernel it will replay. Where Triton cannot build or run one
        here (a card or a Triton without what a kernel asks), the graphs capture torch's step
        instead and ``fused_refusal`` (the start-up line) says why: a server starts either way."""
        todo = [(b, w) for b, w in (buckets or self.buckets) if b <= self.fused.max_batch]
        try:
            for b, w in todo:
                self._fill(b, w, [], [], [], [], [])
                self._forward(b, w)
        except Exception as e:  # a compiler's or driver's error, whatever its type
            lines = str(e).strip().splitlines()
            first = lines[0][:200] if lines else ""
            self.fused = None
            self.fused_refusal = f"off: Triton could not build it here ({type(e).__name__}: {first})"

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every bucket, largest first (the smaller ones reuse its memory from the one
        pool they share). Each is run once eagerly on a side stream first, so lazy set-up (cuBLAS
        handles and workspaces, kernel choices) happens outside the capture."""
        t0 = time.perf_counter()
        if self.replay and self.fused is not None:
            self.check_fused()
        fused = self.fused_refusal or f"batch 1-{self.fused.max_batch}, {self.fused.kernels_a_step()} kernels a step"
        if not self.replay:
            self.report = CaptureReport(0, self.batches, self.widths, self.block_size, 0.0, 0, fused)
            return self.report
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        for b, w in sorted(self.buckets, reverse=True):
            self._fill(b, w, [], [], [], [], [])  # every row a pad row
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._forward(b, w)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: instances on other threads may step while this one captures
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(b, w)
            self.graphs[(b, w)] = (graph, logits)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.report = CaptureReport(len(self.graphs), self.batches, self.widths, self.block_size,
                                    time.perf_counter() - t0, max(0, used), fused)
        return self.report
