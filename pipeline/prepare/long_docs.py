"""``on_too_long: map_reduce``: a document longer than the context is summarized in parts, then the parts' summaries
are summarized (recursively, if even they do not fit). All of it lives here; the rest of the pipeline calls in:

    map      (``prepare`` -> ``LongDocs.add``) the document is cut at paragraph, then sentence boundaries into
             chunks that fit beside the job's head (system prompt + reference) and tail; each chunk is an
             ordinary request under the row's head, so every chunk reuses the cached prefix. Keys
             ``<row key>~c<i>/<n>``.
    reduce   (``Runner`` -> ``reduce_batches``) once every chunk of a row has a result, the summaries
             ("Part 1: ...") fill the job's ``prompt.reduce_template`` ({summaries}), which goes where the
             document goes in the template, under the same head. Summaries too long for one request are reduced
             in consecutive groups first (keys ``<row key>~r<level>.<i>/<m>``), level by level, until one request
             holds them all: its result is the row's (``LongDocs.finish``), with ``num_chunks`` and token counts
             summed over all of the row's requests.

Chunk and intermediate results are committed like rows (under their own keys), so a run killed in the middle of a
long row redoes none of its finished requests. Each level runs as one planned batch (``batch.Batch``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.job.rows import ResultRow, RowRequest
from pipeline.problems import RunError

if TYPE_CHECKING:
    from pipeline.job.job_prompts import JobPrompts
    from pipeline.job.prompts import PromptRenderer
    from pipeline.job.state import RunState
    from pipeline.job.templates import Template

_PARAGRAPH = re.compile(r"(?<=\n\n)")
_SENTENCE = re.compile(r"(?<=[.!?;:])\s+(?=\S)")


def split_text(text: str) -> list[str]:
    """Paragraphs, then sentences: pieces whose concatenation is ``text`` (whitespace kept with the piece before)."""
    pieces = []
    for para in _PARAGRAPH.split(text):
        start = 0
        for m in _SENTENCE.finditer(para):
            pieces.append(para[start:m.end()])
            start = m.end()
        if start < len(para):
            pieces.append(para[start:])
    return [p for p in pieces if p]


def pack(piece_ids: list[list[int]], room: int) -> list[list[int]]:
    """Consecutive pieces into chunks of at most ``room`` tokens; a piece longer than that is cut by tokens."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    for ids in piece_ids:
        while len(ids) > room:                      # a sentence longer than a whole chunk
            if cur:
                chunks.append(cur)
                cur = []
            chunks.append(list(ids[:room]))
            ids = ids[room:]
        if len(cur) + len(ids) > room and cur:
            chunks.append(cur)
            cur = []
        cur = cur + list(ids)
    if cur:
        chunks.append(cur)
    return chunks


def chunk_key(row_key: str, i: int, n: int) -> str:
    return f"{row_key}~c{i}/{n}"


def reduce_key(row_key: str, level: int, i: int, m: int) -> str:
    return f"{row_key}~r{level}.{i}/{m}"


def parts_text(summaries: list[str], first: int = 1) -> str:
    return "\n\n".join(f"Part {first + k}: {s}" for k, s in enumerate(summaries))


@dataclass
class LongRow:
    """One row being summarized in parts: what its reduce requests need, and its running totals."""
    key: str
    group: int                    # the row's head (planner group)
    tail: int                     # the row's tail id (JobPrompts.tails)
    params: int                   # the row's params id (JobPrompts.param_sets)
    num_chunks: int
    keys: list[str] = field(default_factory=list)       # the current level's request keys, in order
    requests: dict = field(default_factory=dict)       # key -> doc ids of this level's reduce requests
    head_len: int = 0
    tail_len: int = 0
    level: int = 0                # 0: chunks; 1, 2, ...: reduce levels
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def chunks_of(renderer: PromptRenderer, document: str, room: int) -> list[list[int]]:
    """A too-long document's chunks (token ids), each at most ``room`` tokens."""
    return pack(renderer.document_ids(split_text(document)), room)


class LongDocs:
    """One job's long rows while it runs: their parts (``add``), their results (``finish``) and the requests of
    their next reduce level (``next_requests``)."""

    def __init__(self, prompts: JobPrompts, reduce_template: Template):
        self.prompts = prompts
        self.template = reduce_template
        self.rows: dict[str, LongRow] = {}          # row key -> its LongRow, until its final result

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, key: str, chunks: list[list[int]], group: int, tail: int, params: int, head_len: int,
            tail_len: int) -> list[tuple[str, list[int]]]:
        """A long row (``prepare``): its chunk requests as (chunk key, document ids)."""
        ckeys = [chunk_key(key, c, len(chunks)) for c in range(len(chunks))]
        self.rows[key] = LongRow(key, group, tail, params, len(chunks), keys=ckeys, head_len=head_len,
                                 tail_len=tail_len)
        return list(zip(ckeys, chunks))

    def finish(self, row: ResultRow) -> str | None:
        """A finished request's result: ``"row"`` when it was a long row's final reduce (``row`` then gets the
        row's totals and ``num_chunks``), ``"part"`` for a chunk or an intermediate reduce (committed, not a row),
        None when it is no long row's."""
        key = row.row_key
        lr = self.rows.pop(key, None)
        if lr is not None:
            row.prompt_tokens += lr.prompt_tokens
            row.cached_tokens += lr.cached_tokens
            row.output_tokens += lr.output_tokens
            row.num_chunks = lr.num_chunks
            return "row"
        base, sep, _ = key.rpartition("~")               # a row key ends in "#<hash>": its id may hold a "~"
        return "part" if sep and base in self.rows else None

    def next_requests(self, job: int, state: RunState) -> tuple[list[RowRequest], list[ResultRow]]:
        """The next level's requests of every long row whose current level is done, and the error rows of long
        rows whose level had an error (those rows are finished)."""
        if not self.rows:
            return [], []
        # NOTE: only this job's map_reduce results become Python objects, not every committed row.
        done_t = state.load_done()
        keys = done_t.column("row_key")
        mine = pc.or_(pc.match_substring(keys, "~"), pc.is_in(keys, value_set=pa.array(list(self.rows))))
        done = {r["row_key"]: ResultRow.from_dict(r) for r in done_t.filter(mine).to_pylist()}
        out: list[RowRequest] = []
        errors: list[ResultRow] = []
        r, template = self.prompts.renderer, self.template
        for lr in list(self.rows.values()):
            while True:
                got = [done.get(k) for k in lr.keys]
                if any(g is None for g in got):
                    missing = [k for k, g in zip(lr.keys, got) if g is None]
                    if lr.level == 0:
                        raise RunError(f"internal error: {len(missing)} parts of row {lr.key} have no result; "
                                       "run again to resume")
                    part = self.prompts.unconstrained_index(lr.params)     # the schema: final reduce only
                    out += [RowRequest(job, k, lr.group, lr.requests[k], lr.tail, lr.params if k == lr.key else part)
                            for k in missing]
                    break
                for g in got:
                    lr.prompt_tokens += g.prompt_tokens or 0
                    lr.cached_tokens += g.cached_tokens or 0
                    lr.output_tokens += g.output_tokens or 0
                bad = next((i for i, g in enumerate(got) if g.error), None)
                if bad is not None:
                    what = "part" if lr.level == 0 else f"reduce level {lr.level}, group"
                    del self.rows[lr.key]
                    errors.append(ResultRow.failed(
                        lr.key, f"{what} {bad + 1} of {len(got)}: {got[bad].error}", prompt_tokens=lr.prompt_tokens,
                        cached_tokens=lr.cached_tokens, output_tokens=lr.output_tokens, num_chunks=lr.num_chunks))
                    break
                summaries = [g.summary or "" for g in got]
                room = (self.prompts.max_model_len - self.prompts.param_sets[lr.params].max_tokens - lr.head_len
                        - lr.tail_len)
                whole = r.document_ids([template.fill({"summaries": parts_text(summaries)})])[0]
                lr.level += 1
                if len(whole) <= room or len(summaries) == 1:
                    lr.keys, lr.requests = [lr.key], {lr.key: whole[:room]}
                    continue
                groups = _group_summaries(r, template, summaries, room)
                lr.keys, lr.requests, first = [], {}, 1
                for i, grp in enumerate(groups):
                    k = reduce_key(lr.key, lr.level, i, len(groups))
                    ids = r.document_ids([template.fill({"summaries": parts_text(grp, first)})])[0]
                    lr.keys.append(k)
                    lr.requests[k] = ids[:room]
                    first += len(grp)
        return out, errors


def _group_summaries(r: PromptRenderer, template: Template, summaries: list[str], room: int) -> list[list[str]]:
    """Consecutive summaries in groups whose reduce prompt fits ``room`` tokens (at least two per group, so each
    level shrinks; a group that still does not fit is cut to ``room`` by the caller)."""
    overhead = len(r.document_ids([template.fill({"summaries": ""})])[0])
    sizes = [len(ids) + 4 for ids in r.document_ids([f"Part 00: {s}\n\n" for s in summaries])]
    groups: list[list[str]] = [[]]
    used = overhead
    for s, n in zip(summaries, sizes):
        if groups[-1] and used + n > room and len(groups[-1]) >= 2:
            groups.append([])
            used = overhead
        groups[-1].append(s)
        used += n
    if len(groups) > 1 and len(groups[-1]) == 1:       # no group of one: it would not shrink
        groups[-2] += groups.pop()
    return groups


__all__ = ["split_text", "pack", "chunk_key", "reduce_key", "parts_text", "chunks_of", "LongRow", "LongDocs"]
