"""The engine's speculation policy: which decoding requests get n-gram drafts this step, and how many, under
``engine.config.SpecConfig`` (``EngineConfig.speculative_config`` parsed).

A request speculates when it decodes (one token left to compute) and has room: drafts never go past
``max_tokens`` or ``max_model_len``. Penalties and min_tokens bans apply at every draft position as if the
earlier drafts had been sampled (engine.model_runner). Drafts count against the step's token budget like any
token.
"""
from __future__ import annotations

import engine.spec_decode.gating as gating
import engine.spec_decode.ngram as ngram
from engine.config import SpecConfig


def eligible(req, max_model_len: int) -> bool:
    """Room for at least one draft before max_tokens and max_model_len."""
    return req.sampling_params.max_tokens - req.num_output_tokens > 1 and req.num_tokens + 1 < max_model_len


class Speculator:
    def __init__(self, config: SpecConfig, max_model_len: int, cost: gating.StepCost):
        self.config, self.max_model_len, self.cost = config, max_model_len, cost
        self.acceptance = gating.AcceptanceTracker(prior=0.5)
        # NOTE: while speculation is off, one-token "shadow" proposals (microseconds in C) are checked against
        # the tokens the model then samples, so the acceptance estimate stays current without spending compute.
        self._shadow: dict[str, int] = {}

    def drafts(self, decodes: list, budget: int) -> dict[str, list[int]]:
        """request id -> draft tokens for this step's decoding requests (most get none when it does not pay)."""
        cands = [r for r in decodes if eligible(r, self.max_model_len)]
        if not cands:
            return {}
        k_max = self.config.num_speculative_tokens
        k = k_max if self.config.gating == "always" else gating.choose_k(len(decodes), self.acceptance.rate,
                                                                         self.cost, k_max)
        # NOTE: drafts share the budget with the one token every decode needs.
        k = min(k, max(budget - len(decodes), 0) // len(cands))
        if k <= 0:
            props = ngram.propose_batch([r.all_token_ids for r in cands], 1, self.config.prompt_lookup_min,
                                        self.config.prompt_lookup_max)
            self._shadow = {r.request_id: d[0] for r, d in zip(cands, props) if d}
            return {}
        self._shadow = {}
        props = ngram.propose_batch([r.all_token_ids for r in cands], k, self.config.prompt_lookup_min,
                                    self.config.prompt_lookup_max)
        out = {}
        for r, d in zip(cands, props):
            room = min(r.sampling_params.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            d = d[:max(room, 0)]
            if d and r.grammar is not None:           # structured outputs: only what the grammar allows
                r.grammar.sync(r.output_token_ids)
                d = d[:r.grammar.valid_prefix(d)]
            if d:
                out[r.request_id] = d
        return out

    def record(self, proposed: int, accepted: int) -> None:
        self.acceptance.update(proposed, accepted)

    def observe(self, request_id: str, token: int) -> None:
        """The token a request sampled without speculating: was its shadow proposal right?"""
        guess = self._shadow.pop(request_id, None)
        if guess is not None:
            self.acceptance.update(1, int(guess == token))
