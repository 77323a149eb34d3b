"""Run jobs: read -> plan -> engine -> write, resumable, one row out per row in.

    for each model: one engine (jobs sharing a model share its prefix cache)
      1. prepare  stream each job's input; render + tokenize rows; skip rows whose row_key is committed;
                  bad rows become error results at once; the rest go to a spill file (token ids on disk)
      2. plan     prefix tree over all prompt heads of all jobs -> order, predicted hits, providers
      3. execute  keep a bounded window of requests in the engine (priority = plan position); a request
                  joins right after its provider (the engine schedules by priority, so the provider
                  computes and caches the shared blocks first); a group's head is pinned while
                  requests that reuse it are pending; finished rows are committed as parts
                  every couple of seconds
      4. assemble per job: keys (input order) join committed results -> output, atomically; manifest

A kill at any point loses at most the uncommitted rows; the next run recomputes only those.

Incremental runs fall out of the row keys: rows whose key has a committed result are reused, new or changed
rows are computed, and the output is rebuilt with one row per *current* input row. Rows that left the input are
dropped from the output, or kept at its end with ``output.keep_deleted_rows: true``.

Every run also leaves (see ``RunTrace`` / ``pipeline.history``):

    <state dir>/runs/<run id>/        requests.parquet/, steps.parquet/ (append-only part files), run.json
                                      -> ``batchgen report <dir>``
    <state dir>/current_run           the run id while a run is unfinished (a resume appends to its trace)
    history.sqlite (state dir of ``pipeline.history``)   one row per job per run -> ``batchgen status``

The trace of a run goes into the state dir of its first job (jobs on one model share one engine, so one trace).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import heapq
import json
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine import BatchgenError, Engine, EngineInfo
from pipeline import history
from pipeline.errors import RunError
from pipeline.io import InputError, iter_batches, iter_output_batches, write_bytes_atomic, write_output
from pipeline.job import Job
from pipeline.planner import Plan, make_plan, unplanned
from pipeline.prompts import PromptRenderer, RowError, fingerprint, needed_columns, row_key
from pipeline.state import RESULT_COLUMNS, RunState, manifest_path_for
from pipeline.trace import RunTrace, prune_runs

SPILL_SCHEMA = pa.schema([("row_key", pa.string()), ("group", pa.int64()), ("doc_ids", pa.list_(pa.int32())),
                          ("tail", pa.int64())])
KEYS_SCHEMA = pa.schema([("row_idx", pa.int64()), ("row_key", pa.string())])


class Interrupted(RunError):
    """SIGTERM / Ctrl-C: committed work is kept; running the same command again resumes."""


@dataclass
class RunOptions:
    quiet: bool = False
    fail_fast: bool = False
    commit_interval_s: float = 2.0     # commit finished rows at least this often ...
    commit_rows: int = 256             # ... or whenever this many are pending
    window_factor: int = 3             # requests kept in the engine = window_factor * max_num_seqs
    max_open_groups: int = 16          # shared heads pinned at once
    stop_after_rows: int | None = None  # testing: behave as if interrupted after this many rows
    record_history: bool = True        # one row per job per run in pipeline.history (``batchgen status``)
    state_dir: str | None = None       # history's state dir (None: $BATCHGEN_STATE_DIR or ~/.local/state/batchgen)
    order: str = "planned"             # planned | input | shuffled (the last two: baselines for benchmarks)


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


@dataclass
class RunReport:
    jobs: list[JobRun]
    plan: Plan | None
    wall_s: float
    engine_info: EngineInfo
    summary: str = ""
    trace_dir: Path | None = None


def default_llm_factory(model: str, engine_args: dict) -> Engine:
    from engine import LLM
    return LLM(model=model, **engine_args)


def merge_engine_args(jobs: list[Job]) -> dict:
    merged: dict = {}
    for job in jobs:
        for k, v in job.engine.items():
            if k in merged and merged[k] != v:
                raise RunError(f"{job.file}: engine.{k} is {v!r} but another job with model {job.model!r} "
                               f"sets {merged[k]!r}; jobs on one model share one engine, so their engine "
                               "settings must agree")
            merged[k] = v
    return merged


def _versions() -> dict:
    from importlib import metadata
    out = {"python": platform.python_version()}
    for pkg in ("batchgen", "torch", "transformers", "pyarrow", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


class Runner:
    def __init__(self, jobs: list[Job], llm_factory: Callable | None = None, options: RunOptions | None = None,
                 echo: Callable[[str], None] = print):
        self.jobs = jobs
        self.llm_factory = llm_factory or default_llm_factory
        self.opts = options or RunOptions()
        self.echo = echo
        self._stop_reason: str | None = None

    # ---- entry points -------------------------------------------------------------------------------
    def run(self, dry_run: bool = False) -> list[RunReport]:
        by_model: dict[str, list[Job]] = {}
        for job in self.jobs:
            by_model.setdefault(job.model, []).append(job)
        reports = []
        for model, jobs in by_model.items():
            reports.append(self._run_model(model, jobs, dry_run))
        return reports

    def _run_model(self, model: str, jobs: list[Job], dry_run: bool) -> RunReport:
        t0 = time.monotonic()
        states = [RunState(job.output.path, job.name) for job in jobs]
        hist = {} if dry_run else self._history_start(model, jobs)
        runs: list[JobRun] = []
        locked: list[RunState] = []
        old_handlers = {}
        self._trace = None
        llm = None
        try:
            if not dry_run:
                # NOTE: the lock comes before the model load, so an overlapping run (cron firing while the
                # previous run still goes) exits at once instead of after loading the weights.
                for st in states:
                    st.lock()
                    locked.append(st)
                old_handlers = self._install_signal_handlers()
            engine_args = merge_engine_args(jobs)
            try:
                llm = self.llm_factory(model, engine_args)
                if not isinstance(llm, Engine):
                    raise TypeError(f"llm_factory returned {type(llm).__name__}, which lacks the engine.Engine door")
            except BatchgenError as e:       # the engine's message, with the job files it comes from
                raise RunError(f"{', '.join(sorted({j.file for j in jobs}))}: cannot start model {model!r}"
                               f"{' with engine ' + json.dumps(engine_args) if engine_args else ''}: {e}") from None
            t_loaded = time.monotonic()
            info = llm.info
            _check_kv_pool(info, jobs)
            tok = llm.get_tokenizer()
            runs = [self._job_run(job, st, tok, info) for job, st in zip(jobs, states)]
            heads: list[tuple[int, ...]] = []
            head_index: dict[str, int] = {}
            req_job, req_local, req_group, req_len = [], [], [], []
            for j, jr in enumerate(runs):
                g, ln = self._prepare(jr, info, heads, head_index, dry_run)
                req_job.append(np.full(len(g), j, dtype=np.int64))
                req_local.append(np.arange(len(g), dtype=np.int64))
                req_group.append(np.asarray(g, dtype=np.int64))
                req_len.append(np.asarray(ln, dtype=np.int64))
            req_job_a = np.concatenate(req_job)
            req_local_a = np.concatenate(req_local)
            groups_a, lens_a = np.concatenate(req_group), np.concatenate(req_len)
            block_size = info.block_size
            plan = (make_plan(heads, groups_a, lens_a, block_size) if self.opts.order == "planned"
                    else unplanned(groups_a, lens_a, block_size, self.opts.order))
            pjob = req_job_a[plan.order]
            for j, jr in enumerate(runs):
                mask = pjob == j
                jr.predicted_cached = int(plan.cached[mask].sum())
                jr.planned_prompt_tokens = int(plan.prompt_len[mask].sum())
            report = RunReport(runs, plan, 0.0, info)
            if dry_run:
                report.wall_s = time.monotonic() - t0
                return report
            if self._stop_reason is not None:
                raise Interrupted(f"stopped ({self._stop_reason}) before any document was computed. Run the "
                                  "same command again to start.")
            if plan.num_requests:
                self._trace = self._start_trace(llm, states[0], t_loaded)
            report.trace_dir = self._trace.run_dir if self._trace is not None else None
            if plan.num_requests:
                self._execute(llm, runs, plan, req_job_a, req_local_a, heads)
            self._engine_s = time.monotonic() - t_loaded
            for jr in runs:
                self._assemble(jr, info, time.monotonic() - t0, report.trace_dir)
            self._flush_trace(llm)
            (states[0].dir / "current_run").unlink(missing_ok=True)
            report.wall_s = time.monotonic() - t0
            report.summary = self._summary(report)
            self._history_finish(hist, runs, "ok", report.trace_dir)
            if not dry_run and report.trace_dir is not None:
                self._prune_traces(states[0], jobs, report.trace_dir)
            return report
        except Interrupted as e:
            self._flush_trace(llm)
            self._history_finish(hist, runs, "interrupted", self._trace_dir(), str(e))
            raise
        except BatchgenError as e:
            self._flush_trace(llm)
            self._history_finish(hist, runs, "failed", self._trace_dir(), str(e))
            raise
        except InputError as e:
            err = RunError(f"job input became unreadable during the run: {e}")
            self._history_finish(hist, runs, "failed", self._trace_dir(), str(err))
            raise err from None
        except OSError as e:
            # NOTE: part files and the output are written atomically (whole or not at all), so after any
            # I/O fault what was committed is intact and a rerun resumes from it.
            what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            err = RunError(f"cannot write {e.filename or 'the run state'}: {what}. Rows committed so far are "
                           "kept; fix that and run the same command again to resume.")
            self._history_finish(hist, runs, "failed", self._trace_dir(), str(err))
            raise err from None
        except KeyboardInterrupt:            # a second Ctrl-C: stopped at once; committed rows are kept
            self._flush_trace(llm)
            self._history_finish(hist, runs, "interrupted", self._trace_dir(), "interrupted (Ctrl-C twice)")
            raise
        except BaseException as e:
            self._flush_trace(llm)
            self._history_finish(hist, runs, "failed", self._trace_dir(), f"{type(e).__name__}: {e}")
            raise
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            for st in locked:
                st.unlock()

    # ---- trace and history --------------------------------------------------------------------------
    def _start_trace(self, llm: Engine, state: RunState, start: float) -> RunTrace | None:
        """A trace in ``<state dir>/runs/<run id>``; an unfinished earlier run's id is reused (resume)."""
        runs_dir = state.dir / "runs"
        marker = state.dir / "current_run"
        run_id = marker.read_text().strip() if marker.exists() else ""
        if not run_id or not (runs_dir / run_id).is_dir():
            run_id = time.strftime("%Y%m%d-%H%M%S")
            n = 1
            while (runs_dir / run_id).exists():
                n += 1
                run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        try:
            trace = RunTrace(runs_dir / run_id, llm.info.to_dict(), llm.info.load_time_s,
                             model_config=llm.model_config, start_time=start)
            marker.write_text(run_id)
            return trace
        except (OSError, ValueError) as e:     # NOTE: a trace must never fail a run
            self._warn(f"no trace for this run ({e})")
            return None

    def _prune_traces(self, state: RunState, jobs, current: Path | None) -> None:
        """Keep the newest ``output.keep_runs`` traces (the smallest over the jobs sharing this state dir)."""
        try:
            prune_runs(state.dir / "runs", min(j.output.keep_runs for j in jobs), current)
        except OSError as e:                    # NOTE: pruning must never fail a finished run
            self._warn(f"could not prune old run traces ({e})")

    def _trace_dir(self) -> Path | None:
        return self._trace.run_dir if self._trace is not None else None

    def _flush_trace(self, llm: Engine | None) -> None:
        trace = self._trace
        if trace is None or llm is None:
            return
        try:
            trace.add_steps(llm.step_stats)
            trace.write()
        except Exception as e:                  # NOTE: e.g. a full disk; the results matter, the trace less
            self._warn(f"cannot write the trace to {trace.run_dir} ({e}); the run goes on without it")
            self._trace = None

    def _warn(self, message: str) -> None:
        print(f"batchgen: warning: {message}", file=sys.stderr)

    def _history_start(self, model: str, jobs: list[Job]) -> dict[str, int]:
        if not self.opts.record_history:
            return {}
        ids = {}
        for job in jobs:
            try:
                ids[job.name] = history.start_run(job.name, _config_summary(job, model),
                                                  state_dir=self.opts.state_dir)
            except history.HistoryError as e:
                self._warn(f"run history not recorded: {e}")
                return ids
        return ids

    def _history_finish(self, hist: dict[str, int], runs: list[JobRun], status: str, trace_dir: Path | None,
                        error: str | None = None) -> None:
        by_name = {jr.job.name: jr for jr in runs}
        for name, run_id in hist.items():
            jr = by_name.get(name)
            this = (jr.manifest or {}).get("this_run", {}) if jr and not jr.up_to_date else {}
            try:
                history.finish_run(
                    run_id, status, rows_done=jr.computed if jr else 0, rows_skipped=jr.reused if jr else 0,
                    rows_failed=jr.row_errors if jr else 0, tokens_per_s=this.get("tokens_per_s"),
                    cache_hit_rate=_rate(jr.cached_tokens, jr.prompt_tokens) if jr else None,
                    trace_path=trace_dir,
                    report_path=manifest_path_for(jr.job.output.path) if jr and jr.manifest else None,
                    error=error, state_dir=self.opts.state_dir)
            except history.HistoryError as e:
                self._warn(f"run history not recorded: {e}")
                return

    # ---- 1. prepare ---------------------------------------------------------------------------------
    def _job_run(self, job: Job, state: RunState, tok, info: EngineInfo) -> JobRun:
        params = job.sampling_params
        fp = fingerprint(info.identity, dataclasses.asdict(params), job.prompt.on_too_long,
                         job.prompt.chat_template)
        return JobRun(job=job, renderer=PromptRenderer(job.prompt, tok), state=state, fingerprint=fp,
                      params=params)

    def _prepare(self, jr: JobRun, info: EngineInfo, heads: list, head_index: dict, dry_run: bool):
        """Stream the job's input; write keys (+ spill of rows to compute). Returns (groups, prompt_lens)."""
        job, r = jr.job, jr.renderer
        id_col = job.input.id_column
        cols = list(dict.fromkeys(([id_col] if id_col else []) + needed_columns(job.prompt)))
        done = jr.state.load_done() if jr.state.dir.exists() else None
        done_keys = set(done.column("row_key").to_pylist()) if done is not None else set()
        done_ids = {k.rpartition("#")[0] for k in done_keys}
        max_len = info.max_model_len
        max_tokens = jr.params.max_tokens
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
        row_idx = 0
        try:
            for batch in iter_batches(job.input.path, job.input.format, cols, job.input.batch_size,
                                      job.input.split, job.input.limit):
                rows = batch.to_pylist()
                keys, spill = [], {"row_key": [], "group": [], "doc_ids": [], "tail": []}
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
                    try:
                        rr = r.render(row)
                        key = row_key(rid, rr.text, jr.fingerprint)
                    except RowError as e:
                        rr, key = e, row_key(rid, "error:" + str(e) + repr(sorted(row.items(), key=str)),
                                             jr.fingerprint)
                    rendered.append((rid, rr, key))
                todo = [k for k, (_, rr, key) in enumerate(rendered)
                        if not isinstance(rr, RowError) and key not in done_keys and key not in seen_keys]
                doc_ids = dict(zip(todo, r.document_ids([rendered[k][1].document for k in todo])))
                for k, (rid, rr, key) in enumerate(rendered):
                    keys.append(key)
                    digest.update(key.encode() + b"\n")
                    if key in done_keys or key in seen_keys:
                        jr.reused += key in done_keys
                        continue
                    seen_keys.add(key)
                    if rid in done_ids:
                        jr.changed += 1
                    if not isinstance(rr, RowError):
                        head, tail = r.head_ids(rr.head), r.tail_ids(rr.tail)
                        try:
                            ids = r.fit(head, doc_ids[k], tail, max_len, max_tokens)
                        except RowError as e:
                            rr = e
                    if isinstance(rr, RowError):
                        self._row_error(jr, key, str(rr), row_idx + k)
                        continue
                    gid = head_index.setdefault("\0".join((rr.head, str(job.prompt.chat_template))), len(heads))
                    if gid == len(heads):
                        heads.append(head)
                    groups.append(gid)
                    lens.append(len(head) + len(ids) + len(tail))
                    spill["row_key"].append(key)
                    spill["group"].append(gid)
                    spill["doc_ids"].append(ids)
                    spill["tail"].append(self._tail_id(jr, tail))
                if keys_w is not None:
                    keys_w.write_batch(pa.record_batch([pa.array(range(row_idx, row_idx + len(rows)), pa.int64()),
                                                        pa.array(keys, pa.string())], schema=KEYS_SCHEMA))
                    if spill["row_key"]:
                        spill_w.write_batch(pa.record_batch(spill, schema=SPILL_SCHEMA))
                row_idx += len(rows)
                if not dry_run and len(jr.pending) >= self.opts.commit_rows:
                    jr.state.commit(jr.pending)
                    jr.pending = []
        finally:
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
        return groups, lens

    def _tail_id(self, jr: JobRun, tail: tuple) -> int:
        tails = jr.__dict__.setdefault("_tails", {})
        return tails.setdefault(tail, len(tails))

    def _row_error(self, jr: JobRun, key: str, message: str, row_idx: int) -> None:
        jr.row_errors += 1
        if self.opts.fail_fast:
            raise RunError(f"job {jr.job.name!r}, row {row_idx} ({key.rpartition('#')[0]}): {message}. "
                           "Stopped because of --fail-fast; rows done so far are kept.")
        jr.pending.append({"row_key": key, "error": message, "finish_reason": "error"})

    # ---- 3. execute ---------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict:
        def handler(signum, frame):
            if self._stop_reason is not None:        # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self._stop_reason = signal.Signals(signum).name
        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:                       # not the main thread (e.g. some test runners)
                pass
        return old

    def _execute(self, llm: Engine, runs: list[JobRun], plan: Plan, req_job: np.ndarray, req_local: np.ndarray,
                 heads: list) -> None:
        from tqdm import tqdm

        spills = [_Spill(jr.state.scratch("spill.arrow")) if jr.spill_rows else None for jr in runs]
        tails = [{v: k for k, v in jr.__dict__.get("_tails", {}).items()} for jr in runs]
        n = plan.num_requests
        window = max(1, self.opts.window_factor * llm.info.max_num_seqs)
        # Who waits on whom: dependents of each provider, and refcounts for the provider's pin.
        waiters: dict[int, list[int]] = {}
        for p in np.nonzero(plan.provider >= 0)[0].tolist():
            waiters.setdefault(int(plan.provider[p]), []).append(p)
        dependents = {p: len(w) for p, w in waiters.items()}
        ready = [p for p in range(n) if plan.provider[p] < 0]
        heapq.heapify(ready)
        pins: dict[int, int] = {}               # provider position -> pin id
        in_flight: set[int] = set()
        open_groups: set[int] = set()
        finished = 0
        stream = sys.stderr
        bar = tqdm(total=n, file=stream, unit="doc", dynamic_ncols=True,
                   disable=self.opts.quiet or not stream.isatty())
        t_start = time.monotonic()
        last_commit = time.monotonic()
        toks = cached = prompt = 0
        clean_exit = False
        try:
            while True:
                if self._stop_reason is None and self.opts.stop_after_rows is not None \
                        and finished >= self.opts.stop_after_rows:
                    self._stop_reason = "stop_after_rows"
                if self._stop_reason is not None:
                    break                                # in-flight rows are dropped; they rerun on resume
                while ready and len(in_flight) < window:
                    p = ready[0]
                    g = int(plan.group[p])
                    # NOTE: bound the pinned heads, but never stall with nothing running (cross-group waits).
                    if p in dependents and g not in open_groups and in_flight \
                            and len(open_groups) >= self.opts.max_open_groups:
                        break
                    heapq.heappop(ready)
                    if p in dependents:
                        open_groups.add(g)
                    j, local = int(req_job[plan.order[p]]), int(req_local[plan.order[p]])
                    key, gid, doc_ids, tail = spills[j].row(local)
                    ids = list(heads[gid]) + doc_ids + list(tails[j][tail])
                    if p in waiters:
                        # Pin p's head first (its blocks are held as soon as p computes them), then release
                        # who reuses it. NOTE: they may join at once: the engine admits by priority, so p is
                        # scheduled before them and registers its prefix blocks in the step it computes them
                        # (a follower admitted in that same step already hits them). Waiting for p to
                        # *finish* would leave the batch at one request per group for p's whole decode.
                        # NOTE: the engine refuses pins past its budget (None); unpinned heads are only
                        # likelier to be evicted.
                        pin_id = llm.pin_prefix(list(heads[int(plan.group[p])]))
                        if pin_id is not None:
                            pins[p] = pin_id
                        for w in waiters.pop(p):
                            heapq.heappush(ready, w)
                    llm.add_request(str(p), ids, runs[j].params, priority=p)
                    in_flight.add(p)
                if not in_flight:
                    break
                for out in llm.step():
                    p = int(out.request_id)
                    in_flight.discard(p)
                    finished += 1
                    j, local = int(req_job[plan.order[p]]), int(req_local[plan.order[p]])
                    jr = runs[j]
                    key = spills[j].row(local)[0]
                    res = _result_row(key, out)
                    jr.pending.append(res)
                    if self._trace is not None:
                        self._trace.add_request(out, job=jr.job.name, row_id=key.rpartition("#")[0])
                    if res["error"]:
                        jr.row_errors += 1
                        if self.opts.fail_fast:
                            raise RunError(f"job {jr.job.name!r}, row {key.rpartition('#')[0]}: {res['error']}. "
                                           "Stopped because of --fail-fast; rows done so far are kept.")
                    jr.computed += 1
                    jr.prompt_tokens += res["prompt_tokens"]
                    jr.cached_tokens += res["cached_tokens"]
                    jr.output_tokens += res["output_tokens"]
                    prompt += res["prompt_tokens"]
                    cached += res["cached_tokens"]
                    toks += res["prompt_tokens"] - res["cached_tokens"] + res["output_tokens"]
                    prov = int(plan.provider[p])
                    if prov >= 0:
                        dependents[prov] -= 1
                        if dependents[prov] == 0:
                            if prov in pins:
                                llm.unpin_prefix(pins.pop(prov))
                            open_groups.discard(int(plan.group[prov]))
                    bar.update(1)
                    elapsed = max(time.monotonic() - t_start, 1e-9)
                    bar.set_postfix_str(f"{toks / elapsed:,.0f} tok/s, hit {cached / max(prompt, 1):.0%}",
                                        refresh=False)
                now = time.monotonic()
                if now - last_commit >= self.opts.commit_interval_s or \
                        any(len(jr.pending) >= self.opts.commit_rows for jr in runs):
                    self._commit_all(runs)
                    self._flush_trace(llm)
                    last_commit = now
            clean_exit = True
        finally:
            bar.close()
            # NOTE: on any exit path (stop, error, Ctrl-C twice) what finished is made durable.
            try:
                self._commit_all(runs)
            except RunError as e:
                if clean_exit:
                    raise
                self._warn(str(e))      # keep the error that stopped the run; this one is its echo
            for s in spills:
                if s is not None:
                    s.close()
        if self._stop_reason is None and finished != n:
            raise RunError(f"internal error: {n - finished} documents were never scheduled; run again to resume")
        if self._stop_reason is not None:
            done = sum(jr.computed for jr in runs)
            raise Interrupted(f"stopped ({self._stop_reason}) after {done} of {n} documents; finished rows are "
                              "committed. Run the same command again to resume where it stopped.")

    def _commit_all(self, runs: list[JobRun]) -> None:
        for jr in runs:
            if jr.pending:
                rows, jr.pending = jr.pending, []
                jr.state.commit(rows)

    # ---- 4. assemble --------------------------------------------------------------------------------
    def _assemble(self, jr: JobRun, info: EngineInfo, wall_s: float, trace_dir: Path | None = None) -> None:
        job = jr.job
        out_path = Path(job.output.path)
        mpath = manifest_path_for(out_path)
        layout = {"include_columns": list(job.passthrough_columns), "rows_per_shard": job.output.rows_per_shard,
                  "keep_deleted_rows": job.output.keep_deleted_rows}
        if jr.computed == 0 and jr.row_errors == 0 and out_path.exists() and mpath.exists():
            try:
                old = json.loads(mpath.read_text())
            except (OSError, ValueError):
                old = {}
            if old.get("keys_digest") == jr.keys_digest and old.get("layout", layout) == layout:
                jr.up_to_date = True
                jr.manifest = old
                return
        kept = self._deleted_rows(jr, out_path)
        results = jr.state.load_done()
        keys = pa.ipc.open_file(pa.memory_map(str(jr.state.scratch("keys.arrow")))).read_all()
        joined = keys.join(results, "row_key", join_type="left outer").sort_by("row_idx")
        if joined.num_rows != jr.num_rows:
            raise RunError(f"job {job.name!r}: internal error assembling output ({joined.num_rows} rows for "
                           f"{jr.num_rows} inputs)")
        missing = joined.column("finish_reason").null_count
        include = list(job.passthrough_columns)
        results_cols = joined.select([c for c in RESULT_COLUMNS if c != "row_key"] + ["row_key"])

        def tables():
            offset = 0
            rows_per = job.output.rows_per_shard
            source = iter_batches(job.input.path, job.input.format, include, job.input.batch_size,
                                  job.input.split, job.input.limit) if include else None
            buf: list[pa.Table] = []
            buffered = 0
            while offset < jr.num_rows:
                size = min(rows_per, jr.num_rows - offset)
                part = results_cols.slice(offset, size)
                if source is not None:
                    while buffered < size:
                        b = next(source)
                        buf.append(pa.Table.from_batches([b]))
                        buffered += b.num_rows
                    passthrough = pa.concat_tables(buf)
                    buf = [passthrough.slice(size)]
                    buffered -= size
                    passthrough = passthrough.slice(0, size)
                    part = pa.Table.from_arrays(passthrough.columns + part.columns,
                                                names=passthrough.column_names + part.column_names)
                yield part.combine_chunks()
                schema = part.schema
                offset += size
            if kept is not None and kept.num_rows:
                kept_rows = _conform(kept, schema)
                for start in range(0, kept_rows.num_rows, rows_per):
                    yield kept_rows.slice(start, rows_per).combine_chunks()

        if missing > 0 and jr.num_rows:
            raise RunError(f"job {job.name!r}: {missing} rows have no result; run again to resume")
        directory = not str(out_path).endswith(".parquet")
        if jr.num_rows == 0:
            empty = results_cols.slice(0, 0)
            write_output(iter([kept if kept is not None and kept.num_rows else empty]), out_path, directory)
        else:
            write_output(tables(), out_path, directory)
        jr.state.compact(results)
        for name in ("spill.arrow", "keys.arrow"):
            jr.state.scratch(name).unlink(missing_ok=True)
        all_prompt = pc.sum(joined.column("prompt_tokens")).as_py() or 0
        all_cached = pc.sum(joined.column("cached_tokens")).as_py() or 0
        all_errors = joined.column("error").is_valid().to_pylist().count(True)
        manifest = {
            "job": job.name, "job_file": job.file, "output": str(out_path),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": info.to_dict(),      # the engine: identity, resolved dtype/device/blocks, config, load
            "generation": dataclasses.asdict(jr.params), "versions": _versions(),
            "rows": jr.num_rows + jr.deleted_kept, "rows_with_error": all_errors,
            "deleted_rows": {"kept": jr.deleted_kept, "dropped": jr.deleted_dropped},
            "this_run": {"computed": jr.computed, "reused": jr.reused, "changed": jr.changed,
                         "row_errors": jr.row_errors, "prompt_tokens": jr.prompt_tokens,
                         "cached_tokens": jr.cached_tokens, "output_tokens": jr.output_tokens,
                         "predicted_hit_rate": _rate(jr.predicted_cached, jr.planned_prompt_tokens),
                         "achieved_hit_rate": _rate(jr.cached_tokens, jr.prompt_tokens),
                         "wall_s": round(wall_s, 3),
                         "engine_s": round(getattr(self, "_engine_s", wall_s), 3),   # after model load
                         "load_s": info.load_time_s, "load_breakdown_s": dict(info.load_breakdown),
                         "tokens_per_s": round((jr.prompt_tokens + jr.output_tokens) / wall_s, 1) if wall_s else None},
            "totals": {"prompt_tokens": all_prompt, "cached_tokens": all_cached,
                       "hit_rate": _rate(all_cached, all_prompt)},
            "keys_digest": jr.keys_digest, "layout": layout,
            "trace": None if trace_dir is None else str(trace_dir),
        }
        write_bytes_atomic(json.dumps(manifest, indent=2, default=str).encode(), manifest_path_for(out_path))
        jr.manifest = manifest

    def _deleted_rows(self, jr: JobRun, out_path: Path) -> pa.Table | None:
        """Rows of the previous output whose id is no longer in the input: counted, and returned when the job
        keeps them (``output.keep_deleted_rows``); None when there are none or they are dropped."""
        if not out_path.exists():
            return None
        import pyarrow.parquet as pq
        try:
            prev_keys = pq.read_table(out_path, columns=["row_key"]).column("row_key")
        except (pa.ArrowException, OSError, KeyError):
            return None                  # not an output of ours (or unreadable): nothing to carry over
        current = pa.array(sorted(jr.ids), pa.string())

        def gone_mask(keys):
            ids = pc.replace_substring_regex(keys, pattern="#[0-9a-f]{20}$", replacement="")
            return pc.invert(pc.is_in(ids, value_set=current))

        n = int(pc.sum(gone_mask(prev_keys)).as_py() or 0)
        if not n:
            return None
        if not jr.job.output.keep_deleted_rows:
            jr.deleted_dropped = n
            return None
        jr.deleted_kept = n
        # Batch by batch: only the kept rows are held, not the whole previous output.
        kept = [pa.Table.from_batches([b]).filter(gone_mask(b.column("row_key")))
                for b in iter_output_batches(out_path)]
        return pa.concat_tables([t for t in kept if t.num_rows] or kept[:1])

    # ---- summary ------------------------------------------------------------------------------------
    def _summary(self, report: RunReport) -> str:
        lines = []
        plan = report.plan
        computed = sum(jr.computed for jr in report.jobs)
        prompt = sum(jr.prompt_tokens for jr in report.jobs)
        cached = sum(jr.cached_tokens for jr in report.jobs)
        out_toks = sum(jr.output_tokens for jr in report.jobs)
        for jr in report.jobs:
            if jr.up_to_date:
                lines.append(f"{jr.job.name}: up to date, nothing to do ({jr.num_rows} rows in {jr.job.output.path}).")
                continue
            bits = [f"{jr.num_rows} rows -> {jr.job.output.path}", f"{jr.computed} computed"]
            if jr.reused:
                bits.append(f"{jr.reused} reused from earlier runs")
            if jr.changed:
                bits.append(f"{jr.changed} recomputed because their prompt, model or parameters changed")
            if jr.deleted_kept:
                bits.append(f"{jr.deleted_kept} no longer in the input kept (output.keep_deleted_rows)")
            if jr.deleted_dropped:
                bits.append(f"{jr.deleted_dropped} no longer in the input dropped")
            errs = (jr.manifest or {}).get("rows_with_error", jr.row_errors)
            bits.append(f"{errs} with errors" if errs else "no errors")
            lines.append(f"{jr.job.name}: " + ", ".join(bits) + ".")
        if computed:
            lines.append(
                f"Model {report.engine_info.name}: {computed} documents in {report.wall_s:.1f}s, "
                f"{(prompt - cached + out_toks) / max(report.wall_s, 1e-9):,.0f} computed tokens/s "
                f"({prompt:,} prompt tokens, {cached:,} from cache, {out_toks:,} generated); cache hit rate "
                f"{_pct(cached, prompt)} achieved vs {_pct(plan.cached_tokens, plan.prompt_tokens)} predicted.")
        if report.trace_dir is not None:
            lines.append(f"Trace: {report.trace_dir} (batchgen report {report.trace_dir}).")
        return " ".join(lines)


def _check_kv_pool(info: EngineInfo, jobs: list[Job]) -> None:
    """Impossible engine settings fail before compute: a KV pool with fewer blocks than ``max_num_seqs``
    (less than one block per sequence) cannot run the batch it is configured for."""
    blocks, block_size, max_seqs = info.num_kv_blocks, info.block_size, info.max_num_seqs
    if blocks is not None and blocks < max_seqs:
        files = ", ".join(sorted({j.file for j in jobs}))
        raise RunError(f"{files}: engine: impossible settings: the KV cache pool has {blocks} block"
                       f"{'s' * (blocks != 1)} of {block_size} tokens, less than one block per sequence for "
                       f"max_num_seqs {max_seqs}; raise engine.kv_cache_memory (or num_gpu_blocks_override) or "
                       "lower engine.max_num_seqs")


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones null, others cast (null where they cannot be)."""
    cols = []
    for f in schema:
        if f.name in table.column_names:
            try:
                cols.append(table.column(f.name).cast(f.type))
                continue
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        cols.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def _config_summary(job: Job, model: str) -> dict:
    return {"model": model, "job_file": job.file, "input": job.input.path, "output": job.output.path,
            "schedule": job.schedule}


def _rate(a: int, b: int) -> float | None:
    return round(a / b, 6) if b else None


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "n/a"


def _result_row(key: str, out) -> dict:
    m = out.metrics
    err = out.error if (out.error or out.finish_reason == "error") else None
    if out.finish_reason == "error" and not err:
        err = "the engine could not run this prompt"
    return {"row_key": key, "summary": None if err else out.text.strip(), "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": int(out.num_cached_tokens or 0),
            "output_tokens": len(out.token_ids), "queue_s": m.queue_s, "prefill_s": m.prefill_s,
            "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s, "error": err}


class _Spill:
    """Random access by row number into the spill file (memory-mapped Arrow IPC)."""

    def __init__(self, path: Path):
        self._reader = pa.ipc.open_file(pa.memory_map(str(path)))
        sizes = [self._reader.get_batch(i).num_rows for i in range(self._reader.num_record_batches)]
        self._starts = np.cumsum([0] + sizes)
        self._cache: tuple[int, list] | None = None

    def row(self, i: int) -> tuple[str, int, list[int], int]:
        b = int(np.searchsorted(self._starts, i, side="right") - 1)
        if self._cache is None or self._cache[0] != b:
            batch = self._reader.get_batch(b)
            self._cache = (b, [batch.column(k) for k in range(4)])
        cols = self._cache[1]
        off = i - int(self._starts[b])
        return (cols[0][off].as_py(), cols[1][off].as_py(), cols[2][off].values.to_numpy().tolist(),
                cols[3][off].as_py())

    def close(self) -> None:
        self._reader = None


def run_jobs(jobs: list[Job], llm_factory=None, options: RunOptions | None = None, dry_run: bool = False,
             echo=print) -> list[RunReport]:
    return Runner(jobs, llm_factory, options, echo).run(dry_run=dry_run)
