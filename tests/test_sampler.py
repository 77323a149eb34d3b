"""Sampler: greedy, masks, penalties (vs hand values and HF), temperature statistics, per-request seeds, bans."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    mask_tokens,
)
from engine.sampling_params import SamplingParams

V = 8


def build(params, outputs=None, prompts=None, generators=None, device="cpu", **kwargs) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        device,
        **kwargs,
    )


def support(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_all_greedy_is_argmax_and_skips_work():
    logits = torch.randn(4, 50, generator=make_generator(0))
    md = build([SamplingParams(temperature=0.0)] * 4)
    assert md.all_greedy and md.no_penalties
    assert md.temperature is None and md.top_k is None and md.top_p is None and md.min_p is None
    before = logits.clone()
    assert torch.equal(Sampler()(logits, md), logits.argmax(-1))
    assert torch.equal(logits, before)                    # input not modified


def test_mixed_batch_greedy_rows_take_argmax():
    logits = torch.randn(6, 50, generator=make_generator(1))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=5) for i in range(6)]
    out = Sampler()(logits, build(params, default_generator=make_generator(2)))
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    assert out.dtype == torch.int64 and out.shape == (6,)


def test_top_k_support():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0, -1.0, 0.5]] * 3)
    top_k = torch.tensor([1, 3, 0])
    assert support(apply_top_k_top_p(logits, top_k, None)) == [{1}, {1, 3, 5}, set(range(V))]
    # The torch.topk fast path (every row has k > 0) gives the same support.
    top_k = torch.tensor([1, 3, 2])
    assert support(apply_top_k_top_p(logits, top_k, None, max_top_k=3)) == [{1}, {1, 3, 5}, {1, 3}]


def test_top_p_support():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125, 0.0, 0.0]) + 1e-12
    logits = probs.log().expand(4, V).clone()
    top_p = torch.tensor([0.4, 0.6, 0.8, 1.0])
    # cumulative from the top: 0.5, 0.75, 0.875, ... -> smallest set reaching p.
    assert support(apply_top_k_top_p(logits, None, top_p)) == [
        {0}, {0, 1}, {0, 1, 2}, set(range(V))]


def test_top_k_then_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    # After top-k=2 the renormalised probs are [0.73, 0.27]; top_p=0.5 keeps only the first.
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert support(out) == [{0}]
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.9]))
    assert support(out) == [{0, 1}]


def test_min_p_support():
    probs = torch.tensor([[0.4, 0.2, 0.15, 0.1, 0.09, 0.03, 0.02, 0.01]] * 3)
    out = apply_min_p(probs.log(), torch.tensor([0.45, 0.2, 0.0]))
    # thresholds: 0.45 * 0.4 = 0.18 keeps 0.4, 0.2; 0.2 * 0.4 = 0.08 keeps >= 0.08.
    assert support(out) == [{0, 1}, {0, 1, 2, 3, 4}, set(range(V))]


def test_sampled_tokens_stay_in_support():
    logits = torch.randn(3, 100, generator=make_generator(3))
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.3), SamplingParams(min_p=0.5, temperature=0.7)]
    md = build(params, default_generator=make_generator(4))
    allowed = [
        set(logits[0].topk(4).indices.tolist()),
        support(apply_top_k_top_p(logits[1:2], None, torch.tensor([0.3])))[0],
        support(apply_min_p(logits[2:3] / 0.7, torch.tensor([0.5])))[0],
    ]
    for _ in range(50):
        out = Sampler()(logits, md).tolist()
        assert all(out[i] in allowed[i] for i in range(3))


def test_repetition_penalty_hand_values_and_hf():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, -0.5]])
    prompt, output = [0, 1], [1, 5]
    out = apply_penalties(logits, torch.tensor([prompt]), torch.tensor([output]),
                          torch.tensor([2.0]), None, None)
    expected = torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5, 1.5, 0.0, -0.5]])
    assert torch.allclose(out, expected)

    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = RepetitionPenaltyLogitsProcessor(penalty=2.0)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(out, hf)


def test_presence_and_frequency_penalties_hand_values():
    logits = torch.zeros(1, V)
    output = [[3, 3, 3, 5]]
    prompt = [[6, 6]]                                     # prompt tokens are not penalised by these two
    md = build([SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)],
               outputs=output, prompts=prompt)
    assert md.repetition_penalty is None and md.prompt_token_ids is None
    out = apply_penalties(logits, md.prompt_token_ids, md.output_token_ids,
                          md.repetition_penalty, md.presence_penalty, md.frequency_penalty)
    expected = torch.zeros(1, V)
    expected[0, 3] = -(0.5 + 3 * 0.25)
    expected[0, 5] = -(0.5 + 1 * 0.25)
    assert torch.allclose(out, expected)


def test_penalties_only_on_rows_that_ask_and_change_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    md = build(params, outputs=[[0], [0]], prompts=[[], []])
    assert Sampler()(logits, md).tolist() == [1, 0]


def test_temperature_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    n = 4000
    for temperature in (0.5, 2.0):
        md = build([SamplingParams(temperature=temperature)] * n, default_generator=make_generator(123))
        counts = torch.bincount(Sampler()(logits.expand(n, 4), md), minlength=4).double()
        expected = (logits[0] / temperature).softmax(-1).double() * n
        # ~4.5 sigma of a binomial count: deterministic with the fixed seed, still catches wrong temperatures.
        sigma = (expected * (1 - expected / n)).sqrt()
        assert ((counts - expected).abs() <= 4.5 * sigma + 1).all(), (temperature, counts, expected)


def _seeded_row_tokens(order: list[int], steps: int = 20, device: str = "cpu") -> dict[int, list[int]]:
    """Sample `steps` tokens for a batch whose rows are `order` (row id 0 is seeded, others random)."""
    logits_by_row = {r: torch.randn(64, generator=make_generator(100 + r)) for r in range(5)}
    params = {0: SamplingParams(seed=42, temperature=0.9, top_p=0.9),
              1: SamplingParams(temperature=1.3), 2: SamplingParams(seed=7, top_k=10),
              3: SamplingParams(temperature=0.0), 4: SamplingParams(min_p=0.1)}
    generators = {r: make_generator(params[r].seed, device) if params[r].seed is not None else None for r in order}
    shared = make_generator(999, device)
    tokens: dict[int, list[int]] = {r: [] for r in order}
    for _ in range(steps):
        md = build([params[r] for r in order], generators=[generators[r] for r in order],
                   device=device, default_generator=shared)
        out = Sampler()(torch.stack([logits_by_row[r] for r in order]).to(device), md).tolist()
        for r, t in zip(order, out):
            tokens[r].append(t)
    return tokens


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
def test_seeded_rows_independent_of_batch_composition_and_order(device):
    alone = _seeded_row_tokens([0], device=device)
    batch = _seeded_row_tokens([0, 1, 2, 3, 4], device=device)
    shuffled = _seeded_row_tokens([3, 4, 2, 1, 0], device=device)
    assert alone[0] == batch[0] == shuffled[0]
    assert batch[2] == shuffled[2] == _seeded_row_tokens([2, 4], device=device)[2]
    assert len(set(alone[0])) > 1                         # it really is sampling


def test_banned_ids_never_sampled():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0                                   # the favourite is banned
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=2)]
    banned = [[2], [2, 3, 4], [2]]
    md = build(params, banned_token_ids=banned, default_generator=make_generator(5))
    for _ in range(200):
        out = Sampler()(logits, md).tolist()
        assert all(out[i] not in banned[i] for i in range(3))
    assert logits[0, 2] == 10.0                           # input untouched
    # None (or empty) means "nothing banned" for that row.
    md = build(params[:2], banned_token_ids=[None, []])
    assert md.banned_rows is None and Sampler()(logits[:2], md)[0].item() == 2


def test_mask_tokens_helper():
    logits = torch.zeros(2, V)
    mask_tokens(logits, torch.tensor([0, 1, 1]), torch.tensor([3, 0, 7]))
    assert support(logits) == [set(range(V)) - {3}, set(range(V)) - {0, 7}]


def test_make_generator_reproducible():
    a = torch.rand(5, generator=make_generator(11))
    b = torch.rand(5, generator=make_generator(11))
    assert torch.equal(a, b) and not math.isnan(a.sum().item())


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_values(top_k):
    md = build([SamplingParams(top_k=top_k)])
    assert md.top_k is None
