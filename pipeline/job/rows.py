"""The typed rows that cross the pipeline's seams.

    Copy        a row that takes an identical request's result (``prepare.dedup``)
    RowRequest  one prompt to compute (a spill-file row, a map_reduce part or reduce request): which job, its key,
                its head group, document ids, tail id and params id. ``plan.batch.Batch`` turns it into token ids.
    ResultRow   one committed result: a part file's row (``state.RunState.commit``) and the output's result
                columns (``RESULT_COLUMNS``, in this order). Made from a finished engine output or an error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pyarrow as pa

from engine import RequestOutput


@dataclass(frozen=True, slots=True)
class RowRequest:
    """One prompt to compute: ``heads[group] + doc_ids + tails[tail]`` under ``param_sets[params]`` of job ``job``."""
    job: int                      # index of its job among the model's (``Runner``'s ``runs``)
    key: str                      # the row key, or a map_reduce part's (``long_docs.chunk_key`` / ``reduce_key``)
    group: int                    # planner group: the shared head's index in ``heads``
    doc_ids: list[int]
    tail: int                     # tail id (``JobPrompts.tails``)
    params: int                   # params id (``JobPrompts.param_sets``; 0: the job's own)


@dataclass(frozen=True, slots=True)
class Copy:
    """A row that takes an identical request's result instead of being computed (``prepare.dedup``): its job, row
    key and params id."""
    job: int
    key: str
    params: int


@dataclass(slots=True)
class ResultRow:
    """One committed result; its fields are ``RESULT_COLUMNS`` (None: null)."""
    row_key: str
    summary: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    num_chunks: int | None = None      # on_too_long: map_reduce: the parts a long document was summarized in
    json_error: str | None = None      # structured outputs: why ``summary`` does not match its JSON schema

    @classmethod
    def from_output(cls, key: str, out: RequestOutput) -> ResultRow:
        """The result of a finished request."""
        m = out.metrics
        err = out.error if (out.error or out.finish_reason == "error") else None
        if out.finish_reason == "error" and not err:
            err = "the engine could not run this prompt"
        return cls(key, summary=None if err else out.text.strip(), finish_reason=out.finish_reason,
                   prompt_tokens=len(out.prompt_token_ids), cached_tokens=int(out.num_cached_tokens or 0),
                   output_tokens=len(out.token_ids), queue_s=m.queue_s, prefill_s=m.prefill_s, ttft_s=m.ttft_s,
                   tpot_s=m.tpot_s, e2e_s=m.e2e_s, error=err)

    @classmethod
    def failed(cls, key: str, message: str, **counts) -> ResultRow:
        """An error result (a bad row, a long row whose part failed): ``counts`` are token totals, num_chunks."""
        return cls(key, finish_reason="error", error=message, **counts)

    @classmethod
    def from_dict(cls, d: dict) -> ResultRow:
        """A row read back from the part files (``RunState.load_done().to_pylist()``)."""
        return cls(**{k: d.get(k) for k in RESULT_COLUMNS})


# The part files' schema, derived from ResultRow's fields (one definition of the result row).
_ARROW_TYPES = {"str": pa.string(), "int": pa.int64(), "float": pa.float64()}
RESULT_SCHEMA = pa.schema([(f.name, _ARROW_TYPES[f.type.split(" | ")[0]]) for f in dataclasses.fields(ResultRow)])
RESULT_COLUMNS = RESULT_SCHEMA.names
# a job dir's keys.arrow (``prepare`` writes it, ``assemble`` joins results onto it): row keys in input order
KEYS_SCHEMA = pa.schema([("row_idx", pa.int64()), ("row_key", pa.string())])


def results_table(rows: list[ResultRow]) -> pa.Table:
    """``rows`` as a table of ``RESULT_SCHEMA``."""
    return pa.Table.from_arrays([pa.array([getattr(r, f.name) for r in rows], type=f.type) for f in RESULT_SCHEMA],
                                schema=RESULT_SCHEMA)


def hit_rate(a: int, b: int) -> float | None:
    """a / b rounded for manifests; None when b is 0."""
    return round(a / b, 6) if b else None


__all__ = ["RESULT_SCHEMA", "RESULT_COLUMNS", "KEYS_SCHEMA", "Copy", "RowRequest", "ResultRow", "results_table",
           "hit_rate"]
