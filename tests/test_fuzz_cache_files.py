"""Fuzz (issue 40): every file of ours read back — a tuning decision, a job's engine_format.json, a weights-cache
file, the run history, a job's lock and current_run — damaged at random (truncated, bytes flipped, a field's value
replaced by random JSON, a field deleted) reads as a clean result or as the rebuild path with a warning naming the
file; never an exception other than the documented one (the history's HistoryError)."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import sqlite3
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import engine.tuning.decision as decision
import pipeline.run.engine_format as engine_format
from engine import EngineConfig
from engine.loader import weights_cache
from pipeline.job.state import RunState
from pipeline.run import history
from pipeline.run.history import HistoryError

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# values of ours in the wrong place: a kernel implementation for a dtype, a safetensors dtype for another, ...
NEAR_MISSES = st.sampled_from(["c", "torch", "table", "auto", "none", "int8", "float8", "bfloat16", "float32", "I32",
                               "F32", "BF16", "U8", "m"])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
                    | NEAR_MISSES,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


@contextlib.contextmanager
def warnings_logged(logger: str):
    """The warning lines ``logger`` emits inside the block (caplog is function-scoped: not for @given)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


def _paths(doc, prefix=()) -> list[tuple]:
    """Every place in a JSON document a value sits at (dict keys, list indexes), the root excluded."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def _edit(doc, path: tuple, value, delete: bool):
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@st.composite
def damaged(draw, doc) -> bytes:
    """``doc`` (a JSON document) written, then damaged one way: truncated, bytes flipped, a field edited or
    deleted."""
    data = json.dumps(doc, indent=1).encode()
    how = draw(st.sampled_from(["truncate", "flip", "edit", "delete"]))
    if how == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "flip":
        out = bytearray(data)
        for i in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=4)):
            out[i] ^= draw(st.integers(1, 255))
        return bytes(out)
    path = draw(st.sampled_from(_paths(doc)))
    edited = _edit(json.loads(data), path, draw(JSON), how == "delete")
    return json.dumps(edited).encode()


# ---- a tuning decision ---------------------------------------------------------------------------------------
KEY = {"format": decision.FORMAT, "cpu": "a CPU", "cores": 2, "model": "m",
       "requested": {"quantization": "auto", "dtype": "auto", "kv_cache_dtype": "auto"}}
DECISION = decision.Decision(
    key=KEY, reason="fastest", shapes=["prefill", "decode-1"], rounds=2, stopped="rounds", load_average=0.5,
    choice={"quantization": "none", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
            "kernels": {"elementwise": "c", "lm_head": "table", "attention": "torch", "linears": "c"}},
    candidates=[{"name": "none/bfloat16/kv-bfloat16", "quantization": "none", "dtype": "bfloat16",
                 "kv_cache_dtype": "bfloat16", "times_ms": {"prefill": 10.0}, "score_ms": 10.0}],
    kernels={"elementwise": {"chosen": "c", "why": "lowest"}}).to_dict()


@FUZZ
@given(data=damaged(DECISION))
def test_a_damaged_tuning_decision_is_used_whole_or_rebuilt_with_a_warning(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tuning" / "abc.json"
        path.parent.mkdir()
        path.write_bytes(data)
        with warnings_logged("batchgen.engine") as warned:
            dec = decision.load(path, KEY)
        if dec is None:
            assert any(f"tuning decision {path} is unusable" in w for w in warned) and not path.exists()
        else:                                   # what the engine's setup then does with it
            quant, dtype, kv, kernels = dec.choices()
            EngineConfig(quantization=quant.name, dtype=dtype.dtype, kv_cache_dtype=kv, kernels=kernels)
            decision.quieter_now(dec)
            json.dumps(dec.record())


# ---- a job's engine_format.json --------------------------------------------------------------------------------
RECORD = {"model": "m", "recorded_at": 1.5e9,
          "choice": {"quantization": "int8", "dtype": "float32", "kv_cache_dtype": "int8",
                     "kernels": {"attention": "c", "elementwise": "torch", "lm_head": "table"}}}


@FUZZ
@given(data=damaged(RECORD))
def test_a_damaged_engine_format_record_is_pinned_whole_or_dropped_with_a_warning(data):
    with tempfile.TemporaryDirectory() as d:
        state = RunState(Path(d) / "out.parquet", "j")
        state.dir.mkdir()
        path = state.dir / engine_format.FILE
        path.write_bytes(data)
        with warnings_logged("batchgen.pipeline") as warned:
            rec = engine_format.recorded([state], "m")
        if rec is None:
            assert any(f"engine format recorded in {path} is unusable" in w for w in warned) or (
                json.loads(data).get("model") != "m")           # another model's record: not this run's
        else:                                   # what the runner then does with it
            rec.describe()
            EngineConfig().pinned(rec.choice)


# ---- a weights-cache file ---------------------------------------------------------------------------------------
TENSORS = {"embed": torch.arange(12, dtype=torch.float32).reshape(4, 3), "norm": torch.ones(5, dtype=torch.bfloat16),
           "q": torch.tensor([[1, -2], [3, -4]], dtype=torch.int8)}


@functools.cache
def _pristine_weights() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        weights_cache.store(Path(d) / "w.safetensors", TENSORS)
        return (Path(d) / "w.safetensors").read_bytes()


@st.composite
def damaged_weights(draw) -> bytes:
    """A weights-cache file as ``store`` writes it, then truncated, bytes flipped, or its header edited."""
    data = _pristine_weights()
    how = draw(st.sampled_from(["truncate", "flip", "header"]))
    if how == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "flip":
        out = bytearray(data)
        for i in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=4)):
            out[i] ^= draw(st.integers(1, 255))
        return bytes(out)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    delete = draw(st.booleans())
    edited = json.dumps(_edit(header, draw(st.sampled_from(_paths(header))), draw(JSON), delete)).encode()
    return len(edited).to_bytes(8, "little") + edited + data[8 + n:]


@FUZZ
@given(st.data())
def test_a_damaged_weights_cache_file_maps_whole_or_is_rebuilt_with_a_warning(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "w.safetensors"
        path.write_bytes(data.draw(damaged_weights()))
        with warnings_logged("batchgen.engine") as warned:
            tensors = weights_cache.load(path)
        if tensors is None:
            assert any(f"weights cache {path} is damaged" in w for w in warned) and not path.exists()
        else:                                   # whole: the very tensors written, never other values
            assert tensors.keys() == TENSORS.keys()
            assert all(t.dtype == TENSORS[k].dtype and torch.equal(t, TENSORS[k]) for k, t in tensors.items())


# ---- the run history -------------------------------------------------------------------------------------------
COLUMNS = ["id", "job", "started_at", "finished_at", "status", "pid", "host", "config", "rows_done", "tokens_per_s",
           "error", "phase", "queued_s", "engine_s"]
SQL_VALUES = st.none() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=10) | st.binary(max_size=10)


@functools.cache
def _pristine_history() -> bytes:
    """Three finished runs, checkpointed into the one file (no -wal beside it)."""
    with tempfile.TemporaryDirectory() as d:
        for i in range(3):
            run = history.start_run(f"job{i}", {"model": "m", "i": i}, state_dir=d)
            history.finish_run(run, "ok", rows_done=i, state_dir=d)
        with contextlib.closing(sqlite3.connect(history.db_path(d))) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return history.db_path(d).read_bytes()


@FUZZ
@given(how=st.sampled_from(["truncate", "flip", "edit"]), data=st.data())
def test_a_damaged_run_history_reads_as_rows_or_one_history_error(how, data):
    with tempfile.TemporaryDirectory() as d:
        path = history.db_path(d)
        path.write_bytes(_pristine_history())
        if how == "edit":
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute("PRAGMA ignore_check_constraints = ON")
                conn.execute("PRAGMA synchronous = OFF")
                try:
                    with conn:
                        conn.execute(f"UPDATE runs SET {data.draw(st.sampled_from(COLUMNS))} = ? WHERE id = ?",
                                     (data.draw(SQL_VALUES), data.draw(st.integers(1, 3))))
                except sqlite3.Error:
                    assume(False)               # a value the schema itself refuses: not a file we could read
        else:
            raw = bytearray(path.read_bytes())
            if how == "truncate":
                raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
            else:
                for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
                    raw[i] ^= data.draw(st.integers(1, 255))
            path.write_bytes(bytes(raw))
        try:
            runs = history.recent_runs(state_dir=d)
        except HistoryError as e:
            assert str(path) in str(e)
            return
        assert len(runs) <= 3 and all(isinstance(r.config, dict) for r in runs)


# ---- a job's lock ----------------------------------------------------------------------------------------------
@FUZZ
@given(content=st.binary(max_size=64))
def test_a_lock_file_nobody_holds_is_taken_whatever_it_holds(content):
    with tempfile.TemporaryDirectory() as d:
        state = RunState(Path(d) / "out.parquet", "j")
        state.dir.mkdir()
        (state.dir / "lock").write_bytes(content)
        state.lock()
        state.unlock()
        assert not (state.dir / "lock").exists()


@FUZZ
@given(content=st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_a_damaged_current_run_is_a_run_id_or_none(content):
    with tempfile.TemporaryDirectory() as d:
        state = RunState(Path(d) / "out.parquet", "j")
        state.dir.mkdir()
        (state.dir / "current_run").write_bytes(content)
        run_id = state.current_run()
        assert run_id is None or ("/" not in run_id and run_id == content.decode().strip())
