"""Sampling: per-request SamplingParams gathered into tensors once per step, then pure tensor functions.

Order (HF / vLLM): banned ids -> penalties -> greedy rows take the argmax; the other rows go through
temperature -> top-k / top-p -> min-p -> one draw from the softmax.

The draw is an exponential race: ``argmax(probs / q)`` with ``q ~ Exponential(1)``, which picks token ``i`` with
probability ``probs[i]``. A seeded request draws its row of ``q`` from its own ``torch.Generator`` (kept by the
engine for the request's life), so its tokens do not depend on which other rows share the batch or their order.
Rows without a seed share the engine's generator.

Usage (model runner)::

    md = SamplingMetadata.build(params, output_token_ids, prompt_token_ids, generators, device,
                                banned_token_ids=..., default_generator=engine_generator)
    next_tokens = Sampler()(logits, md)          # [B] int64
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_PAD_ID = -1  # padding in the ragged token-id tensors; mapped to an extra, discarded vocab column


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded with ``seed`` (the engine's shared one, or a seeded request's draw at
    one output position: engine.sample.seeded_draws)."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(int(seed))
    return generator


@dataclass
class SamplingMetadata:
    """One step's sampling settings as [B] tensors; a field is None when no row in the batch uses it.

    Invariants: row ``i`` of every tensor belongs to ``params[i]`` given to ``build``; greedy rows carry
    temperature 1.0 (never divided by zero) and ignore top-k / top-p / min-p.
    """
    num_rows: int
    all_greedy: bool
    greedy_rows: torch.Tensor | None          # [B] bool; None when all rows are greedy or none is
    temperature: torch.Tensor | None          # [B] float32; None when no random row has temperature != 1
    top_k: torch.Tensor | None                # [B] int64, 0 = off
    max_top_k: int                            # max k over rows; 0 when some row has top-k off
    top_p: torch.Tensor | None                # [B] float32
    min_p: torch.Tensor | None                # [B] float32
    # Penalties (None when no row uses them). Token ids are right-padded with _PAD_ID.
    repetition_penalty: torch.Tensor | None   # [B] float32
    presence_penalty: torch.Tensor | None     # [B] float32
    frequency_penalty: torch.Tensor | None    # [B] float32
    prompt_token_ids: torch.Tensor | None     # [B, max_prompt_len] int64; only rows with a repetition penalty
    output_token_ids: torch.Tensor | None     # [B, max_output_len] int64; only rows with any penalty
    # Banned ids (e.g. EOS / stop ids before min_tokens): flat (row, token) index pairs.
    banned_rows: torch.Tensor | None          # [N] int64
    banned_token_ids: torch.Tensor | None     # [N] int64
    # Random draws.
    seeded_rows: list[tuple[int, torch.Generator]]  # random rows with their own generator
    has_unseeded_random_rows: bool
    default_generator: torch.Generator | None  # for unseeded random rows; None -> torch's global RNG

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None and self.presence_penalty is None and self.frequency_penalty is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        *,
        banned_token_ids: Sequence[Iterable[int] | None] | None = None,
        default_generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's per-row settings into tensors on ``device`` (once per step).

        Args:
            params: one SamplingParams per row of the logits.
            output_token_ids / prompt_token_ids: each row's tokens so far; only read for rows with penalties.
            generators: each row's own generator (a seeded request), or None to use ``default_generator``.
            banned_token_ids: per row, ids that must not be sampled this step (min_tokens: EOS / stop ids), or None.
            default_generator: the engine's shared generator (seeded from EngineConfig.seed).
        """
        num_rows = len(params)
        assert len(output_token_ids) == len(prompt_token_ids) == len(generators) == num_rows
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        random_rows = [i for i in range(num_rows) if not greedy[i]]
        seeded_rows = [(i, generators[i]) for i in random_rows if generators[i] is not None]
        return cls(
            num_rows=num_rows,
            all_greedy=all(greedy),
            **_random_fields(params, greedy, random_rows, device),
            **_penalty_fields(params, prompt_token_ids, output_token_ids, device),
            **_banned_fields(banned_token_ids, num_rows, device),
            seeded_rows=seeded_rows,
            has_unseeded_random_rows=len(seeded_rows) < len(random_rows),
            default_generator=default_generator,
        )


def _row_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _random_fields(params: Sequence[SamplingParams], greedy: list[bool], random_rows: list[int],
                   device: torch.device) -> dict:
    """greedy_rows, temperature, top_k, max_top_k, top_p, min_p (all None / 0 when every row is greedy)."""
    fields = dict(greedy_rows=None, temperature=None, top_k=None, max_top_k=0, top_p=None, min_p=None)
    if all(greedy):
        return fields
    if any(greedy):
        fields["greedy_rows"] = _row_tensor(greedy, torch.bool, device)
    # NOTE: greedy rows get neutral values so the random path can run on the whole batch.
    temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
    if any(t != 1.0 for t in temps):
        fields["temperature"] = _row_tensor(temps, torch.float32, device)
    # NOTE: greedy rows get k = 1 (their argmax), so "every row has k > 0" can hold in mixed batches.
    ks = [1 if g else max(p.top_k, 0) for p, g in zip(params, greedy)]
    if any(ks[i] > 0 for i in random_rows):
        fields["top_k"] = _row_tensor(ks, torch.int64, device)
        fields["max_top_k"] = max(ks) if all(k > 0 for k in ks) else 0
    ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    if any(p < 1.0 for p in ps):
        fields["top_p"] = _row_tensor(ps, torch.float32, device)
    mps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    if any(mps):
        fields["min_p"] = _row_tensor(mps, torch.float32, device)
    return fields


def _penalty_fields(params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], device: torch.device) -> dict:
    """The three penalties and the padded token ids they read: prompts only for rows with a repetition penalty,
    outputs for rows with any penalty."""
    num_rows = len(params)
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    use_rep = [r != 1.0 for r in rep]
    use_any = [use_rep[i] or pres[i] != 0.0 or freq[i] != 0.0 for i in range(num_rows)]
    fields = dict(repetition_penalty=None, presence_penalty=None, frequency_penalty=None, prompt_token_ids=None,
                  output_token_ids=None)
    if any(use_rep):
        fields["repetition_penalty"] = _row_tensor(rep, torch.float32, device)
        fields["prompt_token_ids"] = _pad_rows([prompt_token_ids[i] if use_rep[i] else () for i in range(num_rows)],
                                               device)
    if any(pres):
        fields["presence_penalty"] = _row_tensor(pres, torch.float32, device)
    if any(freq):
        fields["frequency_penalty"] = _row_tensor(freq, torch.float32, device)
    if any(use_any):
        fields["output_token_ids"] = _pad_rows([output_token_ids[i] if use_any[i] else () for i in range(num_rows)],
                                               device)
    return fields


def _banned_fields(banned_token_ids: Sequence[Iterable[int] | None] | None, num_rows: int,
                   device: torch.device) -> dict:
    """banned_rows, banned_token_ids: the flat (row, token) pairs, or None when nothing is banned."""
    fields = dict(banned_rows=None, banned_token_ids=None)
    if banned_token_ids is None:
        return fields
    assert len(banned_token_ids) == num_rows
    pairs = [(i, int(t)) for i, ids in enumerate(banned_token_ids) for t in (ids or ())]
    if pairs:
        fields["banned_rows"] = _row_tensor([i for i, _ in pairs], torch.int64, device)
        fields["banned_token_ids"] = _row_tensor([t for _, t in pairs], torch.int64, device)
    return fields


def _pad_rows(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    padded = [list(r) + [_PAD_ID] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device)  # [B, width]


# ---------------------------------------------------------------------------------------------------------
# Pure tensor functions. Each returns new logits (the input is not modified).
# ---------------------------------------------------------------------------------------------------------

def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[j], token_ids[j]] = -inf`` for every j, in place; returns ``logits``."""
    logits[rows, token_ids] = float("-inf")
    return logits


def token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] right-padded ids -> [B, V] occurrence counts (padding ignored)."""
    ids = token_ids.masked_fill(token_ids < 0, vocab_size)              # pad -> extra column
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=dtype, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :vocab_size]                                         # [B, V]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition penalty (HF: over prompt + output, positive logits / p, negative * p), then
    presence and frequency penalties (OpenAI: over output tokens, ``- freq * count - presence * (count > 0)``)."""
    vocab_size = logits.shape[-1]
    output_counts = None
    if output_token_ids is not None:
        output_counts = token_counts(output_token_ids, vocab_size, logits.dtype)   # [B, V]
    if repetition_penalty is not None:
        seen = token_counts(prompt_token_ids, vocab_size, logits.dtype) > 0
        if output_counts is not None:
            seen |= output_counts > 0
        penalty = repetition_penalty.to(logits.dtype).unsqueeze(1)                  # [B, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty.to(logits.dtype).unsqueeze(1) * output_counts
    if presence_penalty is not None:
        logits = logits - presence_penalty.to(logits.dtype).unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int = 0
) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept; k = 0 -> off), then the smallest set
    whose probability reaches top_p (HF: drop tokens whose ascending cumulative prob is <= 1 - top_p).

    ``max_top_k`` > 0 promises every row has 0 < k <= max_top_k, enabling a torch.topk path when top_p is off.
    """
    vocab_size = logits.shape[-1]
    neg_inf = float("-inf")
    if top_p is None and top_k is not None and 0 < max_top_k < vocab_size:
        top_values = logits.topk(max_top_k, dim=-1).values                          # [B, max_k] descending
        kth = top_values.gather(1, (top_k - 1).unsqueeze(1))                        # [B, 1]
        return logits.masked_fill(logits < kth, neg_inf)

    sorted_logits, sorted_idx = logits.sort(dim=-1)                                 # ascending, [B, V]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))                # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)                   # [B, V]
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False                                                         # always keep the top token
        sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max_prob`` of their row."""
    probs = logits.softmax(dim=-1)                                                  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)              # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit (the first on ties, like argmax).

    NOTE: ``max(dim).indices`` is ~4x faster than ``argmax`` on CPU for bfloat16 [64, 262144] logits.
    """
    return logits.max(dim=-1).indices


def exponential_race(probs: torch.Tensor, seeded_rows: Iterable[tuple[int, torch.Generator | None]] = (),
                     default_generator: torch.Generator | None = None, *, draw_default: bool = True) -> torch.Tensor:
    """One draw per row of ``probs`` [B, V]: ``argmax(probs / q)`` with ``q ~ Exponential(1)``, which picks token
    ``i`` with probability ``probs[i]``. The one place a sample is drawn (plain sampling, constrained choice and
    speculation's verification), so the same q gives the same token in each.

    Args:
        seeded_rows: (row, generator) pairs: rows that draw their q from their own generator (None: torch's).
        default_generator: the other rows' q, drawn in one call (None: torch's global RNG).
        draw_default: False when no other row's draw is used (greedy rows only): their q is not drawn.
    """
    if draw_default:
        q = torch.empty_like(probs).exponential_(generator=default_generator)
    else:
        q = torch.ones_like(probs)                                                  # unused rows
    for row, generator in seeded_rows:
        q[row].exponential_(generator=generator)
    # NOTE: exponential_ can return exactly 0 in rare cases; clamp so a zero-probability token never wins.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


class Sampler:
    """``Sampler()(logits [B, V], metadata) -> [B] int64`` next token ids. Does not modify ``logits``."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (tuple(logits.shape), md.num_rows)
        if md.all_greedy and md.banned_rows is None and md.no_penalties:
            # NOTE: the max of the model-dtype logits is the max of their float32 copy: skip the copy.
            return greedy(logits)
        logits = self.processed_logits(logits, md)
        if md.all_greedy:
            return greedy(logits)

        sampled = self.sample(logits, md)
        if md.greedy_rows is None:
            return sampled
        return torch.where(md.greedy_rows, greedy(logits), sampled)

    @staticmethod
    def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """float32 logits with banned ids masked and penalties applied (what greedy and sampling both see)."""
        logits = logits.float()
        if md.banned_rows is not None:
            logits = mask_tokens(logits.clone(), md.banned_rows, md.banned_token_ids)
        if not md.no_penalties:
            logits = apply_penalties(logits, md.prompt_token_ids, md.output_token_ids,
                                     md.repetition_penalty, md.presence_penalty, md.frequency_penalty)
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature -> top-k / top-p -> min-p -> one draw per row (greedy rows are computed and discarded)."""
        return Sampler.draw(Sampler.probs(logits, md), md)

    @staticmethod
    def draw(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """One draw per row of ``probs``: seeded rows from their own generator, the rest from the default one."""
        return exponential_race(probs, md.seeded_rows, md.default_generator, draw_default=md.has_unseeded_random_rows)

    @staticmethod
    def probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distributions a draw is made from: temperature -> top-k / top-p -> min-p -> softmax (float32;
        ``processed_logits`` already applied). Speculation's rejection sampler verifies against these."""
        logits = logits.float()
        if md.temperature is not None:
            logits = logits / md.temperature.unsqueeze(1)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        return logits.softmax(dim=-1)
