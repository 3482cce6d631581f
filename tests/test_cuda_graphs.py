"""Decode steps as CUDA graphs (aserve/devices/cuda_graphs.py).

On the CPU the graphs' layout runs without capture (``replay=False``): the same padded step over
the same static buffer, so padding, the scratch block and the offsets are checked here; the
``gpu`` tests replay captured graphs against eager steps on a card."""
import pytest
import torch

from aserve.devices.cuda_graphs import (MIN_WIDTH, DecodeGraphs, capture_batches, capture_widths, can_occur)
from aserve.devices.runner import ModelRunner
from model.kv_cache import KVCache
from scheduling.block_manager import BlockManager
from scheduling.step import GREEDY, SeqStep, StepPlan
from tests.tiny import LLAMA, OPT, hf_model, ours


def test_buckets_cover_every_batch_and_context():
    assert capture_batches(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert capture_batches(6) == (1, 2, 4, 6)
    assert capture_batches(1) == (1,)
    assert capture_batches(1000)[-1] == 256  # larger batches run eagerly
    assert capture_widths(512) == (4, 8, 16, 32, 64, 128, 256, 512)
    assert capture_widths(3) == (MIN_WIDTH,)
    assert capture_widths(33)[-1] == 64


def test_buckets_that_cannot_occur_are_left_out():
    # 100 blocks: 17 rows (the fewest in bucket 32) of 9+ blocks (bucket 16) cannot all be there
    assert can_occur(32, 8, 100) and not can_occur(32, 16, 100)
    assert can_occur(1, 512, 257) and not can_occur(1, 512, 256)
    assert can_occur(256, MIN_WIDTH, 129)  # the narrowest bucket needs one block a row


def runners(cfg=LLAMA, backend="reference", dtype=torch.float32, num_blocks=64, device="cpu", replay=False,
            max_batch=8):
    """Two runners over one model: one plain, one with graphs (pool with a scratch block)."""
    model = ours(cfg, hf_model(cfg), dtype, backend).to(device)
    plain = ModelRunner(model, KVCache(model.args, num_blocks, 16, dtype, device), device)
    kv = KVCache(model.args, num_blocks, 16, dtype, device, scratch=True)
    graphed = ModelRunner(model, kv, device)
    graphed.graphs = DecodeGraphs(model, kv, max_batch, model.args.max_position, replay=replay)
    graphed.graphs.capture()
    return plain, graphed


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


def run_both(plain, graphed, lengths, decode_steps=3, block_size=16):
    """Prefill ``lengths`` in one step, then decode steps of every request; both runners get the
    same plans. Returns the logits of every decode step from each, and the block manager."""
    blocks = BlockManager(plain.kv.num_blocks, block_size)
    seqs = prompts(lengths)
    tables = [blocks.allocate(-(-(n + decode_steps) // block_size)) for n in lengths]
    first = StepPlan(tuple(SeqStep(f"r{i}", tuple(s), 0, tuple(t), GREEDY) for i, (s, t) in
                           enumerate(zip(seqs, tables))), want_logits=True)
    outs = {"plain": [], "graphed": []}
    nexts = {}
    for name, runner in (("plain", plain), ("graphed", graphed)):
        nexts[name] = runner.execute(first).sampled
    for k in range(decode_steps):
        assert nexts["plain"] == nexts["graphed"]
        step = StepPlan(tuple(SeqStep(f"r{i}", (nexts["plain"][f"r{i}"],), n + k, tuple(t), GREEDY, k + 1)
                              for i, (n, t) in enumerate(zip(lengths, tables))), want_logits=True)
        for name, runner in (("plain", plain), ("graphed", graphed)):
            out = runner.execute(step)
            outs[name].append(torch.stack([out.logits[f"r{i}"] for i in range(len(lengths))]).cpu())
            nexts[name] = out.sampled
    return outs, tables


@pytest.mark.parametrize("cfg", [LLAMA, OPT], ids=["llama", "opt"])
@pytest.mark.parametrize("lengths", [[5], [40, 17, 3], [70, 9, 33, 2, 18]], ids=["1", "3", "5"])
def test_padded_static_step_matches_the_plain_step(cfg, lengths):
    """Batches of 1, 3 (padded to 4) and 5 (padded to 8), contexts across two width buckets."""
    plain, graphed = runners(cfg)
    outs, _ = run_both(plain, graphed, lengths)
    for a, b in zip(outs["plain"], outs["graphed"]):
        assert (a - b).abs().max().item() <= 1e-5
    assert graphed.graphs.num_replays == 3  # every decode step went through the static buffer


def test_pad_rows_touch_only_the_scratch_block():
    plain, graphed = runners()
    _, tables = run_both(plain, graphed, [40, 17, 3])  # 3 rows padded to 4
    used = sorted(b for t in tables for b in t)
    n = plain.kv.num_blocks
    # the requests' KV: the same (to float rounding: a padded batch's products may sum in another order)
    assert (graphed.kv.pool[:, :, used] - plain.kv.pool[:, :, used]).abs().max().item() <= 1e-5
    assert torch.count_nonzero(graphed.kv.pool[:, :, :n]) == torch.count_nonzero(plain.kv.pool)  # nothing else
    assert torch.count_nonzero(graphed.kv.pool[:, :, n]) > 0  # the pad rows wrote there


def test_steps_no_graph_holds_run_eagerly():
    plain, graphed = runners(max_batch=2)
    outs, _ = run_both(plain, graphed, [20, 11, 6])  # 3 rows: above the largest bucket (2)
    assert graphed.graphs.num_replays == 0
    for a, b in zip(outs["plain"], outs["graphed"]):
        assert torch.equal(a, b)


def test_graphs_need_a_scratch_block():
    model = ours(LLAMA, hf_model(LLAMA))
    with pytest.raises(ValueError, match="scratch"):
        DecodeGraphs(model, KVCache(model.args, 8, 16, torch.float32, "cpu"), 4, 1024)


def test_enforce_eager_is_a_flag_of_every_engine_command():
    from aserve.commands import build_parser

    a = build_parser().parse_args(["replay", "traces/Mixed.jsonl", "--enforce-eager"])
    assert a.enforce_eager
    assert not build_parser().parse_args(["replay", "traces/Mixed.jsonl"]).enforce_eager
    assert build_parser().parse_args(["replay", "traces/Mixed.jsonl"]).fused_step  # where the model takes it
    assert not build_parser().parse_args(["serve", "--no-fused-step"]).fused_step


# --- on a card: captured graphs replayed against eager steps --------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [[5], [40, 17, 3], [70, 9, 33, 2, 18]], ids=["1", "3", "5"])
def test_replayed_graph_matches_the_eager_step_on_cuda(dtype, lengths):
    plain, graphed = runners(backend="sdpa", dtype=dtype, device="cuda", replay=True)
    assert graphed.graphs.report.num_graphs == len(graphed.graphs.buckets)
    outs, _ = run_both(plain, graphed, lengths)
    tol = 1e-4 if dtype is torch.float32 else 5e-2  # bf16: a padded batch may pick other kernels
    for a, b in zip(outs["plain"], outs["graphed"]):
        assert (a - b).abs().max().item() <= tol
    assert graphed.graphs.num_replays == 3


@pytest.mark.gpu
def test_pad_rows_touch_only_the_scratch_block_on_cuda():
    plain, graphed = runners(backend="sdpa", device="cuda", replay=True)
    _, tables = run_both(plain, graphed, [40, 17, 3])
    n = plain.kv.num_blocks
    used = sorted(b for t in tables for b in t)
    unused = sorted(set(range(n)) - set(used))
    assert (graphed.kv.pool[:, :, used] - plain.kv.pool[:, :, used]).abs().max().item() <= 1e-4
    assert torch.count_nonzero(graphed.kv.pool[:, :, unused]) == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_default_model_greedy_output_is_the_same_with_and_without_graphs():
    """fp32: a replayed step pads its batch and its context to the bucket, which in bf16 may pick
    other kernels and round differently; in fp32 a different rounding cannot flip a greedy token
    of 48, so any difference is the graphs' doing."""
    import dataclasses

    from aserve.config import EngineConfig
    from aserve.engine.bundle import ModelBundle
    from aserve.engine.offline import LLM
    from scheduling.request import SamplingParams

    cfg = EngineConfig(device="cuda", dtype="fp32", kv_cache_gb=0.5)
    bundle = ModelBundle.load(cfg)
    questions = ["What is the capital of France?", "Name three primary colors.", "Count from one to ten.",
                 "Write a haiku about the sea.", "Why is the sky blue?"]
    sp = SamplingParams(max_tokens=48, temperature=0)
    texts = {}
    for eager in (True, False):
        llm = LLM(dataclasses.replace(cfg, enforce_eager=eager), bundle=bundle)
        texts[eager] = [o.token_ids for o in llm.generate(questions, sp, chat=True)]
        if not eager:
            assert llm.device.runner.graphs.num_replays > 0
    assert texts[True] == texts[False]


def test_flash_refusal_names_the_flag_that_fixes_it():
    """flash-attn's paged kernel reads pages of a multiple of 256 tokens in fp16/bf16 only; the
    reason a pool is refused names what to pass (checked here without a GPU; test_gpu.py checks
    that pick_backend acts on it where flash-attn is installed)."""
    from model.attention import flash_refusal, pick_backend

    assert "--block-size 256" in flash_refusal(16, torch.bfloat16)
    assert "--dtype bf16" in flash_refusal(256, torch.float32)
    assert flash_refusal(512, torch.float16) is None and flash_refusal(None, None) is None
    assert pick_backend("auto", "cuda", block_size=16, dtype=torch.bfloat16) == "sdpa"  # no flash here, or not 16
