"""Step 1 of a run: stream a job's input into row keys and a spill file of what is left to compute.

For every input row: render the prompt, compute its ``row_key`` (row id + prompt + model + parameters); a key
with a committed result is reused; a bad row becomes an error result at once; the rest are tokenized and go to
the spill file (head group, document ids, tail id) that the feeder reads back by row number. Nothing here
touches the engine beyond its tokenizer and ``EngineInfo``.

    keys.arrow    row_idx -> row_key, in input order (the assembly joins results onto it)
    spill.arrow   row_key, group, doc_ids, tail  for the rows to compute
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine import BatchgenError, EngineInfo
from pipeline.errors import RunError
from pipeline.io import iter_batches
from pipeline.job import Job
from pipeline.map_reduce import LongRow, chunk_key, pack, parts_text, reduce_key, split_text
from pipeline.prompts import PromptRenderer, RowError, RowKeyer, fingerprint, needed_columns, row_key
from pipeline.state import RunState

SPILL_SCHEMA = pa.schema([("row_key", pa.string()), ("group", pa.int64()), ("doc_ids", pa.list_(pa.int32())),
                          ("tail", pa.int64()), ("params", pa.int32())])
KEYS_SCHEMA = pa.schema([("row_idx", pa.int64()), ("row_key", pa.string())])


@dataclass
class JobRun:
    """One job's state while it runs."""
    job: Job
    renderer: PromptRenderer
    state: RunState
    fingerprint: str
    params: object
    num_rows: int = 0
    reused: int = 0
    changed: int = 0
    row_errors: int = 0
    computed: int = 0
    spill_rows: int = 0
    keys_digest: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    predicted_cached: int = 0
    planned_prompt_tokens: int = 0
    pending: list = field(default_factory=list)
    up_to_date: bool = False
    manifest: dict | None = None
    ids: set = field(default_factory=set)      # the current input's row ids
    deleted_kept: int = 0                      # rows no longer in the input, kept (output.keep_deleted_rows)
    deleted_dropped: int = 0                   # ... dropped from the output
    tails: dict = field(default_factory=dict)  # rendered prompt tail (token ids) -> its id in the spill file
    predicted_engine_s: float | None = None    # costmodel.predict, this job's requests as if run alone
    draft_tokens: int = 0                      # speculation: drafts proposed for this job's requests ...
    accepted_tokens: int = 0                   # ... and accepted
    spec_steps: int = 0                        # request-steps that verified drafts (mean accepted length)
    param_sets: list = field(default_factory=list)   # spill "params" -> SamplingParams (0: the job's own)
    long_rows: dict = field(default_factory=dict)    # row key -> map_reduce.LongRow (on_too_long: map_reduce)
    max_model_len: int = 0
    _param_index: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.param_sets = [self.params]
        self._param_index = {(): 0}

    def params_index(self, overrides: tuple) -> int:
        """The SamplingParams of a row whose request overrides the job's generation (OpenAI batch bodies)."""
        i = self._param_index.get(overrides)
        if i is None:
            from engine import SamplingParams
            try:
                p = SamplingParams(**{**self.job.generation, **dict(overrides)})
            except (BatchgenError, TypeError, ValueError) as e:
                raise RowError(f"body: {e}") from None
            i = self._param_index[overrides] = len(self.param_sets)
            self.param_sets.append(p)
        return i

    def take(self, key: str, out) -> dict:
        """A finished request: a row's result, a part of a long row's (map_reduce), or a long row's last."""
        lr = self.long_rows.get(key)
        if lr is not None:                                # the final reduce: the row's result, totals summed
            del self.long_rows[key]
            res = self.add_result(key, out)
            res["prompt_tokens"] += lr.prompt_tokens
            res["cached_tokens"] += lr.cached_tokens
            res["output_tokens"] += lr.output_tokens
            res["num_chunks"] = lr.num_chunks
            return res
        base, sep, _ = key.rpartition("~")               # a row key ends in "#<hash>": its id may hold a "~"
        if sep and base in self.long_rows:                # a chunk or an intermediate reduce: committed, not a row
            res = result_row(key, out)
            self.pending.append(res)
            self._count(res, out)
            return res
        return self.add_result(key, out)

    def next_reduce_requests(self, tails: dict) -> list[tuple[str, int, list[int], int, int]]:
        """The next level's requests of every long row whose current level is done: (key, group, doc ids, tail id,
        params id); rows whose level had an error get their error row here."""
        if not self.long_rows:
            return []
        # NOTE: only this job's map_reduce results become Python objects, not every committed row.
        done_t = self.state.load_done()
        keys = done_t.column("row_key")
        mine = pc.or_(pc.match_substring(keys, "~"), pc.is_in(keys, value_set=pa.array(list(self.long_rows))))
        done = {r["row_key"]: r for r in done_t.filter(mine).to_pylist()}
        out = []
        template, r = self.job.prompt.reduce_template, self.renderer
        for lr in list(self.long_rows.values()):
            while True:
                got = [done.get(k) for k in lr.keys]
                if any(g is None for g in got):
                    missing = [k for k, g in zip(lr.keys, got) if g is None]
                    if lr.level == 0:
                        raise RunError(f"internal error: {len(missing)} parts of row {lr.key} have no result; "
                                       "run again to resume")
                    out += [(k, lr.group, lr.requests[k], lr.tail, lr.params) for k in missing]
                    break
                for g in got:
                    lr.prompt_tokens += g["prompt_tokens"] or 0
                    lr.cached_tokens += g["cached_tokens"] or 0
                    lr.output_tokens += g["output_tokens"] or 0
                bad = next((i for i, g in enumerate(got) if g["error"]), None)
                if bad is not None:
                    what = "part" if lr.level == 0 else f"reduce level {lr.level}, group"
                    self._long_row_error(lr, f"{what} {bad + 1} of {len(got)}: {got[bad]['error']}")
                    break
                summaries = [g["summary"] or "" for g in got]
                room = self.max_model_len - self.param_sets[lr.params].max_tokens - lr.head_len - lr.tail_len
                whole = r.document_ids([template.format(summaries=parts_text(summaries))])[0]
                lr.level += 1
                if len(whole) <= room or len(summaries) == 1:
                    lr.keys, lr.requests = [lr.key], {lr.key: whole[:room]}
                    continue
                groups = _group_summaries(r, template, summaries, room)
                lr.keys, lr.requests, first = [], {}, 1
                for i, grp in enumerate(groups):
                    k = reduce_key(lr.key, lr.level, i, len(groups))
                    ids = r.document_ids([template.format(summaries=parts_text(grp, first))])[0]
                    lr.keys.append(k)
                    lr.requests[k] = ids[:room]
                    first += len(grp)
        return out

    def _long_row_error(self, lr, message: str) -> None:
        del self.long_rows[lr.key]
        self.pending.append({"row_key": lr.key, "error": message, "finish_reason": "error",
                             "prompt_tokens": lr.prompt_tokens, "cached_tokens": lr.cached_tokens,
                             "output_tokens": lr.output_tokens, "num_chunks": lr.num_chunks})
        self.computed += 1
        self.row_errors += 1

    def _count(self, res: dict, out) -> None:
        self.prompt_tokens += res["prompt_tokens"]
        self.cached_tokens += res["cached_tokens"]
        self.output_tokens += res["output_tokens"]
        self.draft_tokens += out.metrics.num_draft_tokens
        self.accepted_tokens += out.metrics.num_accepted_tokens
        self.spec_steps += out.metrics.num_spec_steps

    def add_result(self, key: str, out) -> dict:
        """Count a finished engine output (``RequestOutput``) and queue its result row for the next commit."""
        res = result_row(key, out)
        self.pending.append(res)
        self.row_errors += res["error"] is not None
        self.computed += 1
        self._count(res, out)
        return res




def _group_summaries(r: PromptRenderer, template: str, summaries: list[str], room: int) -> list[list[str]]:
    """Consecutive summaries in groups whose reduce prompt fits ``room`` tokens (at least two per group, so each
    level shrinks; a group that still does not fit is cut to ``room`` by the caller)."""
    overhead = len(r.document_ids([template.format(summaries="")])[0])
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


@dataclass(frozen=True)
class PreparedJob:
    """What the planner needs of a prepared job: per row to compute (spill order), its head group and length."""
    groups: list[int]
    prompt_lens: list[int]


def new_job_run(job: Job, state: RunState, tokenizer, info: EngineInfo) -> JobRun:
    params = job.sampling_params
    fp = fingerprint(info.identity, dataclasses.asdict(params), job.prompt.on_too_long, job.prompt.chat_template)
    return JobRun(job=job, renderer=PromptRenderer(job.prompt, tokenizer), state=state, fingerprint=fp,
                  params=params)


def prepare(jr: JobRun, info: EngineInfo, heads: list, head_index: dict, *, dry_run: bool, commit_rows: int,
            fail_fast: bool) -> PreparedJob:
    """Stream the job's input; write keys (+ spill of rows to compute). Rows already committed are reused, bad
    rows are committed as error rows at once. ``heads`` / ``head_index`` collect the distinct prompt heads of
    every job on the model (the planner's groups)."""
    job, r = jr.job, jr.renderer
    id_col = job.input.id_column
    cols = list(dict.fromkeys(([id_col] if id_col else []) + needed_columns(job.prompt)))
    done = jr.state.load_done() if jr.state.dir.exists() else None
    done_keys = set(done.column("row_key").to_pylist()) if done is not None else set()
    done_ids = {k.rpartition("#")[0] for k in done_keys}
    max_len = jr.max_model_len = info.max_model_len
    seen_ids: set[str] = set()
    seen_keys: set[str] = set()
    digest = hashlib.sha256()
    groups, lens = [], []
    keys_path, spill_path = jr.state.scratch("keys.arrow"), jr.state.scratch("spill.arrow")
    if dry_run:
        keys_w = spill_w = None
    else:
        jr.state.dir.mkdir(parents=True, exist_ok=True)
        keys_w = pa.ipc.new_file(str(keys_path), KEYS_SCHEMA)
        spill_w = pa.ipc.new_file(str(spill_path), SPILL_SCHEMA)
    keyer = RowKeyer(jr.fingerprint)          # = row_key(rid, rendered text, fingerprint)
    row_idx = 0
    gc_was_on = gc.isenabled()
    gc.disable()    # millions of small id lists: the cyclic collector's passes cost ~15% of a large plan

    def render_rows(rows: list[dict], row_idx: int) -> list:
        rendered: list = []
        for i, row in enumerate(rows):
            rid = str(row[id_col]) if id_col else str(row_idx + i)
            if id_col and row[id_col] is None:
                rid = f"<null id at row {row_idx + i}>"
            if rid in seen_ids and not job.input.allow_duplicate_ids:
                raise RunError(f"{job.file}: input.id_column {id_col!r}: id {rid!r} appears more than "
                               f"once (again at row {row_idx + i}); ids must be unique, or set "
                               "input.allow_duplicate_ids: true")
            seen_ids.add(rid)
            pidx = 0
            try:
                rr = r.render(row)
                if rr.params:
                    pidx = jr.params_index(rr.params)
                key = keyer.key(rid, rr.head, rr.document + rr.tail + (f"\0{rr.params!r}" if rr.params else ""))
            except RowError as e:
                rr, key = e, row_key(rid, "error:" + str(e) + repr(sorted(row.items(), key=str)),
                                     jr.fingerprint)
            rendered.append((rid, rr, key, pidx))
        return rendered

    def tokenize(docs: list[str]) -> list:
        # NOTE: a dry run needs only lengths: range(n) stands in for n ids (len and slicing behave alike)
        return [range(n) for n in r.document_lengths(docs)] if dry_run else r.document_ids(docs)

    def finish(rows: list[dict], row_idx: int, rendered: list, todo: list[int], tokenized) -> None:
        doc_ids = dict(zip(todo, tokenized.result()))
        keys, spill = [], {"row_key": [], "group": [], "doc_ids": [], "tail": [], "params": []}
        for k, (rid, rr, key, pidx) in enumerate(rendered):
            keys.append(key)
            digest.update(key.encode() + b"\n")
            if key in done_keys or key in seen_keys:
                jr.reused += key in done_keys
                continue
            seen_keys.add(key)
            if rid in done_ids:
                jr.changed += 1
            chunks = None
            if not isinstance(rr, RowError):
                head, tail = r.head_ids(rr.head), r.tail_ids(rr.tail)
                row_max = jr.param_sets[pidx].max_tokens
                try:
                    ids = r.fit(head, doc_ids[k], tail, max_len, row_max)
                except RowError as e:
                    room = max_len - row_max - len(head) - len(tail)
                    if job.prompt.on_too_long == "map_reduce" and room > 0:
                        chunks = pack(r.document_ids(split_text(rr.document)), room)
                    else:
                        rr = e
            if isinstance(rr, RowError):
                _row_error(jr, key, str(rr), row_idx + k, fail_fast)
                continue
            gid = head_index.setdefault("\0".join((rr.head, str(job.prompt.chat_template))), len(heads))
            if gid == len(heads):
                heads.append(head)
            tail_id = jr.tails.setdefault(tail, len(jr.tails))
            if chunks is not None:          # on_too_long: map_reduce (pipeline.map_reduce)
                ckeys = [chunk_key(key, c, len(chunks)) for c in range(len(chunks))]
                jr.long_rows[key] = LongRow(key, gid, tail_id, pidx, len(chunks), keys=ckeys,
                                            head_len=len(head), tail_len=len(tail))
                todo_chunks = [(ck, c) for ck, c in zip(ckeys, chunks) if ck not in done_keys]
            else:
                todo_chunks = [(key, ids)]
            for ck, c in todo_chunks:
                groups.append(gid)
                lens.append(len(head) + len(c) + len(tail))
                spill["row_key"].append(ck)
                spill["group"].append(gid)
                spill["doc_ids"].append(c)
                spill["tail"].append(tail_id)
                spill["params"].append(pidx)
        if keys_w is not None:
            keys_w.write_batch(pa.record_batch([pa.array(range(row_idx, row_idx + len(rows)), pa.int64()),
                                                pa.array(keys, pa.string())], schema=KEYS_SCHEMA))
            if spill["row_key"]:
                spill_w.write_batch(pa.record_batch(spill, schema=SPILL_SCHEMA))
        if not dry_run and len(jr.pending) >= commit_rows:
            jr.state.commit(jr.pending)
            jr.pending = []

    try:
        # Two stages, one batch apart: the next batch renders (Python) while this one's documents tokenize on
        # a worker thread (the Rust tokenizer and Arrow's kernels run without the GIL). Rendering a batch ahead
        # of the previous one's keys may tokenize a duplicate the second stage then skips: harmless.
        with ThreadPoolExecutor(1, thread_name_prefix="batchgen-tokenize") as pool:
            inflight = None
            for batch in iter_batches(job.input.path, job.input.format, cols, job.input.batch_size,
                                      job.input.split, job.input.limit):
                rows = batch.to_pylist()
                rendered = render_rows(rows, row_idx)
                todo = [k for k, (_, rr, key, _) in enumerate(rendered)
                        if not isinstance(rr, RowError) and key not in done_keys and key not in seen_keys]
                future = pool.submit(tokenize, [rendered[k][1].document for k in todo])
                if inflight is not None:
                    finish(*inflight)
                inflight = (rows, row_idx, rendered, todo, future)
                row_idx += len(rows)
            if inflight is not None:
                finish(*inflight)
    finally:
        if gc_was_on:
            gc.enable()
        if keys_w is not None:
            keys_w.close()
            spill_w.close()
    if not dry_run:
        jr.state.commit(jr.pending)
        jr.pending = []
    jr.num_rows = row_idx
    jr.ids = seen_ids
    jr.spill_rows = len(groups)
    jr.keys_digest = digest.hexdigest()
    return PreparedJob(groups, lens)


def result_row(key: str, out) -> dict:
    """The committed row of a finished request (``state.RESULT_COLUMNS``)."""
    m = out.metrics
    err = out.error if (out.error or out.finish_reason == "error") else None
    if out.finish_reason == "error" and not err:
        err = "the engine could not run this prompt"
    return {"row_key": key, "summary": None if err else out.text.strip(), "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": int(out.num_cached_tokens or 0),
            "output_tokens": len(out.token_ids), "queue_s": m.queue_s, "prefill_s": m.prefill_s,
            "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s, "error": err}


def _row_error(jr: JobRun, key: str, message: str, row_idx: int, fail_fast: bool) -> None:
    jr.row_errors += 1
    if fail_fast:
        raise RunError(f"job {jr.job.name!r}, row {row_idx} ({key.rpartition('#')[0]}): {message}. "
                       "Stopped because of --fail-fast; rows done so far are kept.")
    jr.pending.append({"row_key": key, "error": message, "finish_reason": "error"})


class Spill:
    """Random access by row number into the spill file (memory-mapped Arrow IPC)."""

    def __init__(self, path: Path):
        self._reader = pa.ipc.open_file(pa.memory_map(str(path)))
        sizes = [self._reader.get_batch(i).num_rows for i in range(self._reader.num_record_batches)]
        self._starts = np.cumsum([0] + sizes)
        self._cache: tuple[int, list] | None = None

    def row(self, i: int) -> tuple[str, int, list[int], int, int]:
        """(row_key, group, document ids, tail id, params id) of spill row ``i``."""
        b = int(np.searchsorted(self._starts, i, side="right") - 1)
        if self._cache is None or self._cache[0] != b:
            batch = self._reader.get_batch(b)
            self._cache = (b, [batch.column(k) for k in range(5)])
        cols = self._cache[1]
        off = i - int(self._starts[b])
        return (cols[0][off].as_py(), cols[1][off].as_py(), cols[2][off].values.to_numpy().tolist(),
                cols[3][off].as_py(), cols[4][off].as_py())

    def close(self) -> None:
        self._reader = None
