"""The pipeline's own memory against rows, with an engine **test double** (no model computes).

    python -m bench.pipeline_double DIR/job.yaml          # a bench/make_rows.py job; prints peak RSS at the end
    python -m bench.pipeline_double DIR/job.yaml --ray    # on Ray: 2 replicas, each with the double; the driver's
                                                          # peak RSS (this process: plans, feeds, commits)

``EngineDouble`` answers every request in the step after it is added with a fixed short text ("summary-<len>"),
keeps nothing per request once answered, and takes its tokenizer, settings and model shape from the job's real
model without loading weights (``engine.PlanningEngine``). So the run's memory is the pipeline's: reading,
tokenizing, planning, feeding, committing parts, assembling the output — what docs/perf/plan-memory.md measures
at 100k and 1M rows. It is a double: its outputs mean nothing.
"""
from __future__ import annotations

import resource
import sys
import time

from engine import PlanningEngine
from engine.outputs import RequestMetrics, RequestOutput, StepStats


class EngineDouble:
    def __init__(self, config):
        self._planning = PlanningEngine(config.model, **{k: v for k, v in config.to_dict().items()
                                                         if k in ("max_num_seqs", "max_model_len", "block_size")})
        self.info, self.config = self._planning.info, self._planning.config
        self.model_config = self._planning.model_config
        self._waiting: list[tuple[str, int, int]] = []
        self._steps = 0

    def get_tokenizer(self):
        return self._planning.get_tokenizer()

    def add_request(self, request_id, prompt, params, priority=0):
        self._waiting.append((request_id, len(prompt), min(params.max_tokens, 3)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def num_unfinished_requests(self) -> int:
        return len(self._waiting)

    def abort_request(self, request_id) -> None:
        self._waiting = [w for w in self._waiting if w[0] != request_id]

    def pin_prefix(self, token_ids):
        return None

    def unpin_prefix(self, pin_id) -> None:
        pass

    def step(self):
        now = time.monotonic()
        self._steps += 1
        done, self._waiting = self._waiting, []
        outs = []
        for rid, n, k in done:
            m = RequestMetrics(arrival_time=now, first_scheduled_time=now, prefill_start_time=now,
                               prefill_end_time=now, first_token_time=now, token_times=[now] * k, finish_time=now)
            outs.append(RequestOutput(rid, None, [0] * n, f"summary-{n}", list(range(k)), "length", 0, m))
        stats = StepStats(self._steps, now, time.monotonic(), sum(n for _, n, _ in done), 0, len(done), 0,
                          len(done), 0, 0, 1, sum(n for _, n, _ in done), 0, 0, len(done))
        return outs, stats


def main(argv=None) -> int:
    import argparse
    import os

    from pipeline.execute.ray.driver import RayOptions
    from pipeline.job.job_file import load_job
    from pipeline.run.runner import RunOptions, run_jobs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--ray", action="store_true", help="two local Ray replicas, each with the double")
    a = ap.parse_args(argv)
    job = load_job(a.job)
    ray = None
    if a.ray:
        os.environ["BATCHGEN_RAY_ENGINE"] = "bench.pipeline_double:EngineDouble"
        ray = RayOptions(address="local", replicas=2, num_cpus=1)
    t = time.monotonic()
    [report] = run_jobs([job], llm_factory=EngineDouble, options=RunOptions(quiet=True, record_history=False, ray=ray))
    print(f"{report.jobs[0].num_rows} rows in {time.monotonic() - t:.1f} s through the pipeline with the engine "
          f"double{' on 2 Ray replicas' if a.ray else ''}; peak RSS {_peak_mb():.0f} MB"
          f"{' (the driver)' if a.ray else ''}")
    return 0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


if __name__ == "__main__":
    sys.exit(main())
