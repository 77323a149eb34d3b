"""``on_too_long: map_reduce``: a document longer than the context is summarized in parts, then the parts' summaries
are summarized (recursively, if even they do not fit).

    map      the document is cut at paragraph, then sentence boundaries into chunks that fit beside the job's
             head (system prompt + reference) and tail; each chunk is an ordinary request under the row's head,
             so every chunk reuses the cached prefix. Keys ``<row key>~c<i>/<n>``.
    reduce   once every chunk of a row has a result, the summaries ("Part 1: ...") fill the job's
             ``prompt.reduce_template`` ({summaries}), which goes where the document goes in the template, under
             the same head. Summaries too long for one request are reduced in consecutive groups first (keys
             ``<row key>~r<level>.<i>/<m>``), level by level, until one request holds them all: its result is
             the row's, with ``num_chunks`` and token counts summed over all of the row's requests.

Chunk and intermediate results are committed like rows (under their own keys), so a run killed in the middle of a
long row redoes none of its finished requests. Each level runs as one planned batch (``Runner._execute``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    tail: int                     # the row's tail id (JobRun.tails)
    params: int                   # the row's params id (JobRun.param_sets)
    num_chunks: int
    keys: list[str] = field(default_factory=list)       # the current level's request keys, in order
    requests: dict = field(default_factory=dict)       # key -> doc ids of this level's reduce requests
    head_len: int = 0
    tail_len: int = 0
    level: int = 0                # 0: chunks; 1, 2, ...: reduce levels
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


__all__ = ["split_text", "pack", "chunk_key", "reduce_key", "parts_text", "LongRow"]
