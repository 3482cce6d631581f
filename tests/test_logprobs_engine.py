"""Log-probabilities from the runner against transformers' own log-softmax (tiny random models,
fp32), for sampled rows and for prompt rows scored in chunks (echo); none when no row asks."""
import pytest
import torch

from scheduling.request import Request, SamplingParams
from scheduling.step import GREEDY, SeqStep, StepPlan, seq_step
from tests.tiny import LLAMA, OPT, hf_model, make_runner, ours

TOL = 1e-4  # fp32 on both sides: the paged forward matches transformers' logits to 1e-4 (test_model_parity)
TOP = 3


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, vocab]


@pytest.mark.parametrize("cfg", [LLAMA, OPT], ids=["llama", "opt"])
@pytest.mark.parametrize("chunk", [5, 64])
def test_prompt_and_sampled_logprobs_match_transformers(cfg, chunk):
    hf = hf_model(cfg)
    runner, blocks = make_runner(ours(cfg, hf))
    ids = torch.randint(0, cfg["vocab_size"], (23,), generator=torch.Generator().manual_seed(3)).tolist()
    req = Request("r", ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, prompt_logprobs=TOP))
    prompt, sampled = {}, None
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        blocks.grow(req.block_ids, end)
        out = runner.execute(StepPlan((seq_step(req, start, end, sample=end == len(ids)),)))
        got = out.prompt_logprobs["r"]
        assert got.first_pos == start + 1
        prompt.update({got.first_pos + i: e for i, e in enumerate(got.entries)})
        sampled = out.logprobs["r"] if out.logprobs else None
    want = hf_logprobs(hf, ids)
    assert sorted(prompt) == list(range(1, len(ids)))  # every prompt token but the first, once
    for pos, e in prompt.items():
        row = want[pos - 1]
        assert e.token_id == ids[pos] and abs(e.logprob - row[ids[pos]].item()) <= TOL
        top = row.topk(TOP)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e.top, top.values.tolist())) <= TOL
    token = out.sampled["r"]
    assert sampled.token_id == token == int(want[-1].argmax())
    assert abs(sampled.logprob - want[-1, token].item()) <= TOL and len(sampled.top) == TOP
    blocks.free(req.block_ids)


def test_nothing_is_computed_when_no_row_asks():
    hf = hf_model(LLAMA)
    runner, blocks = make_runner(ours(LLAMA, hf))
    block_ids = []
    blocks.grow(block_ids, 8)
    out = runner.execute(StepPlan((SeqStep("r", tuple(range(3, 11)), 0, tuple(block_ids), GREEDY),)))
    assert out.logprobs is None and out.prompt_logprobs is None
    blocks.free(block_ids)


def test_logprobs_ignore_temperature():
    """vLLM's default: the model's raw log-probabilities, not the tempered distribution's."""
    hf = hf_model(LLAMA)
    runner, blocks = make_runner(ours(LLAMA, hf))
    ids = list(range(5, 17))
    req = Request("r", ids, SamplingParams(max_tokens=1, temperature=1.7, top_p=0.5, seed=1, logprobs=0))
    blocks.grow(req.block_ids, len(ids))
    out = runner.execute(StepPlan((seq_step(req, 0, len(ids), sample=True),)))
    token = out.sampled["r"]
    assert abs(out.logprobs["r"].logprob - hf_logprobs(hf, ids)[-1, token].item()) <= TOL
    assert out.logprobs["r"].top == ()
    blocks.free(req.block_ids)


def test_a_request_that_has_sampled_asks_no_prompt_rows_again():
    """A recompute after the first token (preemption, a re-run) must not score the prompt twice."""
    req = Request("r", [1, 2, 3, 4], SamplingParams(prompt_logprobs=0))
    assert seq_step(req, 0, 2, sample=False).prompt_targets == (2, 3)
    assert seq_step(req, 2, 4, sample=True).prompt_targets == (4,)
    req.output_token_ids.append(9)
    assert seq_step(req, 0, 5, sample=True).prompt_targets == ()
