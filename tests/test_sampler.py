"""model/sampler.py against a reference written here: temperature, top-k and top-p draws follow
the distribution they should (chi-square over many draws on fixed logits), and seeds reproduce.

Every draw comes from a fixed seed, so a run is the same run each time (never flaky); the
chi-square bound is the 0.1% critical value, which a sampler that is right passes for nearly
every seed and one that is wrong (argmax only, temperature ignored, top-p on the untempered
distribution, a cut one token too early or late) fails by orders of magnitude.
"""
import math

import pytest
import torch
from scipy.stats import chi2

from model.sampler import SampleSpec, sample

LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -2.5])
NUM_DRAWS = 4000


def reference(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The distribution one row should be drawn from, in plain Python: softmax(logits / T), then
    the k most likely tokens, then the smallest most-likely set whose probability reaches top_p
    (the tokens before a token already reaching top_p drop it), renormalised each time."""
    scaled = [v / temperature for v in logits]
    top = max(scaled)
    probs = [math.exp(v - top) for v in scaled]
    probs = [p / sum(probs) for p in probs]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:top_k] if top_k else order)
    kept = sum(probs[i] for i in keep)
    probs = [p / kept if i in keep else 0.0 for i, p in enumerate(probs)]
    before, nucleus = 0.0, set()
    for i in order:
        if i in keep and (not nucleus or before < top_p):
            nucleus.add(i)
            before += probs[i]
    total = sum(probs[i] for i in nucleus)
    return [p / total if i in nucleus else 0.0 for i, p in enumerate(probs)]


def draw(spec: SampleSpec, n: int = NUM_DRAWS, seed: int = 1234) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return sample(LOGITS.repeat(n, 1), [spec] * n, gen)


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, float]:
    """(statistic, 0.1% critical value) over the tokens the reference can draw; a draw of a
    token it cannot draw is a failure on its own."""
    n = sum(counts)
    for c, p in zip(counts, probs):
        assert p > 0 or c == 0, f"drew a token of probability 0: counts {counts}, reference {probs}"
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)
    dof = sum(p > 0 for p in probs) - 1
    return stat, chi2.ppf(0.999, dof)


def counts_of(tokens: list[int]) -> list[int]:
    return [tokens.count(i) for i in range(len(LOGITS))]


CASES = [  # (temperature, top_k, top_p): tempered, cut by k, cut by p, both, sharpened and flattened
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.7, 5, 0.8),
    (0.5, 0, 0.8), (2.0, 0, 0.8),  # top-p cuts the tempered distribution: 2 and 5 tokens here, 4 at T = 1
]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_draws_follow_the_reference_distribution(temperature, top_k, top_p):
    probs = reference(LOGITS.tolist(), temperature, top_k, top_p)
    counts = counts_of(draw(SampleSpec(temperature=temperature, top_k=top_k, top_p=top_p)))
    stat, critical = chi_square(counts, probs)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: counts {counts}, reference " \
                            f"{[round(p * NUM_DRAWS) for p in probs]}"


def test_the_chi_square_check_tells_distributions_apart():
    """The check has power: draws at temperature 1 fail against temperature 0.7's reference, and
    top-p 0.7's draws against top-p 0.8's (one more token in the nucleus)."""
    counts = counts_of(draw(SampleSpec(temperature=1.0)))
    stat, critical = chi_square(counts, reference(LOGITS.tolist(), 0.7))
    assert stat > 10 * critical
    nucleus = reference(LOGITS.tolist(), 1.0, top_p=0.8)
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square(counts_of(draw(SampleSpec(temperature=1.0, top_p=0.8))), reference(LOGITS.tolist(), 1.0, top_p=0.7))
    assert sum(p > 0 for p in nucleus) == sum(p > 0 for p in reference(LOGITS.tolist(), 1.0, top_p=0.7)) + 1


def test_reference_cuts():
    """The reference's own cuts, by hand: top-k keeps k tokens, top-p the smallest set reaching p."""
    probs = reference(LOGITS.tolist(), 1.0)
    assert sum(p > 0 for p in reference(LOGITS.tolist(), 1.0, top_k=3)) == 3
    cum = [sum(probs[:i + 1]) for i in range(len(probs))]  # LOGITS are sorted: token i is the i-th likeliest
    size = next(i + 1 for i, c in enumerate(cum) if c >= 0.7)
    assert sum(p > 0 for p in reference(LOGITS.tolist(), 1.0, top_p=0.7)) == size
    assert abs(sum(reference(LOGITS.tolist(), 0.7, 5, 0.8)) - 1) < 1e-9


def test_greedy_and_degenerate_cuts_take_the_argmax():
    row = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    assert sample(row, [SampleSpec(temperature=0.0)]) == [1]
    gen = torch.Generator().manual_seed(0)
    for spec in (SampleSpec(temperature=1.0, top_k=1), SampleSpec(temperature=2.0, top_p=1e-6)):
        assert set(sample(row.repeat(200, 1), [spec] * 200, gen)) == {1}


def test_a_seeded_row_reproduces_whatever_shares_its_batch():
    spec = SampleSpec(temperature=1.0, seed=42, step=3)
    alone = sample(LOGITS[None], [spec])[0]
    others = [SampleSpec(temperature=0.9, seed=s, step=1) for s in range(5)] + [SampleSpec(temperature=1.2)]
    batch = torch.stack([LOGITS] * 7)
    for pos in range(7):
        specs = others[:pos] + [spec] + others[pos:]
        gen = torch.Generator().manual_seed(pos)  # the unseeded rows draw differently every time
        assert sample(batch, specs, gen)[pos] == alone


def test_seeded_steps_follow_the_distribution_and_seeds_differ():
    """A seeded request's steps are fresh draws (step i seeds (seed, i)), not one token repeated:
    over many steps they follow the reference; another seed gives another sequence."""
    steps = [SampleSpec(temperature=1.0, top_p=0.9, seed=7, step=i) for i in range(NUM_DRAWS)]
    tokens = sample(LOGITS.repeat(NUM_DRAWS, 1), steps)
    stat, critical = chi_square(counts_of(tokens), reference(LOGITS.tolist(), 1.0, top_p=0.9))
    assert stat < critical
    assert sample(LOGITS.repeat(NUM_DRAWS, 1), steps) == tokens
    other = sample(LOGITS.repeat(50, 1), [SampleSpec(temperature=1.0, top_p=0.9, seed=8, step=i) for i in range(50)])
    assert other != tokens[:50]


@pytest.mark.parametrize("scale,top_p,past_the_first_head", [(0.5, 0.9, True), (3.0, 0.95, True), (8.0, 0.5, False),
                                                            (0.01, 0.99, True)])
def test_the_nucleus_of_a_wide_vocabulary_is_the_full_sorts(scale, top_p, past_the_first_head):
    """Over 5,000 tokens the sampler sorts only the head it needs (64, then 4x more while the head
    holds less than top_p); the nucleus it keeps is the one a sort of the whole row gives, from a
    peaked row (a few tokens) to a flat one (thousands)."""
    from model.sampler import _nucleus
    gen = torch.Generator().manual_seed(5)
    probs = (torch.randn(5000, generator=gen) * scale).softmax(-1)
    top, order = _nucleus(probs, top_p)
    ranked, ids = probs.sort(descending=True)
    before = ranked.cumsum(-1) - ranked
    size = max(1, int((before < top_p).sum()))
    assert set(order.tolist()) == set(ids[:size].tolist())
    assert torch.equal(top, probs[order])
    assert (len(order) > 64) == past_the_first_head  # both ways through the head's growth are tried


def test_a_draw_never_takes_a_token_of_probability_zero():
    """The inverse-CDF draw scales its uniform to the row's own total: tokens of probability 0,
    between others or at the end of the vocabulary, are never drawn."""
    from model.sampler import _draw
    probs = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.7, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    drawn = {_draw(probs, gen) for _ in range(2000)}
    assert drawn == {1, 4}


def test_a_seeded_row_draws_what_multinomial_drew():
    """Seeded rows keep torch.multinomial's exponential race, so a seed gives the tokens it gave
    before unseeded rows moved to the faster running-sum draw."""
    from model.sampler import _mix
    row = torch.randn(49152, generator=torch.Generator().manual_seed(3)) * 3
    for step in range(20):
        spec = SampleSpec(temperature=0.8, seed=99, step=step)
        probs = (row / 0.8).softmax(-1)
        expected = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(_mix(99, step))).item())
        assert sample(row[None], [spec]) == [expected]
