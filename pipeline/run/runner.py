"""Run jobs: read -> plan -> engine -> write, resumable, one row out per row in.

    for each model: one engine (jobs sharing a model share its prefix cache)
      1. prepare  (pipeline/prepare/prepare_jobs.py) stream each job's input; render + tokenize rows; skip rows whose
                  row_key is committed; bad rows become error results at once; the rest go to a spill file
      2. plan     (pipeline/plan/planner.py) prefix tree over all prompt heads of all jobs -> order, predicted
                  hits, providers; costmodel/predict.py prices it in seconds
      3. execute  (pipeline/execute/execution.py, here the loop) an Execution computes the plan: in this process
                  (a bounded window of requests in the engine, pipeline/execute/feeder.py) or on Ray replicas
                  (pipeline/execute/ray/); finished rows are committed as parts every couple of seconds. Long
                  documents (on_too_long: map_reduce, pipeline/prepare/long_docs.py) then run their reduce levels,
                  one planned batch each
      4. assemble (pipeline/assemble/output.py) per job: keys (input order) join committed results -> output,
                  atomically; manifest
    trace and history: pipeline/run/recorder.py; the closing paragraph: pipeline/assemble/summary.py

A kill at any point loses at most the uncommitted rows; the next run recomputes only those.

Incremental runs fall out of the row keys: rows whose key has a committed result are reused, new or changed
rows are computed, and the output is rebuilt with one row per *current* input row. Rows that left the input are
dropped from the output, or kept at its end with ``output.keep_deleted_rows: true``.

Every run also leaves (see ``RunTrace`` / ``pipeline.run.history``):

    <job dir>/runs/<run id>/         requests.parquet/, steps.parquet/ (append-only part files), run.json
                                      -> ``batchgen report <dir>``
    <job dir>/current_run             the run id while a run is unfinished (a resume appends to its trace)
    history.sqlite (state dir of ``pipeline.run.history``)   one row per job per run -> ``batchgen status``

The trace of a run goes into the job dir (pipeline.job.state) of its first job (jobs on one model share one engine,
so one trace).
"""
from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import pipeline.run.engine_format as engine_format
from costmodel.predict import Prediction, plan_pricer
from engine import BatchgenError, ConfigError, Engine, EngineConfig, EngineInfo
from pipeline.assemble.output import assemble
from pipeline.assemble.summary import summarize
from pipeline.execute.execution import Execution, LocalExecution
from pipeline.execute.ray.driver import RayExecution, RayOptions
from pipeline.job.job_file import Job
from pipeline.job.rows import ResultRow, RowRequest
from pipeline.job.state import RunState
from pipeline.plan.batch import Batch
from pipeline.plan.planner import Plan, make_plan, plan_sum
from pipeline.prepare.job_run import JobRun, new_job_run
from pipeline.prepare.prepare_jobs import prepare_jobs
from pipeline.problems import Interrupted, RunError
from pipeline.run.admission import MachineLock
from pipeline.run.engine_format import Recorded
from pipeline.run.eta import PlanEta
from pipeline.run.failure import failure_of
from pipeline.run.recorder import RunRecorder, warn
from pipeline.run.validate import engine_setup, kv_pool_problem


@dataclass
class RunOptions:
    quiet: bool = False
    fail_fast: bool = False
    commit_interval_s: float = 2.0     # commit finished rows at least this often ...
    commit_rows: int = 256             # ... or whenever this many are pending
    window_factor: int = 3             # requests kept in the engine = window_factor * max_num_seqs
    max_open_groups: int = 16          # shared heads pinned at once
    stop_after_rows: int | None = None  # testing: behave as if interrupted after this many rows
    record_history: bool = True        # one row per job per run in pipeline.run.history (``batchgen status``)
    state_dir: str | None = None       # history's state dir (None: $BATCHGEN_STATE_DIR or ~/.local/state/batchgen)
    order: str = "planned"             # planned | input | shuffled (the last two: baselines for benchmarks)
    wait_for_machine: bool = True      # another run computing on this machine: queue behind it (False: fail)
    ray: RayOptions | None = None      # compute on Ray engine replicas (execute/ray/driver.py), not in-process


@dataclass
class RunReport:
    jobs: list[JobRun]
    plan: Plan | None
    wall_s: float
    engine_info: EngineInfo
    prediction: Prediction | None = None       # predicted engine time of the whole plan (costmodel.predict)
    engine_s: float | None = None              # achieved: from model loaded to last step
    summary: str = ""
    trace_dir: Path | None = None


def default_llm_factory(config: EngineConfig) -> Engine:
    from engine import LLM  # NOTE: here, not at module level: engine.LLM imports torch and the model code
    return LLM(config=config)


def planning_llm_factory(config: EngineConfig) -> Engine:
    """Dry runs (``batchgen plan``): settings, model shape and tokenizer only; no weights, no KV pool."""
    from engine import PlanningEngine  # NOTE: lazy for the same reason (torch)
    # the setup validation resolved for these settings (cached per process): not resolved a second time
    return PlanningEngine(setup=engine_setup(config))


def engine_config_for(jobs: list[Job]) -> EngineConfig:
    """The one engine config of jobs on one model: the first job's, with what the others' engine: sections wrote
    where it kept the engine's default (two jobs writing the same key must agree)."""
    config, written = jobs[0].engine, set(jobs[0].engine_options)
    for job in jobs[1:]:
        for k in job.engine_options:
            v = getattr(job.engine, k)
            if k in written and getattr(config, k) != v:
                raise RunError(f"{job.file}: engine.{k} is {v!r} but another job with model {job.model!r} "
                               f"sets {getattr(config, k)!r}; jobs on one model share one engine, so their engine "
                               "settings must agree")
        fresh = {k: getattr(job.engine, k) for k in job.engine_options if k not in written}
        if fresh:
            config = dataclasses.replace(config, **fresh)
            written |= set(fresh)
    return config


class Runner:
    def __init__(self, jobs: list[Job], llm_factory: Callable[[EngineConfig], Engine] | None = None,
                 options: RunOptions | None = None, echo: Callable[[str], None] = print):
        self.jobs = jobs
        self.llm_factory = llm_factory          # None: the real engine, or the planning one for dry runs
        self.opts = options or RunOptions()
        self.echo = echo
        self._stop_reason: str | None = None      # set by SIGTERM / Ctrl-C (or stop_after_rows)
        self._rec: RunRecorder | None = None       # the current model's trace and history rows
        self._priced = None                         # (plan, prediction, max_tokens by position): the ETA's basis

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
            config = engine_config_for(jobs)
            llm, config, pinned_by = self._start_pinned(config, jobs, dry_run,
                                                        engine_format.recorded(states, config.model))
            t_loaded = time.monotonic()
            info = llm.info
            _check_kv_pool(info, jobs)
            tok = llm.get_tokenizer()
            runs = [new_job_run(job, st, tok, info) for job, st in zip(jobs, states)]
            batch, report = self._plan(llm, runs, dry_run)
            if dry_run:
                report.wall_s = time.monotonic() - t0
                return report
            if self._stop_reason is not None:
                raise Interrupted(f"stopped ({self._stop_reason}) before any document was computed. Run the "
                                  "same command again to start.")
            work = batch.plan.num_requests or any(jr.long_docs for jr in runs)   # long rows: maybe only reduces left
            exe = self._execution(llm, config, states, work)
            predicted = report.prediction.to_dict() if report.prediction else None
            if work:
                rec.start_trace(llm, states[0], t_loaded, predicted)
            report.trace_dir = rec.trace_dir
            distributed = self._compute(exe, batch, runs, llm)
            info = report.engine_info = engine_format.noted(exe.engine_info(), pinned_by)
            engine_s = report.engine_s = rec.engine_s = time.monotonic() - t_loaded
            for jr in runs:
                assemble(jr, info, time.monotonic() - t0, engine_s, report.trace_dir, prediction=predicted,
                         distributed=distributed)
            rec.flush()
            (states[0].dir / "current_run").unlink(missing_ok=True)
            report.wall_s = time.monotonic() - t0
            report.summary = summarize(report)
            rec.finish_history(runs, "ok")
            rec.prune(states[0], jobs)
            return report
        except BaseException as e:
            failure = failure_of(e)
            if failure.flush_trace:
                rec.flush()
            rec.finish_history(runs, failure.status, failure.message)
            if failure.raise_instead is None:
                raise
            raise failure.raise_instead from None
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            if machine is not None:
                machine.release()
            for st in locked:
                st.unlock()

    def _plan(self, llm: Engine, runs: list[JobRun], dry_run: bool) -> tuple[Batch, RunReport]:
        """Steps 1 and 2: prepare every job's rows and plan them as one batch, priced (``costmodel.predict``)."""
        batch = prepare_jobs(runs, llm.info, self.opts.order, dry_run=dry_run, commit_rows=self.opts.commit_rows,
                             fail_fast=self.opts.fail_fast)
        plan = batch.plan
        pjob = batch.job_by_position() if len(runs) > 1 else None      # one job: nothing per position
        for j, jr in enumerate(runs):
            mask = slice(None) if pjob is None else pjob == j
            jr.predicted_cached = plan_sum(plan.cached, mask)
            jr.planned_prompt_tokens = plan_sum(plan.prompt_len, mask)
        max_tokens = batch.max_tokens()
        prediction = self._predict(llm, runs, plan, pjob, max_tokens)
        self._priced = (plan, prediction, max_tokens)
        return batch, RunReport(runs, plan, 0.0, llm.info, prediction=prediction)

    def _execution(self, llm: Engine, config: EngineConfig, states: list[RunState], work: bool) -> Execution:
        """Where the plan computes: in this process, or on Ray replicas all loading the driver's format; the format
        is recorded for the jobs' later runs (``engine_format``)."""
        info, choice = llm.info, llm.info.format_choice
        exe: Execution = LocalExecution(llm, max(1, self.opts.window_factor * info.config.max_num_seqs),
                                        self.opts.max_open_groups)
        if self.opts.ray is not None and work:      # every replica computes in one format: the driver's
            config, choice = engine_format.for_replicas(config, info)
            exe = RayExecution(self.opts.ray, config, info, self.echo)
        if work:
            engine_format.store(states, choice, config.model)
        return exe

    def _compute(self, exe: Execution, batch: Batch, runs: list[JobRun], llm: Engine) -> dict | None:
        """Step 3: the planned batch, then the long rows' reduce levels; returns the distributed run's summary."""
        distributed = None
        try:
            exe.start()
            if batch.plan.num_requests:
                self._execute(exe, batch, runs, llm)
            for level in reduce_batches(runs, batch.heads, llm.info.config.block_size):
                self._execute(exe, level, runs, llm)
        finally:
            exe.close()
            distributed = exe.summary()
            if distributed is not None and self._rec.trace is not None:
                self._rec.trace.distributed = distributed
        return distributed

    def _start_pinned(self, config: EngineConfig, jobs: list[Job], dry_run: bool, earlier: Recorded | None
                      ) -> tuple[Engine, EngineConfig, Recorded | None]:
        """(engine, its config, the record it was pinned by): ``earlier`` is the format these jobs' rows were computed
        in so far, pinned where the jobs left it auto; one this machine cannot run any more is dropped, warned."""
        if earlier is not None:
            try:
                pinned = config.pinned(earlier.choice)
                llm = self._start_engine(pinned, jobs, dry_run)
                self.echo(f"engine format: {earlier.describe()}, as the jobs' earlier run computed ({earlier.path})")
                return llm, pinned, earlier
            except (RunError, ConfigError) as e:
                warn(f"the engine format an earlier run recorded ({earlier.describe()}; {earlier.path}) cannot run "
                     f"here ({e}); using this machine's choice: rows computed now may differ from earlier ones")
        return self._start_engine(config, jobs, dry_run), config, None

    def _start_engine(self, config: EngineConfig, jobs: list[Job], dry_run: bool) -> Engine:
        try:
            # NOTE: on Ray the replicas load the model; this process only plans and commits.
            planning = dry_run or self.opts.ray is not None
            factory = self.llm_factory or (planning_llm_factory if planning else default_llm_factory)
            llm = factory(config)
            if not isinstance(llm, Engine):
                raise TypeError(f"llm_factory returned {type(llm).__name__}, which lacks the engine.Engine door")
            return llm
        except BatchgenError as e:       # the engine's message, with the job files it comes from
            written = {k: v for k, v in config.to_dict().items() if any(k in job.engine_options for job in jobs)}
            raise RunError(f"{', '.join(sorted({j.file for j in jobs}))}: cannot start model {config.model!r}"
                           f"{' with engine ' + json.dumps(written) if written else ''}: {e}") from None

    def _admit(self, jobs: list[Job], rec: RunRecorder) -> MachineLock:
        """Wait for the machine (``pipeline.run.admission``): one run computes at a time, the others queue."""
        machine = MachineLock([j.name for j in jobs], self.opts.state_dir, wait=self.opts.wait_for_machine)

        def waiting(holder, ahead: int) -> None:
            rec.set_phase("queued")
            who = holder.describe() if holder else "another run"
            self.echo(f"waiting for the machine: batchgen run {who} is computing"
                      f"{f', {ahead} more queued ahead' if ahead else ''} (--no-wait fails instead)")

        queued = machine.acquire(on_wait=waiting)
        rec.set_phase("computing", round(queued, 3))
        return machine

    def _predict(self, llm: Engine, runs: list[JobRun], plan: Plan, pjob: np.ndarray | None,
                 max_tokens: np.ndarray) -> Prediction | None:
        """Predicted engine time of the plan (``max_tokens``: each position's); per job too (as if it ran alone),
        in ``jr.predicted_engine_s``."""
        try:
            price = plan_pricer(llm.info, llm.model_config)
            whole = price(plan, max_tokens) if price is not None else None
            if whole is not None and pjob is not None:
                for j, jr in enumerate(runs):
                    m = pjob == j
                    if m.any():
                        jr.predicted_engine_s = price(plan.subset(m), max_tokens[m]).engine_s
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

    def _execute(self, exe: Execution, batch: Batch, runs: list[JobRun], llm: Engine) -> None:
        """Step 3: compute one planned batch (``exe``); commit finished rows every couple of seconds; stop when
        asked (in-flight rows are dropped: they rerun on resume)."""
        from tqdm import tqdm  # NOTE: here, not at module level: tqdm's import is slow for CLI start-up

        n = batch.plan.num_requests + batch.num_copies      # rows: each computed request and its copies
        stream = sys.stderr
        bar = tqdm(total=n, file=stream, unit="doc", dynamic_ncols=True,
                   disable=self.opts.quiet or not stream.isatty())
        progress = _Progress(time.monotonic())
        priced = self._priced
        if priced is not None and priced[0] is batch.plan:    # the planned batch (reduce levels are not priced)
            progress.eta = PlanEta.of(priced[0], priced[1], priced[2], progress.t_start)
        last_commit = progress.t_start
        clean_exit = False
        try:
            exe.begin(batch)
            while not exe.done:
                now = time.monotonic()
                if now - last_commit >= self.opts.commit_interval_s or \
                        any(len(jr.pending) >= self.opts.commit_rows for jr in runs):
                    self._commit_all(runs)
                    self._rec.flush()
                    last_commit = now
                if self._stop_reason is None and self.opts.stop_after_rows is not None \
                        and progress.finished >= self.opts.stop_after_rows:
                    self._stop_reason = "stop_after_rows"
                if self._stop_reason is not None:
                    break
                for p, out in exe.poll():
                    q = batch.request(p)
                    jr = runs[q.job]
                    if self._rec.trace is not None:
                        self._rec.trace.add_request(out, job=jr.job.name, row_id=q.key.rpartition("#")[0])
                    row = jr.take(q.key, out, q.params)
                    if row.error and self.opts.fail_fast:
                        raise RunError(f"job {jr.job.name!r}, row {q.key.rpartition('#')[0]}: {row.error}. "
                                       "Stopped because of --fail-fast; rows done so far are kept.")
                    progress.add(row)
                    if progress.eta is not None:
                        progress.eta.finished(p)
                    copies = batch.copies_at(p)      # identical rows (prepare.dedup): the same result, not computed
                    for c in copies:
                        progress.add(runs[c.job].take(c.key, out, c.params, copy=True), copy=True)
                    bar.update(1 + len(copies))
                    bar.set_postfix_str(progress.postfix(), refresh=False)
                for steps, source in exe.steps():
                    self._rec.add_steps(steps, source)
            clean_exit = True
        finally:
            bar.close()
            batch.close()
            for steps, source in exe.steps():     # the steps of outputs that stopped the loop are traced too
                self._rec.add_steps(steps, source)
            # NOTE: on any exit path (stop, error, Ctrl-C twice) what finished is made durable.
            try:
                self._commit_all(runs)
            except RunError as e:
                if clean_exit:
                    raise
                warn(str(e))      # keep the error that stopped the run; this one is its echo
        if self._stop_reason is None and progress.finished < n:
            raise RunError(f"internal error: {n - progress.finished} documents were never scheduled; run again "
                           "to resume")
        if self._stop_reason is not None:
            done = sum(jr.computed for jr in runs)
            raise Interrupted(f"stopped ({self._stop_reason}) after {done} of {n} documents; finished rows are "
                              "committed. Run the same command again to resume where it stopped.")

    def _commit_all(self, runs: list[JobRun]) -> None:
        for jr in runs:
            jr.commit()


def reduce_batches(runs: list[JobRun], heads: list, block_size: int) -> Iterator[Batch]:
    """The reduce levels of every job's long rows (on_too_long: map_reduce), each one planned batch; the next level
    is made when the caller asks for it (after computing this one), until every long row has its final result."""
    while True:
        stage: list[RowRequest] = []
        for j, jr in enumerate(runs):
            if jr.long_docs:
                stage += jr.reduce_requests(j)
        if not stage:
            return
        groups = np.asarray([q.group for q in stage], dtype=np.int32)
        lens = np.asarray([len(heads[q.group]) + len(q.doc_ids) + len(runs[q.job].prompts.tail_ids[q.tail])
                           for q in stage], dtype=np.int32)
        yield Batch(make_plan(heads, groups, lens, block_size), heads, stage,
                    np.asarray([q.job for q in stage], dtype=np.int32), [jr.prompts for jr in runs])


@dataclass
class _Progress:
    """Counts for the progress bar of one batch."""
    t_start: float
    finished: int = 0
    prompt: int = 0
    cached: int = 0
    toks: int = 0
    eta: PlanEta | None = None      # time left by the plan's prediction (None: not priced)

    def add(self, row: ResultRow, copy: bool = False) -> None:
        self.finished += 1
        if copy:            # nothing computed for it
            return
        self.prompt += row.prompt_tokens
        self.cached += row.cached_tokens
        self.toks += row.prompt_tokens - row.cached_tokens + row.output_tokens

    def postfix(self) -> str:
        elapsed = max(time.monotonic() - self.t_start, 1e-9)
        text = f"{self.toks / elapsed:,.0f} tok/s, hit {self.cached / max(self.prompt, 1):.0%}"
        return text + (f", {self.eta.text(time.monotonic())} (plan)" if self.eta is not None else "")


def _check_kv_pool(info: EngineInfo, jobs: list[Job]) -> None:
    """Impossible engine settings fail before compute (validation says the same, file by file)."""
    problem = kv_pool_problem(info.num_kv_blocks, info.config.block_size, info.config.max_num_seqs)
    if problem:
        raise RunError(f"{', '.join(sorted({j.file for j in jobs}))}: engine: {problem}")


def run_jobs(jobs: list[Job], llm_factory=None, options: RunOptions | None = None, dry_run: bool = False,
             echo=print) -> list[RunReport]:
    return Runner(jobs, llm_factory, options, echo).run(dry_run=dry_run)
