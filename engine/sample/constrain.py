"""Constrained choice, check first: the sampler chooses as if unconstrained; only a row whose choice the grammar
rejects gets its full vocabulary mask, and chooses again from the masked distribution.

Exact, not a heuristic. Greedy: the allowed argmax is the argmax whenever the argmax is allowed. Sampling: a draw
x ~ p kept when allowed, else redrawn from p restricted to the allowed set A, gives
``p(a) + (1 - p(A)) p(a) / p(A) = p(a) / p(A)``: exactly p restricted to A. Here p is the row's distribution after
temperature, top-k, top-p and min-p, which therefore act on the whole vocabulary first; the grammar then keeps the
allowed tokens among them. When they keep none of the allowed tokens (p(A) = 0), the filters act on the allowed
tokens instead (the mask first, as vLLM orders it).

On a CPU a 262k-wide mask costs about as much as the argmax over 48 rows; with check-first most steps build
none (docs/perf/zen5-epyc-structured.md).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from engine.sample.rejection import rejection_sample
from engine.sample.sampler import Sampler, SamplingMetadata, greedy

_NEG_INF = float("-inf")
# Up to this many allowed tokens, a greedy row's masked choice reads only their rows of an int8 LM head (about 8 ms
# for 16k tokens against ~35 ms for gemma's whole 262k-row head here).
SPARSE_MAX_TOKENS = 16384


def masked_choice(logits: torch.Tensor, allowed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[R, V] raw logits, [R, V] bool allowed tokens (each row allows at least one) -> [R] chosen tokens."""
    allowed = allowed.to(logits.device, non_blocking=True)          # masks are built on the CPU
    processed = Sampler.processed_logits(logits, md)                 # bans (min_tokens) and penalties
    # NOTE: torch.where, not masked_fill(~allowed): one pass instead of two over [R, 262k] (half the time here).
    masked = torch.where(allowed, processed, _NEG_INF)
    # NOTE: a ban (EOS before min_tokens) can remove the only allowed tokens: the grammar wins.
    empty = torch.isneginf(masked).all(dim=-1, keepdim=True)
    if empty.any():
        masked = torch.where(empty, torch.where(allowed, logits.float(), _NEG_INF), masked)
    if md.all_greedy:
        return greedy(masked)
    sampled = Sampler.draw(_allowed_probs(processed, allowed, masked, md), md)
    return sampled if md.greedy_rows is None else torch.where(md.greedy_rows, greedy(masked), sampled)


def _allowed_probs(processed: torch.Tensor, allowed: torch.Tensor, masked: torch.Tensor,
                   md: SamplingMetadata) -> torch.Tensor:
    """The rows' distributions with the filters (temperature, top-k/p, min-p) first, then the grammar's mask;
    where the filters kept no allowed token, the filters over the allowed tokens (``masked``) instead."""
    probs = Sampler.probs(processed, md) * allowed
    none = probs.sum(dim=-1, keepdim=True) <= 0
    return torch.where(none, Sampler.probs(masked, md), probs) if none.any() else probs


def constrain(tokens: list[int], reqs: Sequence, logits_of: Callable[[list[int]], torch.Tensor],
              metadata_of: Callable[[list], SamplingMetadata], check_first: bool = True,
              values_at: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None) -> None:
    """Replace, in place, each constrained row's token the grammar rejects by a choice from its masked
    distribution. ``logits_of(rows)``: those rows' raw logits (computed only now on a greedy step);
    ``metadata_of(reqs)``: their sampling metadata. A row whose grammar allows nothing gets an error.

    ``values_at(row, ids)``: on a plain greedy step, the logits of just those token ids, bit for bit as
    ``logits_of`` would give them, or None (engine.models.layers.CausalLM.logits_at: an int8 head). A row that
    allows few tokens then takes their argmax without the whole LM head's second read."""
    rows = []
    for i, r in enumerate(reqs):
        g = r.grammar
        if g is None or g.error:
            continue
        g.sync(r.output_token_ids)
        if not (check_first and g.allows(tokens[i])):
            rows.append(i)
    if not rows:
        return
    for i in rows:
        reqs[i].grammar.fill()
    if values_at is not None:
        rest = []
        for i in rows:
            ids = reqs[i].grammar.allowed_ids(SPARSE_MAX_TOKENS)
            values = values_at(i, ids) if ids is not None and len(ids) else None
            if values is None:
                rest.append(i)
            else:
                tokens[i] = int(ids[int(values.reshape(-1).argmax())])     # the first of equal maxima, as greedy
        rows = rest
    if not rows:
        return
    allowed = torch.stack([reqs[i].grammar.allowed(fill=False) for i in rows])
    ok = allowed.any(dim=-1).tolist()
    for i, has in zip(rows, ok):
        if not has:
            reqs[i].error = "structured output: the grammar allows no token here"
    rows = [i for i, has in zip(rows, ok) if has]
    if not rows:
        return
    allowed = allowed[[j for j, has in enumerate(ok) if has]]
    chosen = masked_choice(logits_of(rows), allowed, metadata_of([reqs[i] for i in rows])).tolist()
    for i, t in zip(rows, chosen):
        tokens[i] = t


def advance(reqs: Sequence, tokens: list[int | list[int]]) -> dict[str, list[int]]:
    """Each constrained request consumes its chosen token (a speculating one: its verified tokens); returns
    {request id: tokens the grammar forces next} (they enter the next step as one prefill
    chunk). A grammar error mid-way becomes that request's error."""
    forced = {}
    for r, t in zip(reqs, tokens):
        g = r.grammar
        if g is None or r.error:
            continue
        out = g.advance([t] if isinstance(t, int) else list(t))
        if g.error:
            r.error = f"structured output: {g.error}"
        elif out:
            forced[r.request_id] = out
    return forced


def verify(req, draft: list[int], logits: torch.Tensor, md: SamplingMetadata,
           row_metadata: Callable[[int], SamplingMetadata],
           generator: torch.Generator | list[torch.Generator] | None,
           check_first: bool = True) -> list[int]:
    """A constrained request's drafts (already trimmed to what the grammar allows) against its k + 1 rows of
    raw logits: greedy accepts while each draft is the allowed argmax; sampling runs rejection sampling over the
    masked distributions (every position's mask: speculation with sampling is rare here). ``md``: the k + 1
    rows' metadata, ``row_metadata(j)``: row j's alone. The matcher is left
    where it was; the emitted tokens are consumed afterwards like any sampled token. ``generator``: the draws
(a seeded request's: one per position, engine.sample.seeded_draws)."""
    g = req.grammar
    g.sync(req.output_token_ids)
    out: list[int] = []
    consumed = 0
    try:
        if req.sampling_params.greedy:
            first = greedy(Sampler.processed_logits(logits, md)).tolist()
            for j in range(len(draft) + 1):
                t = first[j]
                if not (check_first and g.allows(t)):
                    t = int(masked_choice(logits[j:j + 1], g.allowed().unsqueeze(0), row_metadata(j)))
                out.append(t)
                if j == len(draft) or t != draft[j]:
                    return out
                g.matcher.consume([t])
                consumed += 1
        allowed = []
        for j in range(len(draft) + 1):
            allowed.append(g.allowed())
            if j < len(draft):
                g.matcher.consume([draft[j]])
                consumed += 1
        allowed = torch.stack(allowed).to(logits.device)
        processed = Sampler.processed_logits(logits, md)
        probs = _allowed_probs(processed, allowed, torch.where(allowed, processed, _NEG_INF), md)
        return rejection_sample(draft, probs / probs.sum(dim=-1, keepdim=True), generator)
    finally:
        g.matcher.rollback(consumed)
