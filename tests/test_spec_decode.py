"""Speculative decoding parts: the n-gram proposer (C against the Python rule), greedy verification (exactly
greedy's tokens), rejection sampling (exactly the target distribution: chi-square over many seeds) and the
gating rule (on when steps are memory-bound, off when compute-bound or drafts are rejected)."""
import random

import pytest
import torch

import engine.kernels.build as kbuild
from engine.sample.rejection import rejection_sample, verify_greedy
from engine.spec_decode import gating, ngram

needs_kernels = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")


def test_reference_rule():
    ctx = [1, 2, 3, 4, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the last 3 tokens (1 2 3) occur at 6 and 0; the most recent earlier one wins: 7 8 1 follow it
    assert ngram.propose_reference(ctx, 3, 2, 5) == [7, 8, 1]
    assert ngram.propose_reference(ctx, 10, 2, 5) == [7, 8, 1, 2, 3]          # up to the context's end
    assert ngram.propose_reference([5, 6, 7, 8], 3, 2, 5) == []               # no earlier occurrence
    assert ngram.propose_reference([4, 4], 2, 1, 5) == [4]                    # n = 1
    assert ngram.propose_reference([4], 2, 1, 5) == []
    # the longest n wins: "2 3" last occurs before 60, but "1 2 3" (longer) occurs before 50
    assert ngram.propose_reference([1, 2, 3, 50, 0, 2, 3, 60, 1, 2, 3], 1, 2, 5) == [50]
    assert ngram.propose_reference([1, 2, 3, 50, 0, 2, 3, 60, 1, 2, 3], 1, 2, 2) == [60]


@needs_kernels
def test_c_proposer_equals_reference():
    rng = random.Random(0)
    contexts = []
    for _ in range(400):
        vocab = rng.choice([3, 8, 50, 1000])
        base = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        if base and rng.random() < 0.7:                                     # copied spans, like summaries
            a = rng.randrange(len(base))
            base += base[a:a + rng.randrange(1, 12)]
        contexts.append(base)
    for k, lo, hi in [(1, 1, 1), (4, 2, 5), (8, 1, 3), (3, 4, 4)]:
        got = ngram.propose_batch(contexts, k, lo, hi)
        assert got == [ngram.propose_reference(c, k, lo, hi) for c in contexts]
    assert ngram.propose_batch([], 4) == [] and ngram.propose_batch([[1, 1]], 0) == [[]]


def test_verify_greedy_is_greedy():
    rng = random.Random(1)
    for _ in range(500):
        k = rng.randrange(0, 6)
        target = [rng.randrange(4) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.7 else rng.randrange(4) for t in target[:k]]
        out = verify_greedy(draft, target)
        n = next((i for i, (d, t) in enumerate(zip(draft, target)) if d != t), k)
        assert out == target[:n + 1]           # the target's own greedy tokens, never a rejected draft


def _chi2_pvalue(counts, probs):
    """Pearson's chi-square goodness of fit: P(X >= statistic) for X ~ chi2(categories - 1)."""
    n = sum(counts)
    keep = [i for i, p in enumerate(probs) if p > 0]
    stat = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in keep)
    df = len(keep) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def test_rejection_sampling_matches_target_distribution():
    """Over 20,000 seeds the first emitted token is distributed as p_0 (whatever the draft), and given that the
    draft was accepted the second is distributed as p_1: chi-square p-values well above 1e-4."""
    g = torch.Generator().manual_seed(0)
    V = 6
    probs = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)
    probs[1, 4] = 0.0                                                     # a token top-k / top-p removed
    probs[1] /= probs[1].sum()
    draft = [2, 4]                                                        # the second draft has p = 0
    first, second = [0] * V, [0] * V
    for seed in range(20_000):
        out = rejection_sample(draft, probs, torch.Generator().manual_seed(seed))
        first[out[0]] += 1
        if out[0] == draft[0]:
            assert len(out) == 2 and out[1] != 4                          # never a zero-probability token
            second[out[1]] += 1
    assert _chi2_pvalue(first, probs[0].tolist()) > 1e-4
    assert _chi2_pvalue(second, probs[1].tolist()) > 1e-4
    # the test can fail: the same counts against a slightly different distribution are rejected
    skewed = (probs[0] + torch.tensor([0.03, -0.03, 0, 0, 0, 0])).clamp_min(0)
    assert _chi2_pvalue(first, (skewed / skewed.sum()).tolist()) < 1e-4


def test_rejection_sampling_bonus_and_seeds():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    out = rejection_sample([1, 1], probs, torch.Generator().manual_seed(3))
    assert out[:2] == [1, 1] and out[2] in (0, 2) and len(out) == 3       # all accepted: a bonus token
    again = rejection_sample([1, 1], probs, torch.Generator().manual_seed(3))
    assert again == out                                                   # seeded: reproducible
    assert rejection_sample([], probs[2:], torch.Generator().manual_seed(0))[0] in (0, 2)


def test_gating():
    assert gating.expected_tokens(0.0, 4) == 1.0 and gating.expected_tokens(1.0, 4) == 5.0
    assert abs(gating.expected_tokens(0.5, 2) - 1.75) < 1e-12
    memory_bound = gating.StepCost(fixed_s=0.050, per_row_s=0.0002)      # weights dominate: rows nearly free
    compute_bound = gating.StepCost(fixed_s=0.002, per_row_s=0.003)      # cost grows with every row
    assert gating.choose_k(2, 0.7, memory_bound, 5) == 5
    assert gating.choose_k(48, 0.7, compute_bound, 5) == 0
    assert gating.choose_k(2, 0.02, memory_bound, 5) == 0                 # drafts rejected: off
    assert 0 < gating.choose_k(8, 0.4, memory_bound, 5) <= 5
    cost = gating.StepCost(0.0, 0.0)
    for rows, secs in [(4, 0.014), (8, 0.018), (16, 0.026), (32, 0.042)]:
        cost.observe(rows, secs)
    assert abs(cost.per_row_s - 0.001) < 1e-9 and abs(cost.fixed_s - 0.010) < 1e-9
    acc = gating.AcceptanceTracker(prior=0.5, weight=0.5)
    acc.update(4, 0)
    acc.update(4, 0)
    assert acc.rate == 0.125 and acc.proposed == 8 and acc.accepted == 0
