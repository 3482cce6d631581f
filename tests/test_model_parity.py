"""Our paged forward against transformers' models, dense recompute and itself in chunks."""
import pytest
import torch

from scheduling.step import SeqStep, StepPlan
from model import native
from tests.tiny import LLAMA, OPT, hf_model, make_runner, ours, prefill_logits

CONFIGS = {
    "llama-gqa-untied": LLAMA,
    "llama-mha-tied": {**LLAMA, "num_key_value_heads": 4, "tie_word_embeddings": True},
    "opt-prenorm": OPT,
    "opt-postnorm-proj": {**OPT, "do_layer_norm_before": False, "word_embed_proj_dim": 32},
}


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


NATIVE = pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="C++ kernels do not build"))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("backend", ["reference", "sdpa", NATIVE])
def test_logits_match_transformers(name, backend):
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    runner, blocks = make_runner(ours(cfg, hf, backend=backend))
    ids = torch.randint(0, cfg["vocab_size"], (45,), generator=torch.Generator().manual_seed(1)).tolist()
    block_ids = []
    got = prefill_logits(runner, blocks, ids, 512, block_ids)
    want = hf_logits(hf, ids)
    assert (got - want).abs().max().item() <= 1e-4
    blocks.free(block_ids)
    assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("name", ["llama-gqa-untied", "opt-prenorm"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 512])
def test_chunked_prefill_equals_single_pass(name, chunk):
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    runner, blocks = make_runner(ours(cfg, hf))
    ids = torch.randint(0, cfg["vocab_size"], (70,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = [], []
    single = prefill_logits(runner, blocks, ids, 512, a)
    chunked = prefill_logits(runner, blocks, ids, chunk, b)
    assert (single - chunked).abs().max().item() <= 1e-4
    blocks.free(a + b)
    assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("name", ["llama-gqa-untied", "opt-postnorm-proj"])
@pytest.mark.parametrize("backend", ["reference", NATIVE])
def test_paged_decode_equals_recompute(name, backend):
    """Decode 12 greedy tokens one by one through the paged cache; each step's logits equal a
    full recompute of the whole sequence, and transformers' own logits."""
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    runner, blocks = make_runner(ours(cfg, hf, backend=backend), block_size=4)
    ids = list(range(3, 23))
    block_ids = []
    logits = prefill_logits(runner, blocks, ids, 512, block_ids)[-1]
    for _ in range(12):
        nxt = int(logits.argmax())
        pos = len(ids)
        ids.append(nxt)
        blocks.grow(block_ids, len(ids))
        logits = runner.forward_logits(StepPlan((SeqStep("r", (nxt,), pos, tuple(block_ids)),)))[0]
        fresh = []
        recompute = prefill_logits(runner, blocks, ids, 512, fresh)[-1]
        blocks.free(fresh)
        assert (logits - recompute).abs().max().item() <= 1e-4
        assert (logits - hf_logits(hf, ids)[-1]).abs().max().item() <= 1e-4
    blocks.free(block_ids)
    assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("backend", ["reference", "sdpa", NATIVE])
def test_mixed_batch_equals_separate_steps(backend):
    """One forward holding two prompt chunks (one a continuation) and three decodes gives the
    same logits as running each request alone."""
    cfg = CONFIGS["llama-gqa-untied"]
    hf = hf_model(cfg)
    runner, blocks = make_runner(ours(cfg, hf, backend=backend), block_size=8)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 12, 5, 9, 21)]
    # alone: every token's logits
    alone = []
    for s in seqs:
        b = []
        alone.append(prefill_logits(runner, blocks, s, 512, b))
        blocks.free(b)
    # together: requests 0 and 1 have their first part cached; 2..4 have all but the last token
    tables, work, expect = [], [], []
    for i, s in enumerate(seqs):
        b = []
        cut = 17 if i == 0 else (0 if i == 1 else len(s) - 1)
        if cut:
            prefill_logits(runner, blocks, s[:cut], 512, b)
        blocks.grow(b, len(s))
        tables.append(b)
        work.append(SeqStep(f"r{i}", tuple(s[cut:]), cut, tuple(b)))
        expect.append(alone[i][cut:])
    got = runner.forward_logits(StepPlan(tuple(work)))
    # runner order: multi-token sequences first, then single-token decodes
    order = sorted(range(len(work)), key=lambda i: len(work[i].token_ids) == 1)
    want = torch.cat([expect[i] for i in order])
    assert (got - want).abs().max().item() <= 1e-4
    for b in tables:
        blocks.free(b)
    assert blocks.num_free == blocks.num_blocks


def test_padding_tokens_change_nothing():
    cfg = CONFIGS["llama-gqa-untied"]
    hf = hf_model(cfg)
    runner, blocks = make_runner(ours(cfg, hf))
    ids = list(range(5, 25))
    b = blocks.allocate(2)
    plain = runner.forward_logits(StepPlan((SeqStep("r", tuple(ids), 0, tuple(b)),)))
    padded = runner.forward_logits(StepPlan((SeqStep("r", tuple(ids), 0, tuple(b)),), num_pad_tokens=12))
    assert padded.shape[0] == len(ids) + 12
    assert (plain - padded[:len(ids)]).abs().max().item() <= 1e-5
    blocks.free(b)


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float32), ("native", torch.bfloat16)])
def test_tapped_features_are_a_truncated_models_output(backend, dtype):
    """``forward_tapped(tap_layer=k)`` gives, at the tapped rows, what the first k layers as a model
    of their own output (transformers' LlamaModel cut to k layers, final norm included): the ``lm``
    length predictor's features, read from the served prefill. fp32: to 1e-4; bf16 (the one-call
    C++ step, head size 32): within bf16 rounding of the fp32 figure."""
    from transformers import AutoConfig, AutoModel

    cfg = dict(LLAMA, hidden_size=128, num_hidden_layers=3)  # head size 32: the bf16 kernels' layouts
    hf = hf_model(cfg)
    model = ours(cfg, hf, dtype, backend)
    runner, blocks = make_runner(model)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 128, (21,), generator=g).tolist(), torch.randint(0, 128, (9,), generator=g).tolist()
    ta, tb = [], []
    blocks.grow(ta, len(a))
    blocks.grow(tb, len(b))
    step = StepPlan((SeqStep("a", tuple(a), 0, tuple(ta), tap=True), SeqStep("b", tuple(b), 0, tuple(tb), tap=True)),
                     tap_layer=2)
    feats = runner.execute(step).features
    conf = AutoConfig.for_model(**dict(cfg, num_hidden_layers=2))
    conf._attn_implementation = "eager"
    cut = AutoModel.from_config(conf).eval()
    cut.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()
                         if k.startswith("model.") and not k.startswith("model.layers.2.")})
    with torch.no_grad():
        for rid, ids in (("a", a), ("b", b)):
            want = cut(torch.tensor([ids])).last_hidden_state[0, -1]
            tol = 1e-4 if dtype is torch.float32 else 2 ** -6 * want.abs().max().item()
            assert (feats[rid] - want).abs().max().item() <= tol
