"""The engine format a job's rows were computed in (weights, activation and KV cache dtypes, kernel families), kept
in the job dir (``engine_format.json``), so that a resumed or incremental run computes its new rows in the same
one, and every Ray replica in the driver's: a row's tokens depend on the format, and the machine's measured
decision (engine.tuning) may change between runs (``batchgen calibrate --retune``, a new kernel build).

Only what the job's ``engine:`` section left ``auto`` is pinned (``EngineConfig.pinned``); a setting given by name
wins. A recorded format this machine cannot run any more (a ConfigError at load), or a record that does not
validate (``_read``: a damaged file, a field of the wrong type or value), is dropped with a warning naming the file.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engine import ConfigError, EngineConfig, EngineInfo
from pipeline.io.tables import write_bytes_atomic
from pipeline.job.state import RunState

log = logging.getLogger("batchgen.pipeline")

FILE = "engine_format.json"


@dataclass(frozen=True)
class Recorded:
    choice: dict             # EngineInfo.format_choice
    path: Path

    def describe(self) -> str:
        c = self.choice
        kernels = ", ".join(f"{k} {v}" for k, v in sorted((c.get("kernels") or {}).items()))
        return (f"{c['quantization']} weights, {c['dtype']} activations, {c['kv_cache_dtype']} KV cache"
                f"{f', kernels {kernels}' if kernels else ''}")


def _read(path: Path, quiet: bool = False) -> dict | None:
    """The record at ``path``, validated as a whole and field by field; None when absent, or when it does not
    validate: then it is dropped with a warning naming the file and the field (unless ``quiet``), and this run's
    format is recorded in its place."""
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict):
            raise ValueError(f"not a JSON object but {type(d).__name__}")
        if not isinstance(d.get("model"), str):
            raise ValueError(f"model must be a string, got {d.get('model')!r:.80}")
        EngineConfig.check_choice(d.get("choice"))
    except (OSError, ValueError, RecursionError, ConfigError) as e:
        if not quiet:
            log.warning("the engine format recorded in %s is unusable (%s); dropped: this run's format is recorded "
                        "in its place", path, e)
        return None
    return d


def recorded(states: list[RunState], model: str) -> Recorded | None:
    """The format recorded by these jobs' earlier runs of ``model``; None when none was, or when the jobs' records
    disagree (then no pin could keep every job's rows consistent: the machine's decision is used, with a
    warning)."""
    found = []
    for st in states:
        d = _read(st.dir / FILE)
        if d is not None and d.get("model") == model:
            found.append(Recorded(d["choice"], st.dir / FILE))
    if not found:
        return None
    if any(r.choice != found[0].choice for r in found[1:]):
        log.warning("the jobs on %s recorded different engine formats (%s); their earlier rows came from "
                    "different formats, so none is pinned", model, "; ".join(sorted({r.describe() for r in found})))
        return None
    return found[0]


def store(states: list[RunState], choice: dict, model: str) -> None:
    """Record the format of the engine computing these jobs' rows (never fails a run; a record already saying so
    is left as it is)."""
    body = json.dumps({"model": model, "choice": choice, "recorded_at": time.time()}, indent=1)
    for st in states:
        old = _read(st.dir / FILE, quiet=True)
        if old is not None and old.get("model") == model and old["choice"] == choice:
            continue
        try:
            st.dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(body.encode(), st.dir / FILE)
        except OSError as e:
            log.warning("could not record the engine format in %s (%s)", st.dir, e)


def for_replicas(config: EngineConfig, info: EngineInfo) -> tuple[EngineConfig, dict]:
    """The config every Ray replica loads, with the format fixed: the driver's (``info``: its planning engine, which
    read this machine's cached decision), or, with none cached here, one measured now in this process — otherwise
    each replica would measure its own and rows would differ by replica. Returns (config, the format)."""
    choice = info.format_choice
    if info.format is not None and info.format.pending:      # tunable here, but no decision cached yet
        from engine import tune_format  # NOTE: lazy: measuring imports torch (the planning engine already did)
        log.info("no tuning decision cached for %s here: measuring once in the driver, for every replica",
                 config.model)
        choice = tune_format(config).choice
    return config.pinned(choice), choice


def noted(info: EngineInfo, pinned_by: Recorded | None) -> EngineInfo:
    """``info`` with its format saying it was pinned by an earlier run's record (the manifest)."""
    if pinned_by is None or info.format is None:
        return info
    reason = f"the format the jobs' earlier rows were computed in ({pinned_by.path})"
    return dataclasses.replace(info, format=info.format.pinned(pinned_by.choice, reason))
