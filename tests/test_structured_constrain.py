"""Check-first constrained choice, without a model: a kept draw or a masked redraw is exactly the distribution
restricted to the allowed tokens (top-k first, then the grammar; the grammar first when top-k keeps none); an int8
LM head gives a few tokens' logits bit for bit as the whole head does."""
import types

import pytest
import torch

import engine.kernels.library as library
from engine.quant.int8 import Int8Linear, quantize_rows
from engine.sample.constrain import constrain
from engine.sample.sampler import Sampler, SamplingMetadata, make_generator
from engine.sampling_params import SamplingParams

V = 12
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 0.8, -2.0, 1.2, 0.1])


class FakeGrammar:
    error = None

    def __init__(self, allowed: set[int]):
        self.mask = torch.zeros(V, dtype=torch.bool)
        self.mask[list(allowed)] = True
        self.num_built = 0

    def sync(self, output_token_ids):
        pass

    def allows(self, token):
        return bool(self.mask[token])

    def fill(self):
        self.num_built += 1

    def allowed(self, fill=True):
        if fill:
            self.fill()
        return self.mask.clone()


def _draw(params, allowed, n=6000, check_first=True):
    reqs = [types.SimpleNamespace(grammar=FakeGrammar(allowed), output_token_ids=[], prompt_token_ids=[1],
                                  request_id=str(i), sampling_params=params, error=None) for i in range(n)]
    gen = make_generator(0)

    def metadata(rs):
        return SamplingMetadata.build([r.sampling_params for r in rs], [[]] * len(rs), [[1]] * len(rs),
                                      [None] * len(rs), "cpu", default_generator=gen)
    logits = LOGITS.expand(n, V).clone()
    tokens = Sampler()(logits, metadata(reqs)).tolist()
    constrain(tokens, reqs, lambda rows: logits[rows], metadata, check_first)
    return torch.bincount(torch.tensor(tokens), minlength=V).float() / n, reqs


def _expected(probs, allowed):
    p = probs.clone()
    p[[i for i in range(V) if i not in allowed]] = 0
    return p / p.sum()


@pytest.mark.parametrize("check_first", [True, False])
def test_sampling_is_the_distribution_restricted_to_the_allowed_tokens(check_first):
    allowed = {1, 3, 4, 9}
    freq, reqs = _draw(SamplingParams(temperature=1.0), allowed, check_first=check_first)
    want = _expected(LOGITS.softmax(-1), allowed)
    assert (freq - want).abs().max() < 0.025, (freq, want)
    built = sum(r.grammar.num_built for r in reqs)
    assert built == len(reqs) if not check_first else 0 < built < len(reqs)   # masks only for rejected draws


def test_top_k_first_then_the_grammar():
    params = SamplingParams(temperature=1.0, top_k=4)               # keeps 0, 1, 10, 2
    freq, _ = _draw(params, {1, 2, 5, 6})
    top = torch.full((V,), float("-inf"))
    top[[0, 1, 10, 2]] = LOGITS[[0, 1, 10, 2]]
    want = _expected(top.softmax(-1), {1, 2})                       # 5 and 6 are outside the top 4
    assert (freq - want).abs().max() < 0.025, (freq, want)


def test_the_grammar_first_when_top_k_keeps_none():
    freq, _ = _draw(SamplingParams(temperature=1.0, top_k=2), {4, 5, 6, 9})     # the top 2 are 0 and 1
    masked = torch.full((V,), float("-inf"))
    masked[[4, 5]] = LOGITS[[4, 5]]                                 # top-2 among the allowed
    want = masked.softmax(-1)
    assert (freq - want).abs().max() < 0.025, (freq, want)


def test_greedy_takes_the_allowed_argmax():
    freq, reqs = _draw(SamplingParams(temperature=0.0), {3, 6, 9}, n=4)
    assert freq[3] == 1.0
    freq, reqs = _draw(SamplingParams(temperature=0.0), {0, 6}, n=4)
    assert freq[0] == 1.0 and sum(r.grammar.num_built for r in reqs) == 0       # the argmax fits: no mask


def test_a_grammar_that_allows_nothing_is_that_request_error():
    _, reqs = _draw(SamplingParams(temperature=0.0), set(), n=3)
    assert all("allows no token" in r.error for r in reqs)


@pytest.mark.skipif(library.load() is None, reason="the C int8 kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_head_outputs_at_some_ids_are_bit_identical(dtype):
    torch.manual_seed(0)
    q, s = quantize_rows(torch.randn(1000, 72))                     # rows not a multiple of 32; K padded
    head = Int8Linear.from_quantized(q, s, 72)
    x = (torch.randn(3, 72) * 2).to(dtype)
    full = head.linear(x)
    for ids in ([0], [5, 6, 31, 32, 999], list(range(0, 1000, 7)), [998, 999]):
        ids = torch.tensor(ids)
        assert torch.equal(head.linear_at(x, ids), full[:, ids])
