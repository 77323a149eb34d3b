"""Test helpers for batch invariance: run an engine over prompts and record, per request and output position, the
bits the token came from (the head's input row, and its logits row where the step computed logits).

``Recorder`` patches ``ModelRunner.execute`` and the head's two entries (``CausalLM.greedy_tokens``,
``CausalLM.compute_logits``); ``ModelRunner.last_sampled`` says which head rows belong to which request.
``assert_same_row`` compares a needle's run alone with its run among others, bit for bit.
"""
from __future__ import annotations

import random

import torch

from engine import LLM, SamplingParams
from engine.model_runner import ModelRunner
from engine.models.layers import CausalLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)


class Recorder:
    """``rows[request_id][position] = {"hidden": row, "logits": row | None}`` for every emitted token."""

    def __init__(self, monkeypatch):
        self.rows: dict[str, dict[int, dict]] = {}
        self._step: list[tuple[str, torch.Tensor]] = []
        execute, greedy, logits = ModelRunner.execute, CausalLM.greedy_tokens, CausalLM.compute_logits
        rec = self

        def greedy_tokens(model, hidden):
            rec._step.append(("hidden", hidden.detach().clone()))
            return greedy(model, hidden)

        def compute_logits(model, hidden):
            out = logits(model, hidden)
            rec._step += [("hidden", hidden.detach().clone()), ("logits", out.detach().float().clone())]
            return out

        def record_step(runner, out, requests):
            rec._step = []
            base = {rid: r.num_output_tokens for rid, r in requests.items()}
            result = execute(runner, out, requests)
            got = dict(rec._step)
            row = 0
            for rid, n in runner.last_sampled:
                emitted = result.get(rid)
                k = len(emitted) if isinstance(emitted, list) else 1
                for j in range(k):
                    cell = {name: t[row + j] for name, t in got.items()}
                    rec.rows.setdefault(rid, {}).setdefault(base[rid] + j, cell)
                row += n
            return result
        monkeypatch.setattr(ModelRunner, "execute", record_step)
        monkeypatch.setattr(CausalLM, "greedy_tokens", greedy_tokens)
        monkeypatch.setattr(CausalLM, "compute_logits", compute_logits)


def others(n: int, seed: int, vocab: int = 300, shared: list[int] | None = None) -> list[list[int]]:
    """``n`` random prompts (token ids), a third of them under ``shared`` (a common prefix)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))]
        out.append((shared or []) + body if shared and i % 3 == 0 else body)
    return out


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """The others' settings: greedy, seeded and unseeded sampling, penalties, in a seeded random mix."""
    rng = random.Random(seed)
    kinds = [GREEDY, seeded(rng.randrange(1 << 30)),
             SamplingParams(max_tokens=10, temperature=1.1, top_k=20, ignore_eos=True),
             SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)]
    return [rng.choice(kinds) for _ in range(n)]


def run(path: str, needles: list[list[int]], needle_params: list[SamplingParams], engine: dict,
        monkeypatch, crowd: list[list[int]] = (), crowd_params: list[SamplingParams] = (), seed: int = 0,
        repeat: int = 1, llm: LLM | None = None, last: bool = False):
    """Generate needles (at seeded random positions among ``crowd``); returns (llm, [(tokens, rows)] per needle,
    outputs of the last repeat). ``repeat`` > 1: the same batch again in the same engine (prefix-cache hits);
    ``last``: the needles after the crowd (the scheduler preempts the latest arrivals first)."""
    rec = Recorder(monkeypatch)
    llm = llm or LLM(path, **engine)
    prompts, params = list(crowd), list(crowd_params)
    rng = random.Random(seed)
    where = []
    for needle, p in zip(needles, needle_params):
        i = len(prompts) if last else rng.randrange(len(prompts) + 1)
        where = [w + (w >= i) for w in where] + [i]
        prompts.insert(i, needle)
        params.insert(i, p)
    for _ in range(repeat):
        rec.rows.clear()
        outs = llm.generate(prompts, params)
    found = [(outs[i].token_ids, rec.rows.get(outs[i].request_id, {})) for i in where]
    return llm, found, [outs[i] for i in where]


def assert_same_row(ref, got, what: str) -> None:
    """The needle's tokens, and at every output position the head's input row (and logits where both runs
    computed them), bit for bit."""
    (ref_tokens, ref_rows), (tokens, rows) = ref, got
    assert tokens == ref_tokens, f"{what}: tokens {tokens} != alone {ref_tokens}"
    assert sorted(rows) == sorted(ref_rows), f"{what}: positions {sorted(rows)} != {sorted(ref_rows)}"
    for pos, cell in ref_rows.items():
        for name in ("hidden", "logits"):
            if name in cell and name in rows[pos]:
                a, b = cell[name], rows[pos][name]
                assert torch.equal(a, b), (f"{what}: {name} at output position {pos} differs "
                                           f"(max |diff| {(a.float() - b.float()).abs().max().item():.3g})")
