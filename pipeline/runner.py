"""Run jobs: read -> plan -> engine -> write, resumable, one row out per row in.

    for each model: one engine (jobs sharing a model share its prefix cache)
      1. prepare  (pipeline/prepare.py) stream each job's input; render + tokenize rows; skip rows whose
                  row_key is committed; bad rows become error results at once; the rest go to a spill file
      2. plan     (pipeline/planner.py) prefix tree over all prompt heads of all jobs -> order, predicted
                  hits, providers; perf/predict.py prices it in seconds
      3. execute  (pipeline/feeder.py + here) keep a bounded window of requests in the engine (priority =
                  plan position), followers released with their provider, heads pinned while needed;
                  finished rows are committed as parts every couple of seconds
      4. assemble (pipeline/assemble.py) per job: keys (input order) join committed results -> output,
                  atomically; manifest
    trace and history: pipeline/recorder.py; the closing paragraph: pipeline/summary.py

A kill at any point loses at most the uncommitted rows; the next run recomputes only those.

Incremental runs fall out of the row keys: rows whose key has a committed result are reused, new or changed
rows are computed, and the output is rebuilt with one row per *current* input row. Rows that left the input are
dropped from the output, or kept at its end with ``output.keep_deleted_rows: true``.

Every run also leaves (see ``RunTrace`` / ``pipeline.history``):

    <job dir>/runs/<run id>/         requests.parquet/, steps.parquet/ (append-only part files), run.json
                                      -> ``batchgen report <dir>``
    <job dir>/current_run             the run id while a run is unfinished (a resume appends to its trace)
    history.sqlite (state dir of ``pipeline.history``)   one row per job per run -> ``batchgen status``

The trace of a run goes into the job dir (pipeline.state) of its first job (jobs on one model share one engine,
so one trace).
"""
from __future__ import annotations

import errno
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from engine import BatchgenError, Engine, EngineInfo
from perf.predict import Prediction, predict_plan
from pipeline.admission import MachineLock
from pipeline.assemble import assemble
from pipeline.errors import RunError
from pipeline.feeder import Feeder
from pipeline.io import InputError
from pipeline.job import Job
from pipeline.planner import Plan, make_plan, unplanned
from pipeline.prepare import JobRun, Spill, new_job_run, prepare
from pipeline.ray.driver import RayExecution, RayOptions
from pipeline.recorder import RunRecorder, warn
from pipeline.state import RunState
from pipeline.summary import summarize
from pipeline.validate import kv_pool_problem


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
    wait_for_machine: bool = True      # another run computing on this machine: queue behind it (False: fail)
    ray: "RayOptions | None" = None     # compute on Ray engine replicas (pipeline.ray.driver) instead of in-process


@dataclass
class RunReport:
    jobs: list[JobRun]
    plan: Plan | None
    wall_s: float
    engine_info: EngineInfo
    prediction: Prediction | None = None       # predicted engine time of the whole plan (perf.predict)
    engine_s: float | None = None              # achieved: from model loaded to last step
    summary: str = ""
    trace_dir: Path | None = None


def default_llm_factory(model: str, engine_args: dict) -> Engine:
    from engine import LLM
    return LLM(model=model, **engine_args)


def planning_llm_factory(model: str, engine_args: dict) -> Engine:
    """Dry runs (``batchgen plan``): settings, model shape and tokenizer only; no weights, no KV pool."""
    from engine import PlanningEngine
    from pipeline.validate import engine_setup
    # the setup validation resolved for these settings (cached per process): not resolved a second time
    return PlanningEngine(setup=engine_setup(model, json.dumps(engine_args, sort_keys=True, default=str)))


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


class Runner:
    def __init__(self, jobs: list[Job], llm_factory: Callable | None = None, options: RunOptions | None = None,
                 echo: Callable[[str], None] = print):
        self.jobs = jobs
        self.llm_factory = llm_factory          # None: the real engine, or the planning one for dry runs
        self.opts = options or RunOptions()
        self.echo = echo
        self._stop_reason: str | None = None      # set by SIGTERM / Ctrl-C (or stop_after_rows)
        self._rec: RunRecorder | None = None       # the current model's trace and history rows

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
        states = [RunState(job.output.local_path, job.name) for job in jobs]
        rec = self._rec = RunRecorder(self.opts.record_history, self.opts.state_dir)
        if not dry_run:
            rec.start_history(model, jobs)
        runs: list[JobRun] = []
        locked: list[RunState] = []
        old_handlers = {}
        llm = machine = None
        try:
            if not dry_run:
                # NOTE: the lock comes before the model load, so an overlapping run (cron firing while the
                # previous run still goes) exits at once instead of after loading the weights.
                for st in states:
                    st.lock()
                    locked.append(st)
                old_handlers = self._install_signal_handlers()
                machine = self._admit(jobs, rec)
            engine_args = merge_engine_args(jobs)
            try:
                # NOTE: on Ray the replicas load the model; this process only plans and commits.
                planning = dry_run or self.opts.ray is not None
                factory = self.llm_factory or (planning_llm_factory if planning else default_llm_factory)
                llm = factory(model, engine_args)
                if not isinstance(llm, Engine):
                    raise TypeError(f"llm_factory returned {type(llm).__name__}, which lacks the engine.Engine door")
            except BatchgenError as e:       # the engine's message, with the job files it comes from
                raise RunError(f"{', '.join(sorted({j.file for j in jobs}))}: cannot start model {model!r}"
                               f"{' with engine ' + json.dumps(engine_args) if engine_args else ''}: {e}") from None
            t_loaded = time.monotonic()
            info = llm.info
            _check_kv_pool(info, jobs)
            tok = llm.get_tokenizer()
            runs = [new_job_run(job, st, tok, info) for job, st in zip(jobs, states)]
            heads: list[tuple[int, ...]] = []
            head_index: dict[str, int] = {}
            req_job, req_local, req_group, req_len = [], [], [], []
            for j, jr in enumerate(runs):
                prepared = prepare(jr, info, heads, head_index, dry_run=dry_run, commit_rows=self.opts.commit_rows,
                                   fail_fast=self.opts.fail_fast)
                g, ln = prepared.groups, prepared.prompt_lens
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
            report = RunReport(runs, plan, 0.0, info, prediction=self._predict(llm, runs, plan, pjob))
            predicted = report.prediction.to_dict() if report.prediction else None
            if dry_run:
                report.wall_s = time.monotonic() - t0
                return report
            if self._stop_reason is not None:
                raise Interrupted(f"stopped ({self._stop_reason}) before any document was computed. Run the "
                                  "same command again to start.")
            work = plan.num_requests or any(jr.long_rows for jr in runs)   # long rows: maybe only reduces left
            if work:
                rec.start_trace(llm, states[0], t_loaded, predicted)
            report.trace_dir = rec.trace_dir
            distributed = None
            dist = None
            if self.opts.ray is not None and work:
                dist = RayExecution(self.opts.ray, model, engine_args, info, self.echo)
            try:
                if dist is not None:
                    dist.start()
                if plan.num_requests:
                    self._execute_spills(llm, runs, plan, req_job_a, req_local_a, heads, dist)
                self._reduce_long_rows(llm, runs, heads, block_size, dist)
            finally:
                if dist is not None:
                    dist.shutdown()
                    distributed = dist.summary()
                    if rec.trace is not None:
                        rec.trace.distributed = distributed
            if dist is not None:
                info = report.engine_info = dist.first_info or info
            engine_s = report.engine_s = rec.engine_s = time.monotonic() - t_loaded
            for jr in runs:
                assemble(jr, info, time.monotonic() - t0, engine_s, report.trace_dir, prediction=predicted,
                         distributed=distributed)
            rec.flush(llm)
            (states[0].dir / "current_run").unlink(missing_ok=True)
            report.wall_s = time.monotonic() - t0
            report.summary = summarize(report)
            rec.finish_history(runs, "ok")
            rec.prune(states[0], jobs)
            return report
        except Interrupted as e:
            rec.flush(llm)
            rec.finish_history(runs, "interrupted", str(e))
            raise
        except BatchgenError as e:
            rec.flush(llm)
            rec.finish_history(runs, "failed", str(e))
            raise
        except InputError as e:
            err = RunError(f"job input became unreadable during the run: {e}")
            rec.finish_history(runs, "failed", str(err))
            raise err from None
        except OSError as e:
            # NOTE: part files and the output are written atomically (whole or not at all), so after any
            # I/O fault what was committed is intact and a rerun resumes from it.
            what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            err = RunError(f"cannot write {e.filename or 'the run state'}: {what}. Rows committed so far are "
                           "kept; fix that and run the same command again to resume.")
            rec.finish_history(runs, "failed", str(err))
            raise err from None
        except KeyboardInterrupt:            # a second Ctrl-C: stopped at once; committed rows are kept
            rec.flush(llm)
            rec.finish_history(runs, "interrupted", "interrupted (Ctrl-C twice)")
            raise
        except BaseException as e:
            rec.flush(llm)
            rec.finish_history(runs, "failed", f"{type(e).__name__}: {e}")
            raise
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            if machine is not None:
                machine.release()
            for st in locked:
                st.unlock()

    def _admit(self, jobs: list[Job], rec: RunRecorder) -> MachineLock:
        """Wait for the machine (``pipeline.admission``): one run computes at a time, the others queue."""
        machine = MachineLock([j.name for j in jobs], self.opts.state_dir, wait=self.opts.wait_for_machine)

        def waiting(holder, ahead: int) -> None:
            rec.set_phase("queued")
            who = holder.describe() if holder else "another run"
            self.echo(f"waiting for the machine: batchgen run {who} is computing"
                      f"{f', {ahead} more queued ahead' if ahead else ''} (--no-wait fails instead)")

        queued = machine.acquire(on_wait=waiting)
        rec.set_phase("computing", round(queued, 3))
        return machine

    def _predict(self, llm: Engine, runs: list[JobRun], plan: Plan, pjob: np.ndarray) -> Prediction | None:
        """Predicted engine time of the plan; per job too (as if it ran alone), in ``jr.predicted_engine_s``."""
        max_tokens = np.asarray([runs[j].params.max_tokens for j in range(len(runs))], dtype=np.int64)[pjob]
        try:
            whole = predict_plan(llm.info, llm.model_config, plan, max_tokens)
            if whole is not None and len(runs) > 1:
                for j, jr in enumerate(runs):
                    m = pjob == j
                    if m.any():
                        jr.predicted_engine_s = predict_plan(llm.info, llm.model_config, plan.subset(m),
                                                             max_tokens[m]).engine_s
            elif whole is not None:
                runs[0].predicted_engine_s = whole.engine_s
            return whole
        except Exception as e:                  # NOTE: a prediction must never fail a run
            warn(f"no time prediction ({type(e).__name__}: {e})")
            return None

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

    def _execute_spills(self, llm: Engine, runs: list[JobRun], plan: Plan, req_job: np.ndarray,
                        req_local: np.ndarray, heads: list, dist: RayExecution | None = None) -> None:
        """The planned rows, read back from each job's spill file by plan position."""
        spills = [Spill(jr.state.scratch("spill.arrow")) if jr.spill_rows else None for jr in runs]
        tails = [{v: k for k, v in jr.tails.items()} for jr in runs]

        def item_of(p: int) -> tuple[int, str]:         # plan position -> (job index, row key)
            j, local = int(req_job[plan.order[p]]), int(req_local[plan.order[p]])
            return j, spills[j].row(local)[0]

        def prompt_of(p: int):
            j, local = int(req_job[plan.order[p]]), int(req_local[plan.order[p]])
            _, gid, doc_ids, tail, pidx = spills[j].row(local)
            return _prompt(runs[j], heads, tails[j], gid, doc_ids, tail, pidx)
        try:
            self._execute(llm, runs, plan, item_of, prompt_of, heads, req_job[plan.order], dist)
        finally:
            for s in spills:
                if s is not None:
                    s.close()

    def _reduce_long_rows(self, llm: Engine, runs: list[JobRun], heads: list, block_size: int,
                          dist: RayExecution | None) -> None:
        """``on_too_long: map_reduce``: reduce levels (pipeline.map_reduce), each one planned batch, until every
        long row has its final result."""
        tails = [{v: k for k, v in jr.tails.items()} for jr in runs]
        while True:
            stage = []                                   # (job index, key, group, doc ids, tail id, params id)
            for j, jr in enumerate(runs):
                if jr.long_rows:
                    stage += [(j, *req) for req in jr.next_reduce_requests(tails)]
            if not stage:
                return
            groups = np.asarray([g for _, _, g, _, _, _ in stage], dtype=np.int64)
            lens = np.asarray([len(heads[g]) + len(d) + len(tails[j][t]) for j, _, g, d, t, _ in stage],
                              dtype=np.int64)
            plan = make_plan(heads, groups, lens, block_size)

            def item_of(p: int, plan=plan, stage=stage) -> tuple[int, str]:
                it = stage[int(plan.order[p])]
                return it[0], it[1]

            def prompt_of(p: int, plan=plan, stage=stage):
                j, _, g, doc, t, pidx = stage[int(plan.order[p])]
                return _prompt(runs[j], heads, tails[j], g, doc, t, pidx)
            job_of = np.asarray([stage[int(i)][0] for i in plan.order], dtype=np.int64)
            self._execute(llm, runs, plan, item_of, prompt_of, heads, job_of, dist)

    def _execute(self, llm: Engine, runs: list[JobRun], plan: Plan, item_of: Callable, prompt_of: Callable,
                 heads: list, job_of: np.ndarray, dist: RayExecution | None = None) -> None:
        """Step 3: feed one plan through the engine (``Feeder``) or the Ray replicas (``dist``); commit finished
        rows every couple of seconds. ``item_of(p)``: (job index, key); ``prompt_of(p)``: (ids, params)."""
        from tqdm import tqdm

        n = plan.num_requests
        stream = sys.stderr
        bar = tqdm(total=n, file=stream, unit="doc", dynamic_ncols=True,
                   disable=self.opts.quiet or not stream.isatty())
        t_start = last_commit = time.monotonic()
        toks = cached = prompt = finished = 0

        def take(p: int, out) -> None:                  # a finished request: count it, queue its row
            nonlocal toks, cached, prompt, finished
            j, key = item_of(p)
            jr = runs[j]
            if self._rec.trace is not None:
                self._rec.trace.add_request(out, job=jr.job.name, row_id=key.rpartition("#")[0])
            res = jr.take(key, out)
            finished += 1
            if res["error"] and self.opts.fail_fast:
                raise RunError(f"job {jr.job.name!r}, row {key.rpartition('#')[0]}: {res['error']}. "
                               "Stopped because of --fail-fast; rows done so far are kept.")
            prompt += res["prompt_tokens"]
            cached += res["cached_tokens"]
            toks += res["prompt_tokens"] - res["cached_tokens"] + res["output_tokens"]
            bar.update(1)
            elapsed = max(time.monotonic() - t_start, 1e-9)
            bar.set_postfix_str(f"{toks / elapsed:,.0f} tok/s, hit {cached / max(prompt, 1):.0%}", refresh=False)

        def between_steps() -> bool:                    # commit when due; True: stop now
            nonlocal last_commit
            now = time.monotonic()
            if now - last_commit >= self.opts.commit_interval_s or \
                    any(len(jr.pending) >= self.opts.commit_rows for jr in runs):
                self._commit_all(runs)
                self._rec.flush(llm)
                last_commit = now
            if self._stop_reason is None and self.opts.stop_after_rows is not None \
                    and finished >= self.opts.stop_after_rows:
                self._stop_reason = "stop_after_rows"
            return self._stop_reason is not None         # in-flight rows are dropped; they rerun on resume

        clean_exit = False
        try:
            if dist is not None:
                max_tokens = np.asarray([jr.params.max_tokens for jr in runs], dtype=np.int64)[job_of]
                dist.run(plan, heads, prompt_of, max_tokens, take, self._rec.add_steps, between_steps)
            else:
                feeder = Feeder(plan, heads, prompt_of, window=max(1, self.opts.window_factor * llm.info.max_num_seqs),
                                max_open_groups=self.opts.max_open_groups)
                while not between_steps():
                    feeder.admit(llm)
                    if not feeder.in_flight:
                        break
                    for out in llm.step():
                        p = int(out.request_id)
                        feeder.on_finished(llm, p)
                        take(p, out)
            clean_exit = True
        finally:
            bar.close()
            # NOTE: on any exit path (stop, error, Ctrl-C twice) what finished is made durable.
            try:
                self._commit_all(runs)
            except RunError as e:
                if clean_exit:
                    raise
                warn(str(e))      # keep the error that stopped the run; this one is its echo
        if self._stop_reason is None and finished < n:
            raise RunError(f"internal error: {n - finished} documents were never scheduled; run again to "
                           "resume")
        if self._stop_reason is not None:
            done = sum(jr.computed for jr in runs)
            raise Interrupted(f"stopped ({self._stop_reason}) after {done} of {n} documents; finished rows are "
                              "committed. Run the same command again to resume where it stopped.")

    def _commit_all(self, runs: list[JobRun]) -> None:
        for jr in runs:
            if jr.pending:
                rows, jr.pending = jr.pending, []
                jr.state.commit(rows)

def _prompt(jr: JobRun, heads: list, tails: dict, group: int, doc_ids: list[int], tail: int, params: int):
    """(token ids, SamplingParams) of one request: its group's head, its document ids, its tail."""
    return list(heads[group]) + doc_ids + list(tails[tail]), jr.param_sets[params]


def _check_kv_pool(info: EngineInfo, jobs: list[Job]) -> None:
    """Impossible engine settings fail before compute (validation says the same, file by file)."""
    problem = kv_pool_problem(info.num_kv_blocks, info.block_size, info.max_num_seqs)
    if problem:
        raise RunError(f"{', '.join(sorted({j.file for j in jobs}))}: engine: {problem}")


def run_jobs(jobs: list[Job], llm_factory=None, options: RunOptions | None = None, dry_run: bool = False,
             echo=print) -> list[RunReport]:
    return Runner(jobs, llm_factory, options, echo).run(dry_run=dry_run)
