"""What a run leaves besides its output: the run trace (``pipeline.run.trace``, for ``batchgen report``) and one row
per job in the run history (``pipeline.run.history``, for ``batchgen status``). Neither may fail a run: problems
become warnings on stderr.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from pipeline.job.job_file import Job
from pipeline.job.rows import hit_rate
from pipeline.job.state import RunState, manifest_path_for
from pipeline.prepare.job_run import JobRun
from pipeline.run import history
from pipeline.run.trace import RunTrace, prune_runs


def warn(message: str) -> None:
    print(f"batchgen: warning: {message}", file=sys.stderr)


class RunRecorder:
    """The trace and history rows of one model's run."""

    def __init__(self, record_history: bool, state_dir: str | None):
        self.record_history = record_history
        self.state_dir = state_dir                 # history's per-user state dir (None: its default)
        self.trace: RunTrace | None = None
        self._history_ids: dict[str, int] = {}     # job name -> history row id
        self.queued_s: float | None = None         # waited for the machine (pipeline.run.admission)
        self.engine_s: float | None = None         # engine loaded -> last step

    @property
    def trace_dir(self) -> Path | None:
        return self.trace.run_dir if self.trace is not None else None

    # ---- trace ----
    def start_trace(self, llm, state: RunState, start: float, prediction: dict | None) -> None:
        """A trace in ``<job dir>/runs/<run id>``; an unfinished earlier run's id is reused (resume)."""
        runs_dir = state.dir / "runs"
        marker = state.dir / "current_run"
        run_id = state.current_run() or ""
        if not run_id or not (runs_dir / run_id).is_dir():
            run_id = time.strftime("%Y%m%d-%H%M%S")
            n = 1
            while (runs_dir / run_id).exists():
                n += 1
                run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        try:
            self.trace = RunTrace(runs_dir / run_id, llm.info.to_dict(), llm.info.load_time_s,
                                  model_config=llm.model_config, start_time=start)
            self.trace.prediction = prediction
            marker.write_text(run_id)
        except (OSError, ValueError) as e:     # NOTE: a trace must never fail a run
            warn(f"no trace for this run ({e})")
            self.trace = None

    def flush(self) -> None:
        trace = self.trace
        if trace is None:
            return
        try:
            trace.write()
        except Exception as e:                  # NOTE: e.g. a full disk; the results matter, the trace less
            warn(f"cannot write the trace to {trace.run_dir} ({e}); the run goes on without it")
            self.trace = None

    def add_steps(self, steps: list, source: int) -> None:
        """Engine steps as the execution hands them over; ``source`` tells several engines (Ray replicas) apart."""
        if self.trace is not None:
            self.trace.add_steps(steps, source=source)

    def prune(self, state: RunState, jobs: list[Job]) -> None:
        """Keep the newest ``output.keep_runs`` traces (the smallest over the jobs sharing this job dir)."""
        if self.trace_dir is None:
            return
        try:
            prune_runs(state.dir / "runs", min(j.output.keep_runs for j in jobs), self.trace_dir)
        except OSError as e:                    # NOTE: pruning must never fail a finished run
            warn(f"could not prune old run traces ({e})")

    # ---- history ----
    def start_history(self, model: str, jobs: list[Job]) -> None:
        if not self.record_history:
            return
        for job in jobs:
            try:
                self._history_ids[job.name] = history.start_run(job.name, _config_summary(job, model),
                                                                state_dir=self.state_dir)
            except history.HistoryError as e:
                warn(f"run history not recorded: {e}")
                return

    def set_phase(self, phase: str, queued_s: float | None = None) -> None:
        """'queued' while waiting for the machine, then 'computing' (``batchgen status`` shows it)."""
        if queued_s is not None:
            self.queued_s = queued_s
        for run_id in self._history_ids.values():
            try:
                history.set_phase(run_id, phase, queued_s, state_dir=self.state_dir)
            except history.HistoryError as e:
                warn(f"run history not recorded: {e}")
                return

    def finish_history(self, runs: list[JobRun], status: str, error: str | None = None) -> None:
        by_name = {jr.job.name: jr for jr in runs}
        for name, run_id in self._history_ids.items():
            jr = by_name.get(name)
            this = (jr.manifest or {}).get("this_run", {}) if jr and not jr.up_to_date else {}
            try:
                history.finish_run(
                    run_id, status, rows_done=jr.computed if jr else 0, rows_skipped=jr.reused if jr else 0,
                    rows_failed=jr.row_errors if jr else 0, tokens_per_s=this.get("tokens_per_s"),
                    cache_hit_rate=hit_rate(jr.cached_tokens, jr.prompt_tokens) if jr else None,
                    trace_path=self.trace_dir,
                    report_path=manifest_path_for(jr.job.output.local_path) if jr and jr.manifest else None,
                    error=error, state_dir=self.state_dir, queued_s=self.queued_s, engine_s=self.engine_s)
            except history.HistoryError as e:
                warn(f"run history not recorded: {e}")
                return


def _config_summary(job: Job, model: str) -> dict:
    return {"model": model, "job_file": job.file, "input": job.input.path, "output": job.output.path,
            "schedule": job.schedule}
