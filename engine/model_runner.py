"""ModelRunner: SchedulerOutput (plain lists) -> tensors -> forward -> logits at sampled rows -> tokens.

It owns the paged KV cache (one K and one V tensor per layer, [num_blocks, block_size, num_kv_heads,
head_dim]) and binds it to the attention layers. Logits are computed only for the rows that sample: the last
scheduled token of a sequence that reaches its last known token. With a 262k vocabulary the LM head would
otherwise be most of the step.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

import engine.quant.int8_kv as int8_kv
import engine.sample.constrain as constrain
from engine.attention.metadata import AttentionMetadata
from engine.request import Request
from engine.sample.rejection import rejection_sample, verify_greedy
from engine.sample.sampler import Sampler, SamplingMetadata, greedy, make_generator
from engine.sample.seeded_draws import position_generator
from engine.scheduler_output import ScheduledRequest, SchedulerOutput


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. On the CPU it is an anonymous memory map: the kernel hands out zero pages on
    first touch, so a 4 GiB pool costs nothing until its blocks are used (torch.zeros would write every page
    at start-up: ~5 s here) and a cron run over ten rows touches only the blocks it fills."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, backend, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        if dtype == torch.int8:                   # kv_cache_dtype: int8 (engine.quant.int8_kv)
            shape = int8_kv.pool_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(zeroed_pool(shape, dtype, device), zeroed_pool(shape, dtype, device))
                          for _ in range(cfg.num_hidden_layers)]
        bind_kv_caches(model, self.kv_caches, backend)
        self.sampler = Sampler()
        self.last_sampled: list[tuple[str, int]] = []     # (request id, head rows) of the last step
        self.default_generator = make_generator(seed, device)      # unseeded requests: one engine stream
        # Structured outputs: test each constrained row's unconstrained choice before building its mask (False:
        # always mask; the tests compare the two). ``forced``: the last step's grammar-forced tokens per request.
        self.check_first = True
        self.forced: dict[str, list[int]] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def release(self, request_id: str) -> None:
        """A request finished (nothing is kept per request: a seeded one's draws are made per position)."""

    def _generator(self, req: Request, ahead: int = 0):
        """A seeded request's draw for its next output token (``ahead``: drafts before it), or None."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        return position_generator(seed, req.num_output_tokens + ahead, self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> dict[str, int]:
        """Run one step. Returns {request_id: sampled token} for the sequences that sample; a request that
        speculated gets the list of its verified tokens (accepted drafts, then one more)."""
        if not out.scheduled:
            return {}
        inputs = StepInputs.prepare(out, requests, self.block_size)
        sample = SampledRows.prepare(out, requests, inputs)
        meta = self._attention_metadata(inputs, sample)
        # what this step samples, in the order of the head's rows (tests pair rows with requests from it)
        self.last_sampled = [(r.request_id, len(sample.drafts.get(r.request_id, ())) + 1) for r in sample.reqs]
        dev = self.device
        hidden = self.model(torch.tensor(inputs.input_ids, device=dev), torch.tensor(inputs.positions, device=dev),
                            meta)
        self.forced = {}
        if not sample.rows:
            return {}
        result = self._tokens(hidden, sample.reqs, sample.drafts)
        if any(r.grammar is not None for r in sample.reqs):
            self.forced = constrain.advance(sample.reqs, [result[r.request_id] for r in sample.reqs])
        return result

    def _attention_metadata(self, inputs: StepInputs, sample: SampledRows) -> AttentionMetadata:
        """The step's attention metadata, with the sampled rows again as one-query sequences (``sample_meta``:
        the last layer computes only these); both prepared by the backend."""
        max_blocks = max(len(t) for t in inputs.entry_tables)
        tables = torch.zeros((len(inputs.entry_tables), max_blocks), dtype=torch.int32)
        for i, t in enumerate(inputs.entry_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev, bs, seq_lens = self.device, self.block_size, inputs.seq_lens
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.long, device=dev),
            query_start_loc=inputs.query_start_loc, seq_lens=seq_lens, block_tables=tables.to(dev),
            num_decode_seqs=inputs.num_decode, block_size=bs, output_rows=inputs.num_decode)
        rows_t = torch.tensor(sample.rows, dtype=torch.long, device=dev)
        meta.sample_rows = rows_t
        meta.sample_meta = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows_t], query_start_loc=list(range(len(sample.rows) + 1)),
            seq_lens=[seq_lens[e] for e in sample.row_entry], block_tables=meta.block_tables[sample.row_entry],
            num_decode_seqs=len(sample.rows), block_size=bs,
            output_rows=_output_rows([r < inputs.num_decode for r in sample.rows]))
        for m in (meta, meta.sample_meta):
            self.backend.prepare(m)
        return meta

    def _tokens(self, hidden: torch.Tensor, reqs: list[Request], drafts: dict[str, list[int]]) -> dict:
        """The sampled rows' hidden states -> {request id: token} (a speculating request: its verified tokens).
        A batch of greedy rows without penalties takes the argmax without logits or sampler, drafts or not
        (``_greedy_tokens``)."""
        grammar = any(r.grammar is not None for r in reqs)
        if all(_plain_greedy(r) for r in reqs) and not (drafts and grammar):
            tokens = self._greedy_tokens(hidden, reqs, drafts)
            if grammar:                                        # logits only for rows the grammar rejects
                constrain.constrain(tokens, reqs, lambda rows: self.model.compute_logits(hidden[rows]),
                                    self._metadata, self.check_first,
                                    values_at=lambda i, ids: self.model.logits_at(hidden[i:i + 1], ids))
            if not drafts:
                return {r.request_id: t for r, t in zip(reqs, tokens)}
            out, row = {}, 0
            for r in reqs:
                d = drafts.get(r.request_id, ())
                out[r.request_id] = verify_greedy(d, tokens[row:row + len(d) + 1]) if d else tokens[row]
                row += len(d) + 1
            return out
        logits = self.model.compute_logits(hidden)              # [N, vocab], sampled rows only
        if drafts:
            return self._verify(logits, reqs, drafts)
        tokens = self._sample(logits, reqs)
        return {r.request_id: t for r, t in zip(reqs, tokens)}

    def _greedy_tokens(self, hidden: torch.Tensor, reqs: list[Request], drafts: dict[str, list[int]]) -> list[int]:
        """Each sampled row's greedy token, in the head's row order (a speculating request: k + 1 rows, the j-th
        seeing j drafts). The head's argmax (``greedy_tokens``: an int8 head never writes the [N, vocab] logits);
        a row whose argmax is a token banned there (EOS or a stop id before min_tokens) is taken again from its
        logits with the bans applied, as the sampler would: the argmax of the allowed tokens."""
        tokens = self.model.greedy_tokens(hidden).tolist()
        row = 0
        for r in reqs:
            for j in range(len(drafts.get(r.request_id, ())) + 1):
                banned = _banned(r, j)
                if banned and tokens[row] in banned:
                    logits = self.model.compute_logits(hidden[row:row + 1]).float()
                    logits[0, banned] = -math.inf
                    tokens[row] = int(greedy(logits)[0])
                row += 1
        return tokens

    def _metadata(self, reqs: list[Request]) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[r.sampling_params for r in reqs], output_token_ids=[r.output_token_ids for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs], generators=[self._generator(r) for r in reqs],
            banned_token_ids=[_banned(r) for r in reqs], device=self.device,
            default_generator=self.default_generator)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        tokens = self.sampler(logits, self._metadata(reqs)).tolist()
        if any(r.grammar is not None for r in reqs):
            constrain.constrain(tokens, reqs, lambda rows: logits[rows], self._metadata, self.check_first)
        return tokens

    def _verify(self, logits: torch.Tensor, reqs: list[Request], drafts: dict[str, list[int]]) -> dict:
        """A step with speculating requests: plain rows sample as usual; a speculating request's k + 1 rows
        verify its drafts (engine.sample.rejection) and give it a list of tokens."""
        out: dict[str, int | list[int]] = {}
        plain_rows, plain_reqs, row = [], [], 0
        spans = []
        for r in reqs:
            nd = len(drafts.get(r.request_id, ()))
            if nd:
                spans.append((r, row, nd))
            else:
                plain_rows.append(row)
                plain_reqs.append(r)
            row += nd + 1
        if plain_reqs:
            toks = self._sample(logits[plain_rows], plain_reqs)
            out.update({r.request_id: t for r, t in zip(plain_reqs, toks)})
        for r, start, nd in spans:
            rows, d = logits[start:start + nd + 1], drafts[r.request_id]
            p = r.sampling_params
            md = self._draft_metadata(r, d, range(nd + 1))
            # the request's draws at its next nd + 1 output positions (engine.sample.seeded_draws), as plain steps
            # make them
            gens = ([self._generator(r, j) for j in range(nd + 1)] if p.seed is not None
                    else self.default_generator)
            if r.grammar is not None and not r.grammar.error:
                out[r.request_id] = constrain.verify(r, d, rows, md, lambda j: self._draft_metadata(r, d, [j]),
                                                     gens, self.check_first)
                continue
            processed = Sampler.processed_logits(rows, md)
            if p.greedy:
                out[r.request_id] = verify_greedy(d, greedy(processed).tolist())
                continue
            out[r.request_id] = rejection_sample(d, Sampler.probs(processed, md), gens)
        return out

    def _draft_metadata(self, r: Request, d: list[int], positions) -> SamplingMetadata:
        """Position j sees the outputs so far plus the first j drafts: penalties and min_tokens bans as if those
        drafts had been sampled one step at a time."""
        js = list(positions)
        return SamplingMetadata.build(params=[r.sampling_params] * len(js),
                                      output_token_ids=[r.output_token_ids + d[:j] for j in js],
                                      prompt_token_ids=[r.prompt_token_ids] * len(js),
                                      generators=[None] * len(js), device=self.device,
                                      banned_token_ids=[_banned(r, j) for j in js])


class StepInputs:
    """One step's model inputs as plain lists (the model runner makes them tensors): token ids, positions and
    KV slots per row, and per attention entry (a prompt chunk, or one output position) its query start, sequence
    length and block table.

    One attention path per position, whatever the step: a prompt position is computed by the prefill kernel
    (chunk invariant: its rounding does not depend on where the prompt was cut), an output position by the
    decode kernel, one query per position (each sees the keys up to its own: every K/V of the step is written
    before attention). So a speculating request's last token and drafts, a plain decode and the outputs of a
    preempted request recomputed with its prompt all give their K/V the bits they had when first computed, and
    a prompt's one-token chunk (its last, after a prefix-cache hit or a token budget) stays a prefill. Tokens a
    grammar forced (structured outputs) are output positions too: one decode query each. Output positions go
    first: the backend batches one-query entries as one block of rows.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.query_start_loc = [0]
        self.seq_lens: list[int] = []
        self.entry_tables: list[list[int]] = []
        self.num_decode = 0                      # the first num_decode entries are one-query (output) positions
        # per sequence: (first token, tokens, first row, first entry, per position)
        self.where: dict[str, list] = {}

    @classmethod
    def prepare(cls, out: SchedulerOutput, requests: dict[str, Request], block_size: int) -> StepInputs:
        inputs = cls(block_size)
        for s, lo, n, per_position in _pieces(out, requests):
            inputs.add(s, lo, n, per_position)
        return inputs

    def add(self, s: ScheduledRequest, lo: int, n: int, per_position: bool) -> None:
        """Tokens ``lo`` .. ``lo + n - 1`` of ``s``: one entry per position (output positions), or one entry."""
        bs, qsl, seq_lens, entry_tables = self.block_size, self.query_start_loc, self.seq_lens, self.entry_tables
        self.where.setdefault(s.request_id, []).append((lo, n, len(self.input_ids), len(seq_lens), per_position))
        self.input_ids.extend(s.token_ids[lo:lo + n])
        pos = range(s.start_pos + lo, s.start_pos + lo + n)
        self.positions.extend(pos)
        table = s.block_ids
        self.slots.extend(table[p // bs] * bs + p % bs for p in pos)
        if per_position:
            for p in pos:
                qsl.append(qsl[-1] + 1)
                seq_lens.append(p + 1)
                entry_tables.append(table)
            self.num_decode = len(seq_lens)
        else:
            qsl.append(qsl[-1] + n)
            seq_lens.append(pos.stop)
            entry_tables.append(table)

    def locate(self, request_id: str, t: int) -> tuple[int, int]:
        """The row and the attention entry of the sequence's ``t``-th scheduled token."""
        lo, n, row, entry, per_position = next(w for w in self.where[request_id] if w[0] <= t < w[0] + w[1])
        return row + t - lo, entry + (t - lo if per_position else 0)


def _pieces(out: SchedulerOutput, requests: dict[str, Request]) -> list[tuple[ScheduledRequest, int, int, bool]]:
    """Each sequence cut where its prompt ends: (sequence, first token, tokens, per position), output positions
    (per position: decode entries) first."""
    pieces = []
    for s in out.scheduled:
        n, cut = len(s.token_ids), requests[s.request_id].num_prompt_tokens - s.start_pos
        cut = min(max(cut, 0), n)
        if cut < n:
            pieces.append((s, cut, n - cut, True))
        if cut:
            pieces.append((s, 0, cut, False))
    pieces.sort(key=lambda p: not p[3])
    return pieces


@dataclass
class SampledRows:
    """The rows the LM head computes: per sequence that samples, its last known token and every draft."""
    rows: list[int] = field(default_factory=list)          # rows of the step's input
    row_entry: list[int] = field(default_factory=list)     # per sampled row: its attention entry
    reqs: list[Request] = field(default_factory=list)      # the requests that sample, in row order
    drafts: dict[str, list[int]] = field(default_factory=dict)   # speculating requests: their draft tokens

    @classmethod
    def prepare(cls, out: SchedulerOutput, requests: dict[str, Request], inputs: StepInputs) -> SampledRows:
        sample = cls()
        for s in out.scheduled:
            if not s.sample:
                continue
            nd = len(s.draft_token_ids)          # logits at the last known token and at every draft
            for t in range(len(s.token_ids) - 1 - nd, len(s.token_ids)):
                row, entry = inputs.locate(s.request_id, t)
                sample.rows.append(row)
                sample.row_entry.append(entry)
            sample.reqs.append(requests[s.request_id])
            if nd:
                sample.drafts[s.request_id] = list(s.draft_token_ids)
        return sample


def _output_rows(is_output: list[bool]) -> int | torch.Tensor:
    """``AttentionMetadata.output_rows`` for rows flagged output position or not: a count when they lead."""
    n = sum(is_output)
    if all(is_output[:n]):
        return n
    return torch.tensor(is_output, dtype=torch.bool)


def bind_kv_caches(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend) -> None:
    """Give each attention layer its (K, V) cache and the attention backend."""
    for layer, cache in zip(model.model.layers, kv_caches):
        layer.self_attn.kv_cache = cache
        layer.self_attn.backend = backend


def _plain_greedy(req: Request) -> bool:
    """Greedy with no penalty changing the logits first (banned ids before min_tokens are ``_greedy_tokens``')."""
    p = req.sampling_params
    return p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0


def _banned(req: Request, ahead: int = 0) -> list[int] | None:
    """Before min_tokens, EOS and stop token ids may not be sampled (``ahead``: tokens drafted before this one);
    None when nothing is banned."""
    p = req.sampling_params
    if req.num_output_tokens + ahead >= p.min_tokens:
        return None
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))) or None
