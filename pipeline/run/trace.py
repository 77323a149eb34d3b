"""Per-run traces: what each request and each engine step did, and how the run's time splits into phases.

A run directory gets two Parquet datasets and a JSON file; each ``write()`` (periodic, so a long run flushes
as it goes) appends one part file to each dataset and never rewrites earlier ones, so a million-row run costs
O(rows), not O(rows^2):

    requests.parquet/  one row per finished request: timestamps, token counts, each token's time
    steps.parquet/     one row per engine step (StepStats) with its duration
    run.json           model info and config, calibration used, phases (load / setup / warm-up / steady / wall)

``pq.read_table("requests.parquet")`` reads a dataset directory whole (runs written before this layout have a
single file there, which reads the same way).

Times are seconds relative to the run start (the ``RunTrace``'s creation). A run resumed in the same directory
appends a new session whose times continue after the previous sessions' wall time, so one axis covers all.

    trace = RunTrace(run_dir, llm.info.to_dict(), llm.info.load_time_s, model_config=llm.model_config)
    outputs, stats = llm.step()
    for out in outputs: trace.add_request(out, job="summaries", row_id=row_id)
    trace.add_steps([stats])            # each step's stats as llm.step() returns them (seen ones are skipped)
    trace.write()                       # periodically, and once at the end
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from engine import RequestOutput, StepStats
from pipeline.run.trace_meta import checked_meta

log = logging.getLogger("batchgen.pipeline")

REQUESTS_FILE, STEPS_FILE, RUN_FILE = "requests.parquet", "steps.parquet", "run.json"
WARMUP_STEPS = 1   # the first step of a session pays for allocation, kernel selection, any compilation

REQUEST_SCHEMA = pa.schema([
    ("session", pa.int32()), ("request_id", pa.string()), ("job", pa.string()), ("row_id", pa.string()),
    ("arrival", pa.float64()), ("first_scheduled", pa.float64()), ("prefill_start", pa.float64()),
    ("prefill_end", pa.float64()), ("first_token", pa.float64()), ("finish", pa.float64()),
    ("token_times", pa.list_(pa.float64())),
    ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
    ("output_tokens", pa.int64()), ("num_preemptions", pa.int64()),
    ("finish_reason", pa.string()), ("error", pa.string()),
    ("queue_s", pa.float64()), ("ttft_s", pa.float64()), ("tpot_s", pa.float64()), ("e2e_s", pa.float64()),
    # structured outputs (engine/structured): tokens the grammar forced, full masks applied, time masking
    ("forced_tokens", pa.int64()), ("masks_applied", pa.int64()), ("mask_s", pa.float64()),
])

_STEP_INT_FIELDS = [f.name for f in dataclasses.fields(StepStats) if f.name not in ("start_time", "end_time")]
STEP_SCHEMA = pa.schema([("session", pa.int32())] + [(n, pa.int64()) for n in _STEP_INT_FIELDS]
                        + [("start", pa.float64()), ("end", pa.float64()), ("duration_s", pa.float64())])


class RunTrace:
    """Collects request and step records of one run and writes them into ``run_dir``.

    Args:
        run_dir: where the trace files go (created if needed).
        model_info: ``llm.info.to_dict()`` (name, identity, dtype, device, ...; stored as run.json's model_info).
        load_time_s: ``llm.info.load_time_s``.
        model_config: ``llm.model_config``; stored so the report can count FLOPs and bytes.
        calibration: an ``costmodel.calibrate.Calibration``; None -> the cached one for the model's device/dtype.
        start_time: ``time.monotonic()`` of the run start; None -> now.
    """

    def __init__(self, run_dir: str | Path, model_info: dict, load_time_s: float, *,
                 model_config=None, calibration=None, start_time: float | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_info = dict(model_info)
        self.load_time_s = float(load_time_s)
        self.model_config = model_config
        self.calibration = calibration
        self.prediction: dict | None = None     # costmodel.predict for this run's plan, when there is one
        self.start = time.monotonic() if start_time is None else start_time
        self.started_at_unix = time.time() - (time.monotonic() - self.start)
        prev = checked_meta(_read_json(self.run_dir / RUN_FILE), self.run_dir / RUN_FILE)
        self._prev_prediction = prev.get("prediction") if prev else None     # a resumed run keeps the first
        self._prev_sessions: list[dict] = list(prev.get("sessions", [])) if prev else []
        self.session = len(self._prev_sessions)
        self.offset = sum(s.get("wall_s", 0.0) for s in self._prev_sessions)
        self._requests: list[dict] = []
        self._steps: list[dict] = []
        self._last_step_start: dict[int, float] = {}      # per source
        self.distributed: dict | None = None     # a Ray run: replicas, prefix prefills (pipeline.execute.ray.driver)
        self._num_requests = self._num_steps = 0
        self._first_step: tuple[float, float] | None = None   # (start, end) monotonic
        self._warmup_end: float | None = None
        self._last_step_end: float | None = None

    def _rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.start + self.offset

    # ---- collecting ------------------------------------------------------------------------------------
    def add_request(self, output: RequestOutput, job: str = "", row_id: Any = None) -> None:
        m = output.metrics
        prompt = len(output.prompt_token_ids)
        cached = min(output.num_cached_tokens, prompt)
        self._requests.append({
            "session": self.session, "request_id": output.request_id, "job": job,
            "row_id": None if row_id is None else str(row_id),
            "arrival": self._rel(m.arrival_time), "first_scheduled": self._rel(m.first_scheduled_time),
            "prefill_start": self._rel(m.prefill_start_time), "prefill_end": self._rel(m.prefill_end_time),
            "first_token": self._rel(m.first_token_time), "finish": self._rel(m.finish_time),
            "token_times": [self._rel(t) for t in m.token_times],
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "output_tokens": len(output.token_ids), "num_preemptions": m.num_preemptions,
            "finish_reason": output.finish_reason, "error": output.error,
            "queue_s": m.queue_s, "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s,
            "forced_tokens": m.num_forced_tokens, "masks_applied": m.num_masks_applied, "mask_s": m.mask_time_s,
        })
        self._num_requests += 1

    def add_steps(self, step_stats: Iterable[StepStats], source: int = 0) -> None:
        """Record engine steps; steps already recorded (by start time) are skipped.
        ``source``: which engine, when several (Ray replicas) feed one trace."""
        for s in step_stats:
            if s.start_time <= self._last_step_start.get(source, float("-inf")):
                continue
            self._last_step_start[source] = s.start_time
            if self._first_step is None:
                self._first_step = (s.start_time, s.end_time)
            if self._num_steps < WARMUP_STEPS:
                self._warmup_end = s.end_time
            self._last_step_end = max(self._last_step_end or s.end_time, s.end_time)
            row = {n: getattr(s, n) for n in _STEP_INT_FIELDS}
            row.update(session=self.session, start=self._rel(s.start_time), end=self._rel(s.end_time),
                       duration_s=s.end_time - s.start_time)
            self._steps.append(row)
            self._num_steps += 1

    # ---- writing ---------------------------------------------------------------------------------------
    def phases(self, now: float | None = None) -> dict:
        """This session's phases in seconds: load, setup (start -> first step), warm-up, steady state, wall."""
        now = time.monotonic() if now is None else now
        setup = warmup = steady = 0.0
        if self._first_step is not None:
            setup = self._first_step[0] - self.start
            warmup = self._warmup_end - self._first_step[0]
            steady = self._last_step_end - self._warmup_end
        return {"load_s": self.load_time_s, "setup_s": setup, "warmup_s": warmup, "warmup_steps": WARMUP_STEPS,
                "steady_s": steady, "wall_s": now - self.start}

    def write(self, now: float | None = None) -> Path:
        """Flush buffered records (appending to the files already written) and rewrite run.json.

        ``now``: ``time.monotonic()`` taken as the end of the run so far (default: now).
        """
        _append_parquet(self.run_dir / REQUESTS_FILE, self._requests, REQUEST_SCHEMA)
        _append_parquet(self.run_dir / STEPS_FILE, self._steps, STEP_SCHEMA)
        self._requests, self._steps = [], []
        session = {"session": self.session, "offset_s": self.offset, "started_at_unix": self.started_at_unix,
                   "num_requests": self._num_requests, "num_steps": self._num_steps, **self.phases(now)}
        sessions = self._prev_sessions + [session]
        totals = {k: sum(s[k] for s in sessions) for k in ("load_s", "setup_s", "warmup_s", "steady_s", "wall_s")}
        doc = {"version": 1, "model_info": self.model_info,
               "model_config": _config_dict(self.model_config),
               "calibration": self._calibration_dict(), "prediction": self._prev_prediction or self.prediction,
               "phases": totals, "sessions": sessions,
               "num_requests": sum(s["num_requests"] for s in sessions),
               "num_steps": sum(s["num_steps"] for s in sessions), "written_at_unix": time.time()}
        if self.distributed is not None:
            doc["distributed"] = self.distributed
        _write_atomic(self.run_dir / RUN_FILE, json.dumps(doc, indent=2, default=str))
        return self.run_dir

    def _calibration_dict(self) -> dict | None:
        cal = self.calibration
        if cal is None:
            try:
                from costmodel.calibrate import load_calibration
                cal = load_calibration(self.model_info.get("device", "cpu"), self.model_info.get("dtype", "bfloat16"))
            except Exception:   # NOTE: a trace must never fail a run; no calibration just means no roofline
                cal = None
            self.calibration = cal
        if cal is None:
            return None
        return cal.to_dict() if hasattr(cal, "to_dict") else dict(cal)


# ---- reading -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class TraceData:
    """A run directory read back: the two tables as column dicts (lists), and run.json."""
    path: Path
    requests: dict[str, list]
    steps: dict[str, list]
    meta: dict

    @property
    def num_requests(self) -> int:
        return len(self.requests.get("request_id", []))

    @property
    def num_steps(self) -> int:
        return len(self.steps.get("step", []))


def prune_runs(runs_dir: str | Path, keep: int, current: str | Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` most recently written run directories; never ``current``.

    Traces grow with the rows (each request's token times), so a daily cron job would otherwise fill the disk.
    Recency is the last write of run.json (every trace write updates it; a resumed run counts as recent), not
    the name: run ids are second-resolution and reused once deleted. Returns what was removed.
    """
    import shutil

    def last_write(p: Path) -> tuple[int, str]:
        f = p / RUN_FILE
        return ((f if f.exists() else p).stat().st_mtime_ns, p.name)

    runs = sorted((p for p in Path(runs_dir).iterdir() if p.is_dir()), key=last_write) \
        if Path(runs_dir).is_dir() else []
    cur = Path(current).resolve() if current is not None else None
    old = [p for p in runs[:max(len(runs) - keep, 0)] if p.resolve() != cur]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def read_run(run_dir: str | Path) -> TraceData:
    """Read a run directory written by ``RunTrace``; raise FileNotFoundError naming what is missing."""
    p = Path(run_dir)
    if not (p / RUN_FILE).is_file():
        raise FileNotFoundError(f"{p}: no {RUN_FILE} (not a run directory written by a batchgen run)")
    meta = checked_meta(_read_json(p / RUN_FILE), p / RUN_FILE)
    requests = _read_table(p / REQUESTS_FILE, REQUEST_SCHEMA)
    steps = _read_table(p / STEPS_FILE, STEP_SCHEMA)
    return TraceData(p, requests, steps, meta)


def check_trace(run: TraceData) -> list[str]:
    """Consistency problems between the request and step traces (empty when consistent).

    - every output token was emitted by some step: sum(output_tokens) == sum(num_emitted_tokens) (traces from
      before speculation: num_sampled);
    - without preemptions, every decode input is an earlier output or a draft: sum(num_decode_tokens) - rejected
      drafts == sum(output - 1), exact without speculation, within one token per request with it (a stop on an
      accepted draft feeds back the request's last token);
    - cached + computed == prompt tokens; TTFT >= queue wait; token times are ordered.
    """
    r, s = run.requests, run.steps
    problems = []
    emitted = s.get("num_emitted_tokens")
    old_trace = emitted is None or not any(emitted) and any(s["num_sampled"])
    outputs, sampled = sum(r["output_tokens"]), sum(s["num_sampled"] if old_trace else emitted)
    # Requests still unfinished when the trace was written have sampled tokens but no request row yet.
    if outputs != sampled:
        problems.append(f"output tokens in requests ({outputs}) != tokens sampled by steps ({sampled}); "
                        "requests unfinished or aborted when the trace was written have no row yet")
    if not any(r["num_preemptions"]) and not any(s["num_preemptions"]):
        want = sum(max(o - 1, 0) for o in r["output_tokens"])
        drafts = s.get("num_draft_tokens") or []
        rejected = sum(d or 0 for d in drafts) - sum(a or 0 for a in (s.get("num_accepted_tokens") or []))
        got = sum(s["num_decode_tokens"]) - rejected
        slack = len(r["output_tokens"]) if any(drafts) else 0
        if not want <= got <= want + slack:
            problems.append(f"decode tokens in steps ({got}) != sum of (output tokens - 1) over requests ({want})")
    for i, rid in enumerate(r["request_id"]):
        if r["cached_tokens"][i] + r["computed_tokens"][i] != r["prompt_tokens"][i]:
            problems.append(f"{rid}: cached + computed != prompt tokens")
        q, ttft = r["queue_s"][i], r["ttft_s"][i]
        if q is not None and ttft is not None and ttft + 1e-9 < q:
            problems.append(f"{rid}: TTFT {ttft:.4f}s < queue wait {q:.4f}s")
        tt = r["token_times"][i] or []
        if any(b < a for a, b in zip(tt, tt[1:])):
            problems.append(f"{rid}: token times go backwards")
        if len(tt) != r["output_tokens"][i]:
            problems.append(f"{rid}: {len(tt)} token times for {r['output_tokens'][i]} output tokens")
    return problems


# ---- helpers -----------------------------------------------------------------------------------------
def _config_dict(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return config
    from costmodel.flops import to_dict
    return to_dict(config)


def _read_json(path: Path):
    """The parsed file; None when it is missing or unreadable (warned about: a damaged file of ours)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("run trace %s is unreadable (%s); ignored", path, e)
        return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _append_parquet(path: Path, rows: list[dict], schema: pa.Schema) -> None:
    """Append rows as the next part file of the dataset directory ``path`` (created, maybe empty, if absent).

    Parts are written under a dot name (readers skip those) and renamed, so a reader never sees half a part.
    A single file at ``path`` (the layout of older runs, e.g. a resumed one) becomes the first part.
    """
    if path.is_file():
        old = path.with_name(f".{path.name}.old")
        path.replace(old)
        path.mkdir()
        old.replace(path / "part-00000.parquet")
    path.mkdir(parents=True, exist_ok=True)
    if not rows:
        return
    n = sum(1 for _ in path.glob("part-*.parquet"))
    tmp = path / f".part-{n:05d}.tmp"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
    tmp.replace(path / f"part-{n:05d}.parquet")


def _read_table(path: Path, schema: pa.Schema) -> dict[str, list]:
    if not path.exists() or (path.is_dir() and not any(path.glob("part-*.parquet"))):
        return {name: [] for name in schema.names}
    return pq.read_table(path, schema=schema).to_pydict()
