"""The server's worker: validates queued batches, runs them as batchgen runs, finalizes them.

A batch is a batchgen run: its lines are split by the model they name (``body.model``: an alias of the server's
config, or a model spec it lists; none: the default model), each model's lines become one job (an OpenAI Batch
file in, an OpenAI Batch file out), and every batch in progress is computed by one ``batchgen submit`` of all their
jobs together, so the planner shares prefixes across batches and each model loads once. The run is a child process:
cancelling or expiring a batch stops it with SIGTERM (finished rows are committed, as for any run), and if the server
dies the child dies with it (Linux: PR_SET_PDEATHSIG); a restarted server runs the same jobs again, which resume from
their committed rows, so every line is computed once. Finished: the lines with a response go to the output file,
the failed ones to the error file, in input order.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from pipeline.io.openai_batch import read_output, response_line
from pipeline.io.tables import write_bytes_atomic
from pipeline.job.state import job_dir_for
from pipeline.serve.store import Store

log = logging.getLogger("batchgen.serve")

MAX_LINES = 50_000                 # per input file, as OpenAI
MAX_BYTES = 200 * 1024 * 1024
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class ServeConfig:
    """What a server may run: ``models`` alias -> {model: spec, engine: {...}} (a request's ``model`` is an alias or
    one of the specs), the default for requests without one, generation defaults, and its timings."""
    models: dict[str, dict] = field(default_factory=lambda: {"gemma-3-270m": {"model": "gemma-3-270m"}})
    default_model: str | None = None
    generation: dict = field(default_factory=lambda: {"max_tokens": 256, "temperature": 0.0})
    window_s: float = 24 * 3600        # completion_window 24h
    commit_every_s: float = 2.0
    poll_s: float = 0.5
    ray_address: str | None = None     # compute on Ray engine replicas ("": a local Ray or $RAY_ADDRESS; None: here)
    replicas: int | None = None        # with Ray: engine replicas (``batchgen submit --replicas``)

    def submit_command(self, jobs: list[str]) -> list[str]:
        """The ``batchgen submit`` of ``jobs`` a batch run is (with ``--ray`` where the server computes on Ray)."""
        ray = [] if self.ray_address is None else [f"--ray={self.ray_address}"] if self.ray_address else ["--ray"]
        if ray and self.replicas:
            ray += ["--replicas", str(self.replicas)]
        return [sys.executable, "-m", "batchgen", "submit", "-q", "--commit-every", str(self.commit_every_s), *ray,
                "--", *jobs]

    def resolve(self, name: str | None) -> str | None:
        """The alias a request's ``model`` names (None: not served here)."""
        if not name:
            return self.default_model or next(iter(self.models))
        if name in self.models:
            return name
        return next((a for a, m in self.models.items() if m["model"] == name), None)


def validate_lines(path: Path, endpoint: str) -> tuple[list[tuple[int, str, dict, str]], list[dict]]:
    """The file's requests as (line number, custom_id, request, raw line), and the errors that fail the batch (as
    OpenAI's ``BatchError``: code, message, line, param)."""
    reqs, errors, seen = [], [], set()

    def err(code, message, line, param=None):
        if len(errors) < 100:
            errors.append({"code": code, "message": message, "line": line, "param": param})
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                req = json.loads(text)
            except ValueError:
                err("invalid_json_line", f"line {lineno} is not valid JSON", lineno)
                continue
            if not isinstance(req, dict):
                err("invalid_json_line", f"line {lineno} is not a JSON object", lineno)
                continue
            cid = req.get("custom_id")
            if not isinstance(cid, str) or not cid:
                err("missing_required_parameter", f"line {lineno}: custom_id is missing", lineno, "custom_id")
            elif cid in seen:
                err("duplicate_custom_id", f"line {lineno}: the custom_id {cid!r} is used by an earlier line", lineno,
                    "custom_id")
            else:
                seen.add(cid)
            if req.get("url") != endpoint:
                err("mismatched_endpoint", f"line {lineno}: url {req.get('url')!r} differs from the batch's endpoint "
                    f"{endpoint}", lineno, "url")
            if req.get("method", "POST") != "POST":
                err("invalid_request", f"line {lineno}: method must be POST", lineno, "method")
            if not isinstance(req.get("body"), dict):
                err("invalid_request", f"line {lineno}: body must be a JSON object", lineno, "body")
            reqs.append((lineno, cid, req, text.rstrip("\n")))
    if not reqs and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "line": None,
                       "param": None})
    if len(reqs) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"{len(reqs)} requests; at most {MAX_LINES} a batch",
                       "line": None, "param": None})
    return reqs, errors


def _die_with_parent() -> None:
    """In the child: SIGKILL when the server dies (Linux), so a killed server leaves no run computing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except OSError:
        pass


class Worker:
    def __init__(self, store: Store, config: ServeConfig):
        self.store, self.config = store, config
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._part_rows: dict[str, int] = {}          # committed part file -> its rows (``_committed``)

    # ---- the loop -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchgen-serve-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:       # NOTE: one bad batch must not stop the server's worker
                log.exception("serve worker")
            self._stop.wait(self.config.poll_s)

    def tick(self) -> None:
        """One round: settle cancels and expiries, validate what is new, run what is in progress."""
        self._settle(running=())
        running = self.store.batches_with("in_progress")
        if running and not self._stop.is_set():
            self._run(running)

    # ---- validation -----------------------------------------------------------------------------------------
    def _validate(self, b: dict) -> None:
        try:
            src = self.store.file_path(b["input_file_id"])
        except KeyError:
            src = None
        if src is None or not src.is_file():
            self.store.update_batch(b["id"], "failed", "failed_at", errors=[{
                "code": "invalid_file", "message": f"input file {b['input_file_id']} not found", "line": None,
                "param": "input_file_id"}])
            return
        reqs, errors = validate_lines(src, b["endpoint"])
        if errors:
            self.store.update_batch(b["id"], "failed", "failed_at", errors=errors)
            return
        bdir = self.store.batch_dir(b["id"])
        bdir.mkdir(parents=True, exist_ok=True)
        by_model: dict[str, list[str]] = {}
        unknown = {}
        for lineno, cid, req, raw in reqs:
            alias = self.config.resolve(req["body"].get("model"))
            if alias is None:
                unknown[cid] = (f"line {lineno}: the model {req['body'].get('model')!r} is not served here (served: "
                                f"{', '.join(self.config.models)})")
            else:
                by_model.setdefault(alias, []).append(raw)
        jobs = []
        for k, (alias, lines) in enumerate(by_model.items()):
            inp, out, job = bdir / f"in-{k}.jsonl", bdir / f"out-{k}.jsonl", bdir / f"job-{k}.yaml"
            inp.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
            spec = self.config.models[alias]
            doc = {"name": f"{b['id']}-{k}", "model": spec["model"],
                   "input": {"path": str(inp), "format": "openai_batch"},
                   "prompt": {"on_too_long": "truncate_document"}, "generation": dict(self.config.generation),
                   "output": {"path": str(out), "format": "openai_batch"}}
            if spec.get("engine"):
                doc["engine"] = dict(spec["engine"])
            job.write_text(yaml.safe_dump(doc, sort_keys=False))
            jobs.append({"job": str(job), "out": str(out), "model": alias})
        (bdir / "plan.json").write_text(json.dumps({"order": [r[1] for r in reqs], "unknown": unknown,
                                                   "jobs": jobs}))
        self.store.update_batch(b["id"], "in_progress", "in_progress_at", total=len(reqs))

    # ---- running ----------------------------------------------------------------------------------------------
    def _plan(self, batch_id: str) -> dict:
        return json.loads((self.store.batch_dir(batch_id) / "plan.json").read_text())

    def _run(self, batches: list[dict]) -> None:
        """One ``batchgen submit`` of every job of ``batches``, watched until it ends or one of them stops."""
        plans = {b["id"]: self._plan(b["id"]) for b in batches}
        jobs = [j["job"] for p in plans.values() for j in p["jobs"]]
        if not jobs:                                       # every line named a model not served here
            for b in batches:
                self._finalize(b["id"], "completed", "completed_at", partial=False)
            return
        cmd = self.config.submit_command(jobs)
        with open(self.store.dir / "runs.log", "ab") as logf:
            logf.write(f"\n== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(plans)}\n".encode())
            logf.flush()
            self._proc = proc = subprocess.Popen(cmd, cwd=self.store.dir, stdout=logf, stderr=subprocess.STDOUT,
                                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            stopped = False
            while proc.poll() is None:
                time.sleep(self.config.poll_s)
                if self._stop.is_set():
                    proc.send_signal(signal.SIGTERM)
                    proc.wait()
                    return
                for bid, plan in plans.items():
                    self.store.update_batch(bid, completed=self._committed(plan))
                self._settle(running=plans)
                if not stopped and self._should_stop(plans):
                    proc.send_signal(signal.SIGTERM)       # finished rows are committed; the rest resume later
                    stopped = True
            self._proc = None
        rc = proc.returncode
        self._settle(running=())                  # this run's batches cancelled or expired meanwhile too
        for bid in plans:
            if self.store.get_batch(bid, None)["status"] != "in_progress":
                continue
            if rc == 0:
                self._finalize(bid, "completed", "completed_at", partial=False)
            elif not stopped:
                self.store.update_batch(bid, "failed", "failed_at", errors=[{
                    "code": "batchgen_error", "message": f"the run exited with code {rc}: {self._log_tail()}",
                    "line": None, "param": None}])

    def _log_tail(self, n: int = 600) -> str:
        with open(self.store.dir / "runs.log", "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - n))
            return fh.read().decode(errors="replace")

    @staticmethod
    def _ending(b: dict) -> tuple[str, str] | None:
        """(status, its time field) a batch ends in now: cancelled once cancelling, expired past its window."""
        if b["status"] == "cancelling":
            return "cancelled", "cancelled_at"
        if time.time() > b["expires_at"]:
            return "expired", "expired_at"
        return None

    def _settle(self, running) -> None:
        """Cancelled and expired batches finished, new ones validated; ``running``: the ids of the batches a run is
        computing now (those its loop settles). While a run computes, batches created since are validated (they run
        next) and the others cancelled or expired are finished at once."""
        for b in self.store.batches_with("validating", "in_progress", "cancelling"):
            if b["id"] in running:
                continue
            ending = self._ending(b)
            if ending is not None:
                self._finish(b, *ending)
            elif b["status"] == "validating":
                self._validate(b)

    def _should_stop(self, plans: dict) -> bool:
        return any(self._ending(self.store.get_batch(bid, None)) is not None for bid in plans)

    def _committed(self, plan: dict) -> int:
        """Rows committed so far: the parts' row counts, each part read once (a part never changes once there)."""
        n = 0
        for j in plan["jobs"]:
            parts = job_dir_for(j["out"]) / "parts"
            for f in parts.glob("*.parquet") if parts.is_dir() else ():
                rows = self._part_rows.get(str(f))
                if rows is None:
                    try:
                        rows = self._part_rows[str(f)] = pq.ParquetFile(f).metadata.num_rows
                    except Exception:      # NOTE: a part being renamed into place; counted next time
                        rows = 0
                n += rows
        return n

    # ---- finishing ----------------------------------------------------------------------------------------------
    def _finish(self, b: dict, status: str, when: str) -> None:
        """Cancelled or expired: the lines finished so far go out, the rest are dropped (as OpenAI)."""
        if b["status"] == "validating" or not (self.store.batch_dir(b["id"]) / "plan.json").is_file():
            self.store.update_batch(b["id"], status, when)
            return
        self._finalize(b["id"], status, when, partial=True)

    def _finalize(self, batch_id: str, status: str, when: str, partial: bool) -> None:
        if status == "completed":
            self.store.update_batch(batch_id, "finalizing", "finalizing_at")
        plan = self._plan(batch_id)
        endpoint = self.store.get_batch(batch_id, None)["endpoint"]
        created = int(time.time())
        results: dict[str, dict] = {}
        for j in plan["jobs"]:
            out = Path(j["out"])
            if not partial and out.is_file():
                results.update((line["custom_id"], line) for line in read_output(out))
                continue
            parts = job_dir_for(out) / "parts"
            for f in sorted(parts.glob("*.parquet")) if parts.is_dir() else ():
                for row in pq.read_table(f).to_pylist():
                    line = response_line(None, {**row, "url": endpoint}, self.config.models[j["model"]]["model"],
                                         created)
                    results[line["custom_id"]] = line
        for cid, message in plan["unknown"].items():
            rid = hashlib.sha256(f"{batch_id}/{cid}".encode()).hexdigest()[:24]
            results[cid] = {"id": f"batch_req_{rid}", "custom_id": cid, "response": None,
                            "error": {"code": "model_not_found", "message": message}}
        good, bad = [], []
        for cid in plan["order"]:
            line = results.get(cid)
            if line is not None:
                (bad if line.get("error") else good).append(line)
        owner = self.store.owner_of(batch_id)
        ids = {}
        for name, lines in (("output", good), ("error", bad)):
            if not lines:
                continue
            fid = self.store.new_file_id()
            data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
            write_bytes_atomic(data, self.store.file_path(fid))
            self.store.add_file(fid, owner, f"{batch_id}_{name}.jsonl", len(data), f"batch_{name}")
            ids[f"{name}_file_id"] = fid
        self.store.update_batch(batch_id, status, when, completed=len(good), failed=len(bad), **ids)


__all__ = ["ServeConfig", "Worker", "validate_lines", "MAX_LINES", "MAX_BYTES", "ENDPOINTS"]
