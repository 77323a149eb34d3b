"""Steps 1 and 2 of a run: stream each job's input into row keys and a spill file of what is left to compute
(``prepare``), then plan every job's rows on the model together into one ``batch.Batch`` (``prepare_jobs``).

For every input row: render the prompt, compute its ``row_key`` (row id + prompt + model + parameters); a key
with a committed result is reused; a bad row becomes an error result at once; the rest are tokenized and go to
the spill file (head group, document ids, tail id, params id) that ``SpilledRequests`` reads back by row
number. Nothing here touches the engine beyond its tokenizer and ``EngineInfo``.

    keys.arrow    row_idx -> row_key, in input order (the assembly joins results onto it)
    spill.arrow   row_key, group, doc_ids, tail, params  for the rows to compute (a ``rows.RowRequest`` each)
"""
from __future__ import annotations

import gc
import hashlib
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from engine import EngineInfo
from pipeline.io.tables import iter_batches
from pipeline.job.prompts import RowError, RowKeyer, needed_columns, row_key
from pipeline.job.rows import KEYS_SCHEMA, RowRequest
from pipeline.plan.batch import Batch, JobOffsets
from pipeline.plan.copies import Copies
from pipeline.plan.planner import INDEX, Chunk, Plan, make_plan_streamed, unplanned
from pipeline.prepare.dedup import Dedup, content_digest
from pipeline.prepare.job_run import JobRun
from pipeline.prepare.key_set import KeySet, digests
from pipeline.prepare.long_docs import chunks_of
from pipeline.prepare.spool import Spool
from pipeline.prepare.unique_ids import UniqueIds
from pipeline.problems import RunError

SPILL_SCHEMA = pa.schema([("row_key", pa.string()), ("group", pa.int64()), ("doc_ids", pa.list_(pa.int32())),
                          ("tail", pa.int64()), ("params", pa.int32())])
# what the planner needs of each spilled request, kept on disk (``spool.Spool``) in request order
REQUEST = np.dtype([("group", "<i4"), ("len", "<i4")])


def prepare_jobs(runs: list[JobRun], info: EngineInfo, order: str, *, dry_run: bool, commit_rows: int,
                 fail_fast: bool) -> Batch:
    """Prepare every job on the model (``prepare``) and plan their rows together: one batch over the spill files.
    ``order``: planned (``planner.make_plan_streamed``), or input / shuffled (``planner.unplanned``, benchmark
    baselines). Memory: the plan's 12 bytes a request and 16 bytes a copy; everything else per row is on disk
    (the spill files, the request log, the dedup and id parts)."""
    heads: list[tuple[int, ...]] = []
    head_index: dict[str, int] = {}
    dedup = Dedup()
    log = Spool(REQUEST)
    try:
        sizes = [prepare(jr, info, heads, head_index, dry_run=dry_run, commit_rows=commit_rows,
                         fail_fast=fail_fast, dedup=dedup, job_index=j, log=log) for j, jr in enumerate(runs)]
        offsets = np.cumsum([0] + sizes)                           # job j's requests: offsets[j]..offsets[j+1]
        copies = dedup.resolve(offsets)
        job = JobOffsets(offsets)
        group_sizes = _count(log, copies, job, runs, len(heads))
        block_size = info.config.block_size
        if order == "planned":
            plan = make_plan_streamed(heads, group_sizes, lambda: _chunks(log, copies), block_size)
            if not info.config.enable_prefix_caching:
                plan.cached[:] = 0          # nothing is reused: no hits predicted, no provider to wait for
        else:
            plan = _baseline(log, copies, block_size, order)
    finally:
        log.close()
        dedup.close()
    return Batch(plan, heads, SpilledRequests(runs, job, offsets), job, [jr.prompts for jr in runs], copies=copies)


def _chunks(log: Spool, copies: Copies) -> Iterator[Chunk]:
    """The request log as the planner's chunks: copies are not planned."""
    first = 0
    for c in log.chunks():
        yield first, c["group"], c["len"], ~copies.among(first, first + len(c)) if len(copies) else None
        first += len(c)


def _count(log: Spool, copies: Copies, job: JobOffsets, runs: list[JobRun], num_groups: int) -> list[int]:
    """Requests to compute by group (the planner's sizes); each job's copies and their prompt tokens, and its
    requests to compute (``spill_rows``: copies not counted)."""
    sizes = np.zeros(num_groups, dtype=np.int64)
    n_copies = np.zeros(len(runs), dtype=np.int64)
    copy_tokens = np.zeros(len(runs), dtype=np.int64)
    for first, groups, lens, keep in _chunks(log, copies):
        if keep is None:
            sizes += np.bincount(groups, minlength=num_groups)
            continue
        sizes += np.bincount(groups[keep], minlength=num_groups)
        jobs = job[np.flatnonzero(~keep) + first]
        n_copies += np.bincount(jobs, minlength=len(runs))
        copy_tokens += np.bincount(jobs, weights=lens[~keep], minlength=len(runs)).astype(np.int64)
    for j, jr in enumerate(runs):
        jr.planned_copies, jr.planned_copy_tokens = int(n_copies[j]), int(copy_tokens[j])
        jr.spill_rows -= jr.planned_copies
    return sizes.tolist()


def _baseline(log: Spool, copies: Copies, block_size: int, how: str) -> Plan:
    """The benchmark baselines (``planner.unplanned``) over the requests to compute (held in memory)."""
    index, groups, lens = [], [], []
    for first, g, n, keep in _chunks(log, copies):
        take = np.ones(len(g), dtype=bool) if keep is None else keep
        index.append(np.flatnonzero(take) + first)
        groups.append(g[take])
        lens.append(n[take])

    def whole(parts: list) -> np.ndarray:
        return np.concatenate(parts).astype(INDEX) if parts else np.zeros(0, INDEX)
    plan = unplanned(whole(groups), whole(lens), block_size, how)
    plan.order = whole(index)[plan.order]
    return plan


def prepare(jr: JobRun, info: EngineInfo, heads: list, head_index: dict, *, dry_run: bool, commit_rows: int,
            log: Spool, fail_fast: bool, dedup: Dedup | None = None, job_index: int = 0) -> int:
    """Stream the job's input; write keys (+ spill of rows to compute); returns the rows spilled. Rows already
    committed are reused, bad rows are committed as error rows at once. ``heads`` / ``head_index`` collect the
    distinct prompt heads of every job on the model (the planner's groups); ``dedup`` the contents of every job's
    requests on the model (``job_index``: this job's); ``log`` each spilled request's group and length."""
    return _JobPreparer(jr, heads, head_index, dry_run=dry_run, commit_rows=commit_rows,
                        fail_fast=fail_fast, dedup=dedup, job_index=job_index, log=log).run()


class _JobPreparer:
    """One job's ``prepare``: what it has seen so far (ids, keys, the keys' digest), the planner's groups and
    lengths of the rows to compute, and the keys / spill writers (none in a dry run)."""

    def __init__(self, jr: JobRun, heads: list, head_index: dict, *, dry_run: bool, commit_rows: int,
                 log: Spool, fail_fast: bool, dedup: Dedup | None = None, job_index: int = 0):
        self.jr, self.heads, self.head_index = jr, heads, head_index
        self.dedup = dedup if jr.job.dedup else None
        self.job_index = job_index
        self.dry_run, self.commit_rows, self.fail_fast = dry_run, commit_rows, fail_fast
        self.job, self.prompts = jr.job, jr.prompts
        self.r = self.prompts.renderer
        self.id_col = self.job.input.id_column
        self.max_len = self.prompts.max_model_len
        # committed rows (an incremental run, a resume): their keys and ids as digests, not Python strings
        self.done_keys, self.done_ids = _done_sets(jr.state)
        self.ids = UniqueIds() if self.id_col and not self.job.input.allow_duplicate_ids else None
        # keys are unique when ids are (a key is its row id + a hash): only repeated ids need them remembered
        self.seen_keys: set[str] | None = set() if self.job.input.allow_duplicate_ids else None
        self.digest = hashlib.sha256()
        self.log = log
        self.spilled = 0
        self.groups = array("i")            # this record batch's spilled requests (to the log at its end)
        self.lens = array("i")
        self.keyer = RowKeyer(self.prompts.fingerprint)          # = row_key(rid, rendered text, fingerprint)
        self.keys_w = self.spill_w = None

    def run(self) -> int:
        jr = self.jr
        self._open_writers()
        gc_was_on = gc.isenabled()
        gc.disable()    # millions of small id lists: the cyclic collector would walk them all, again and again
        # (cost: docs/perf/code-notes-pipe.md)
        try:
            num_rows = self._stream()
            self._check_ids()
        finally:
            if self.ids is not None:
                self.ids.close()
            if gc_was_on:
                gc.enable()
            if self.keys_w is not None:
                self.keys_w.close()
                self.spill_w.close()
        if not self.dry_run:
            jr.commit()
        jr.num_rows = num_rows
        jr.spill_rows = self.spilled
        jr.keys_digest = self.digest.hexdigest()
        return self.spilled

    def _open_writers(self) -> None:
        if self.dry_run:
            return
        state = self.jr.state
        keys_path, spill_path = state.scratch("keys.arrow"), state.scratch("spill.arrow")
        state.dir.mkdir(parents=True, exist_ok=True)
        self.keys_w = pa.ipc.new_file(str(keys_path), KEYS_SCHEMA)
        self.spill_w = pa.ipc.new_file(str(spill_path), SPILL_SCHEMA)

    def _stream(self) -> int:
        """Every input record batch (Arrow's), rendered, tokenized and finished; returns the number of input rows.

        Two stages, one record batch apart: the next renders (Python) while this one's documents tokenize on a
        worker thread (the Rust tokenizer and Arrow's kernels run without the GIL). Rendering a record batch ahead
        of the previous one's keys may tokenize a duplicate the second stage then skips: harmless."""
        job = self.job
        cols = list(dict.fromkeys(([self.id_col] if self.id_col else []) + needed_columns(job.prompt)))
        row_idx = 0
        with ThreadPoolExecutor(1, thread_name_prefix="batchgen-tokenize") as pool:
            inflight = None
            for record_batch in iter_batches(job.input.path, job.input.format, cols, job.input.batch_size,
                                             job.input.split, job.input.limit):
                rows = record_batch.to_pylist()
                rendered = self._render_rows(rows, row_idx)
                done = self.done_keys.contains_all([key for _, _, key, _ in rendered])
                todo = [k for k, (_, rr, key, _) in enumerate(rendered)
                        if not isinstance(rr, RowError) and not done[k] and not self._seen(key)]
                future = pool.submit(self._tokenize, [rendered[k][1].document for k in todo])
                if inflight is not None:
                    self._finish(*inflight)
                inflight = (rows, row_idx, rendered, done, todo, future)
                row_idx += len(rows)
            if inflight is not None:
                self._finish(*inflight)
        return row_idx

    def _seen(self, key: str) -> bool:
        return self.seen_keys is not None and key in self.seen_keys

    def _row_id(self, row: dict, row_no: int) -> str:
        rid = _row_id(row, row_no, self.id_col)
        if self.ids is not None:
            self.ids.add(rid)
        return rid

    def _check_ids(self) -> None:
        """Ids must be unique unless the job allows repeats: the first repeated one, named with its row."""
        if self.ids is None:
            return
        job, id_col = self.job, self.id_col

        def ids():
            row_no = 0
            for b in iter_batches(job.input.path, job.input.format, [id_col], job.input.batch_size, job.input.split,
                                  job.input.limit):
                for row in b.to_pylist():
                    yield row_no, _row_id(row, row_no, id_col)
                    row_no += 1
        repeat = self.ids.first_repeat(ids)
        if repeat is not None:
            rid, row_no = repeat
            raise RunError(f"{job.file}: input.id_column {id_col!r}: id {rid!r} appears more than once (again at "
                           f"row {row_no}); ids must be unique, or set input.allow_duplicate_ids: true")

    def _render_rows(self, rows: list[dict], row_idx: int) -> list:
        """Per row: (row id, its rendering or the RowError, its row key, its parameter set's index)."""
        prompts = self.prompts
        rendered: list = []
        for i, row in enumerate(rows):
            rid = self._row_id(row, row_idx + i)
            pidx = 0
            try:
                rr = self.r.render(row)
                if rr.params:
                    pidx = prompts.params_index(rr.params)
                key = self.keyer.key(rid, rr.head,
                                     rr.document + rr.tail + (f"\0{rr.params!r}" if rr.params else ""))
            except RowError as e:
                rr, key = e, row_key(rid, "error:" + str(e) + repr(sorted(row.items(), key=str)),
                                     prompts.fingerprint)
            rendered.append((rid, rr, key, pidx))
        return rendered

    def _tokenize(self, docs: list[str]) -> list:
        # NOTE: a dry run needs only lengths: range(n) stands in for n ids (len and slicing behave alike)
        return [range(n) for n in self.r.document_lengths(docs)] if self.dry_run else self.r.document_ids(docs)

    def _finish(self, rows: list[dict], row_idx: int, rendered: list, done: np.ndarray, todo: list[int],
                tokenized) -> None:
        """One batch's keys, and the spill of its rows still to compute (rows seen or done before are skipped);
        ``done``: per row, its key is committed."""
        jr = self.jr
        doc_ids = dict(zip(todo, tokenized.result()))
        keys, spill = [], {"row_key": [], "group": [], "doc_ids": [], "tail": [], "params": []}
        new = [k for k in range(len(rendered)) if not done[k]]
        # rows whose id was committed under another key: changed since (ids hashed only for rows not done)
        changed = {k for k, c in zip(new, self.done_ids.contains_all([rendered[k][0] for k in new])) if c}
        for k, (rid, rr, key, pidx) in enumerate(rendered):
            keys.append(key)
            self.digest.update(key.encode() + b"\n")
            if done[k] or self._seen(key):
                jr.reused += bool(done[k])
                continue
            if self.seen_keys is not None:
                self.seen_keys.add(key)
            if k in changed:
                jr.changed += 1
            self._spill_row(rr, key, pidx, doc_ids, k, row_idx + k, spill)
        self._write(rows, row_idx, keys, spill)
        self._log()
        if not self.dry_run and len(jr.pending) >= self.commit_rows:
            jr.commit()

    def _spill_row(self, rr, key: str, pidx: int, doc_ids: dict, k: int, row_no: int, spill: dict) -> None:
        """A new row: an error row, or its head group and the part(s) to compute in ``spill``."""
        r, prompts = self.r, self.prompts
        chunks = None
        if not isinstance(rr, RowError):
            head, tail = r.head_ids(rr.head), r.tail_ids(rr.tail)
            row_max = prompts.param_sets[pidx].max_tokens
            max_len = self.max_len
            try:
                ids = r.fit(head, doc_ids[k], tail, max_len, row_max)
            except RowError as e:
                room = max_len - row_max - len(head) - len(tail)
                if self.job.prompt.on_too_long == "map_reduce" and room > 0:
                    chunks = chunks_of(r, rr.document, room)
                else:
                    rr = e
        if isinstance(rr, RowError):
            _row_error(self.jr, key, str(rr), row_no, self.fail_fast)
            return
        gid = self._head_group(rr.head, head)
        tail_id = prompts.tail_index(tail)
        if chunks is not None:          # on_too_long: map_reduce (pipeline.prepare.long_docs)
            parts = self.jr.long_docs.add(key, chunks, gid, tail_id, pidx, head_len=len(head), tail_len=len(tail))
            todo_chunks = [(ck, c) for ck, c in parts if ck not in self.done_keys]
        else:
            self._note_content(gid, rr, pidx)
            todo_chunks = [(key, ids)]
        part_params = pidx if chunks is None else prompts.unconstrained_index(pidx)   # parts: no schema
        for ck, c in todo_chunks:
            self.spilled += 1
            self.groups.append(gid)
            self.lens.append(len(head) + len(c) + len(tail))
            spill["row_key"].append(ck)
            spill["group"].append(gid)
            spill["doc_ids"].append(c)
            spill["tail"].append(tail_id)
            spill["params"].append(part_params)

    def _note_content(self, gid: int, rr, pidx: int) -> None:
        """A mergeable row's content, for ``dedup`` (it is spilled as ``self.spilled``, its index in this job)."""
        if self.dedup is None:
            return
        digest = content_digest(gid, rr.document, rr.tail, self.prompts.param_sets[pidx])
        if digest is not None:
            self.dedup.add(digest, self.job_index, self.spilled)

    def _log(self) -> None:
        """This record batch's spilled requests (group, length) to the request log."""
        if len(self.groups):
            records = np.empty(len(self.groups), dtype=REQUEST)
            records["group"], records["len"] = np.frombuffer(self.groups, np.int32), np.frombuffer(self.lens, np.int32)
            self.log.append(records)
            self.groups, self.lens = array("i"), array("i")

    def _head_group(self, head_text: str, head: list) -> int:
        """The planner's group of a prompt head (and chat template), shared by every job on the model."""
        gid = self.head_index.setdefault("\0".join((head_text, str(self.job.prompt.chat_template))),
                                         len(self.heads))
        if gid == len(self.heads):
            self.heads.append(head)
        return gid

    def _write(self, rows: list[dict], row_idx: int, keys: list[str], spill: dict) -> None:
        if self.keys_w is not None:
            self.keys_w.write_batch(pa.record_batch([pa.array(range(row_idx, row_idx + len(rows)), pa.int64()),
                                                     pa.array(keys, pa.string())], schema=KEYS_SCHEMA))
            if spill["row_key"]:
                self.spill_w.write_batch(pa.record_batch(spill, schema=SPILL_SCHEMA))


def _row_id(row: dict, row_no: int, id_col: str | None) -> str:
    if not id_col:
        return str(row_no)
    return str(row[id_col]) if row[id_col] is not None else f"<null id at row {row_no}>"


def _done_sets(state) -> tuple[KeySet, KeySet]:
    """The committed row keys and their row ids, read part by part."""
    keys: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for batch in state.done_keys() if state.dir.exists() else ():
        keys.append(digests(batch))
        ids.append(digests(k.rpartition("#")[0] for k in batch))
    return KeySet(keys), KeySet(ids)


def _row_error(jr: JobRun, key: str, message: str, row_idx: int, fail_fast: bool) -> None:
    if fail_fast:
        jr.row_errors += 1
        raise RunError(f"job {jr.job.name!r}, row {row_idx} ({key.rpartition('#')[0]}): {message}. "
                       "Stopped because of --fail-fast; rows done so far are kept.")
    jr.row_error(key, message)


class Spill:
    """Random access by row number into one job's spill file (memory-mapped Arrow IPC)."""

    def __init__(self, path: Path, job: int):
        self.job = job
        self._reader = pa.ipc.open_file(pa.memory_map(str(path)))
        sizes = [self._reader.get_batch(i).num_rows for i in range(self._reader.num_record_batches)]
        self._starts = np.cumsum([0] + sizes)
        self._cache: tuple[int, list] | None = None

    def row(self, i: int) -> RowRequest:
        """Spill row ``i``."""
        b = int(np.searchsorted(self._starts, i, side="right") - 1)
        if self._cache is None or self._cache[0] != b:
            record_batch = self._reader.get_batch(b)
            self._cache = (b, [record_batch.column(k) for k in range(5)])
        cols = self._cache[1]
        off = i - int(self._starts[b])
        return RowRequest(self.job, cols[0][off].as_py(), cols[1][off].as_py(),
                          cols[2][off].values.to_numpy().tolist(), cols[3][off].as_py(), cols[4][off].as_py())

    def close(self) -> None:
        self._reader = None


class SpilledRequests:
    """The requests of a planned Batch, by request index (job, row in its spill file); spill files are opened
    when first read (after ``prepare`` has closed them) and closed by ``close``."""

    def __init__(self, runs: list[JobRun], job: np.ndarray, offsets: np.ndarray):
        self._runs, self._job, self._offsets = runs, job, offsets
        self._spills: dict[int, Spill] = {}

    def __len__(self) -> int:
        return len(self._job)

    def __getitem__(self, i: int) -> RowRequest:
        j = int(self._job[i])
        spill = self._spills.get(j)
        if spill is None:
            spill = self._spills[j] = Spill(self._runs[j].state.scratch("spill.arrow"), j)
        return spill.row(i - int(self._offsets[j]))

    def close(self) -> None:
        spills, self._spills = self._spills, {}
        for s in spills.values():
            s.close()
