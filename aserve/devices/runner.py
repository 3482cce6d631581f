"""The runner: the only place that turns a ``StepPlan`` into tensors and calls the model.

A torch device (aserve/devices/torch_device.py) hands the plan its scheduler made, immutable, to
its own single-thread executor, which calls ``ModelRunner.execute`` and returns a ``StepOutput``.
The runner never touches ``Request`` objects or block managers.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

from aserve.devices.cuda_graphs import DecodeGraphs
from aserve.devices.logprobs import prompt_logprobs, sampled_logprobs
from model.attention import AttentionMeta, PrefillSeq, causal_mask
from model.kv_cache import HostKV, KVCache
from model.sampler import SampleSpec, sample
from scheduling.step import SeqStep, StepOutput, StepPlan


class ModelRunner:
    """Holds one instance's model and KV pool on one device."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, device, seed: int = 0,
                 host_kv: Optional[HostKV] = None):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        # decode steps as replayed CUDA graphs (aserve/devices/cuda_graphs.py), once captured
        self.graphs: Optional[DecodeGraphs] = None
        # swap space in host memory: the pool's dtype or INT8 + scales; the runner alone knows
        # which (schedulers hand out host block ids only)
        self.host_kv = host_kv
        self.block_size = kv.block_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.num_swapped_out = self.num_swapped_in = 0  # blocks copied each way, for reports and tests

    @torch.inference_mode()
    def execute(self, step: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        self._swap(step)
        if not step.seqs:
            return StepOutput({}, num_tokens=0, forward_s=time.perf_counter() - t0)
        replayed = self._replay_decode(step)
        if replayed is not None:
            logits, lay = replayed
            return self._sampled(step, lay, logits, None, None, t0)
        lay = self._prepare(step)
        features = None
        if lay.tap_rows and hasattr(self.model, "forward_tapped"):  # OPT has no tap: no features
            hidden, taps = self.model.forward_tapped(lay.ids, lay.positions, lay.meta, self.kv.pool, step.tap_layer,
                                                     self._long(lay.tap_rows))
            features = dict(zip(lay.tap_ids, taps.float().cpu()))
        else:
            hidden = self.model(lay.ids, lay.positions, lay.meta, self.kv.pool)  # [T, hidden]
        logits = None
        if lay.sample_rows:
            # a decode-only step samples every row in order: no gather (a batch-1 step is ~10 ms)
            rows = lay.sample_rows
            every_row = len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1
            logits = self.model.logits(hidden if every_row else hidden[torch.tensor(rows, device=self.device)])
        scored = prompt_logprobs(self.model.logits, hidden, lay.scored) if lay.scored else None
        return self._sampled(step, lay, logits, features, scored, t0)

    def _sampled(self, step: StepPlan, lay: "_Layout", logits: Optional[torch.Tensor], features, scored,
                 t0: float) -> StepOutput:
        """Sample the rows' ``logits`` (one row a sampled sequence, in order) into the output."""
        sampled, logits_out, logprobs = {}, None, None
        if lay.sample_rows:
            tokens = sample(logits, [_spec(s) for s in lay.sample_seqs], self.generator)
            sample_ids = [s.request_id for s in lay.sample_seqs]
            sampled = dict(zip(sample_ids, tokens))
            logprobs = sampled_logprobs(logits, lay.sample_seqs, tokens) or None
            if step.want_logits:
                logits_out = {rid: logits[i].cpu() for i, rid in enumerate(sample_ids)}
        if self.device.type == "cuda":  # this instance's stream only: others share the card
            torch.cuda.current_stream(self.device).synchronize()
        return StepOutput(sampled, num_tokens=lay.num_tokens, forward_s=time.perf_counter() - t0, logits=logits_out,
                          features=features, logprobs=logprobs, prompt_logprobs=scored)

    def _replay_decode(self, step: StepPlan) -> Optional[tuple[torch.Tensor, "_Layout"]]:
        """A decode-only step through its CUDA graph: the sampled rows' logits and the layout,
        or None where the step has a prompt chunk, pad rows, prompt scoring or features, or no
        graph holds it (it then runs eagerly)."""
        if self.graphs is None or step.num_pad_tokens or step.tap_layer:
            return None
        if any(len(s.token_ids) != 1 or s.prompt_targets for s in step.seqs):
            return None
        bs = self.block_size
        ctx = [s.start_pos + 1 for s in step.seqs]
        tables = [list(s.block_ids[:-(-c // bs)]) for s, c in zip(step.seqs, ctx)]
        slots = [t[s.start_pos // bs] * bs + s.start_pos % bs for s, t in zip(step.seqs, tables)]
        logits = self.graphs.run([s.token_ids[0] for s in step.seqs], [s.start_pos for s in step.seqs], slots,
                                 tables, ctx)
        if logits is None:
            return None
        rows = [i for i, s in enumerate(step.seqs) if s.sampling is not None]
        if len(rows) < len(step.seqs):
            logits = logits[torch.tensor(rows, device=self.device)]
        lay = _Layout(None, None, None, rows, [step.seqs[i] for i in rows], [], [], [], len(step.seqs))
        return logits, lay

    def _swap(self, step: StepPlan) -> None:
        """Swap-outs first, then swap-ins (a block freed by a swap-out may be reused at once).
        The gathered blocks stay on this device until the host store takes them, so an INT8
        store quantises here and only INT8 bytes and scales cross to host memory and back."""
        if not (step.swap_out or step.swap_in):
            return
        assert self.host_kv is not None, "swap needs host swap space"
        if step.swap_out:
            dev, host = zip(*step.swap_out)
            self.host_kv.blocks_from(list(host), self.kv.blocks_to(list(dev), self.device))
            self.num_swapped_out += len(dev)
        if step.swap_in:
            host, dev = zip(*step.swap_in)
            self.kv.blocks_from(list(dev), self.host_kv.blocks_to(list(host), self.device))
            self.num_swapped_in += len(dev)

    @torch.inference_mode()
    def forward_logits(self, step: StepPlan) -> torch.Tensor:
        """Logits of every token of the step, [T, vocab] (parity tests; writes the KV like execute)."""
        lay = self._prepare(step)
        return self.model.logits(self.model(lay.ids, lay.positions, lay.meta, self.kv.pool))

    def _prepare(self, step: StepPlan) -> "_Layout":
        bs = self.block_size
        prefills = [s for s in step.seqs if len(s.token_ids) > 1]
        decodes = [s for s in step.seqs if len(s.token_ids) == 1]
        ids, pos, slots, pre_meta, rows, sample_seqs = [], [], [], [], [], []
        tap_rows, tap_ids = [], []  # last-token rows of sequences whose features are asked for
        scored = []  # (first row, seq) of sequences whose prompt rows are scored (echo)
        for s in prefills + decodes:
            n = len(s.token_ids)
            start_tok = len(ids)
            ids.extend(s.token_ids)
            p = range(s.start_pos, s.start_pos + n)
            pos.extend(p)
            assert len(s.block_ids) * bs >= s.start_pos + n, f"{s.request_id}: blocks do not cover the step"
            slots.extend(s.block_ids[i // bs] * bs + i % bs for i in p)
            if n > 1:
                ctx = s.start_pos + n
                pre_meta.append(PrefillSeq(start_tok, start_tok + n, ctx,
                                           self._long(s.block_ids[:-(-ctx // bs)]),
                                           causal_mask(n, ctx, self.device)))
            if s.sampling is not None:
                rows.append(start_tok + n - 1)
                sample_seqs.append(s)
            if s.prompt_targets:
                scored.append((start_tok, s))
            if s.tap and step.tap_layer:
                tap_rows.append(start_tok + n - 1)
                tap_ids.append(s.request_id)
        num_prefill = len(ids) - len(decodes)
        ids.extend([0] * step.num_pad_tokens)
        pos.extend([0] * step.num_pad_tokens)
        bt, ctx_lens = self._decode_tables(decodes)
        meta = AttentionMeta(self._long(slots), tuple(pre_meta), num_prefill, len(decodes), bs, bt, ctx_lens)
        return _Layout(self._long(ids), self._long(pos), meta, rows, sample_seqs, tap_rows, tap_ids, scored, len(ids))

    def _decode_tables(self, decodes: list[SeqStep]):
        if not decodes:
            return None, None
        bs = self.block_size
        ctx = [d.start_pos + 1 for d in decodes]
        nb = max(-(-c // bs) for c in ctx)
        table = [list(d.block_ids[:nb]) + [0] * (nb - len(d.block_ids[:nb])) for d in decodes]
        return self._long(table), self._long(ctx)

    def _long(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)


class _Layout(NamedTuple):
    """A plan laid out as rows: the model's inputs and which rows each output comes from."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMeta
    sample_rows: list  # the row of each sampled sequence's last token
    sample_seqs: list  # their SeqSteps, in the same order
    tap_rows: list
    tap_ids: list
    scored: list  # (first row, SeqStep) with prompt targets
    num_tokens: int  # rows of the step, pad rows included (a replayed graph's pad rows not)


def _spec(s: SeqStep) -> SampleSpec:
    sp = s.sampling
    return SampleSpec(sp.temperature, sp.top_k, sp.top_p, sp.seed, s.num_output_tokens)
