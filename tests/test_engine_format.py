"""The engine format a job's rows were computed in is recorded in its job dir and pinned for its later runs
(incremental, resumed) and for every Ray replica, even when the machine's measured decision changes in between;
explicit settings win; a recorded format that cannot run any more is dropped with a warning."""
from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.run.engine_format as engine_format
from engine import ConfigError, EngineConfig
from engine.config import Kernels
from engine.interface import EngineInfo
from pipeline.job.state import job_dir_for
from tests.conftest import FakeLLM, make_docs
from tests.test_pipeline import run, write_job

INT8 = {"quantization": "int8", "dtype": "float32", "kv_cache_dtype": "bfloat16",
        "kernels": {"attention": "c", "elementwise": "c", "lm_head": "table"}}
BF16 = {"quantization": "none", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
        "kernels": {"attention": "torch", "elementwise": "c", "lm_head": "c"}}


class FormatLLM(FakeLLM):
    """A fake engine whose format is the machine's ``decision`` where the config says auto, the config's elsewhere
    (as setup_engine resolves it)."""

    def __init__(self, tokenizer, config: EngineConfig, decision: dict):
        super().__init__(tokenizer)
        self.fmt = {f: (decision[f] if getattr(config, f) == "auto" else getattr(config, f))
                    for f in ("quantization", "dtype", "kv_cache_dtype")}
        self.fmt["kernels"] = {**decision["kernels"], **(config.kernels or {})}

    @property
    def info(self):
        base = super().info
        return dataclasses.replace(base, config=dataclasses.replace(base.config, **self.fmt),
                                   format=_format(self.fmt))


def _format(fmt: dict, mode: str = "tuned"):
    """A FormatDecision of the format ``fmt``: the tuner's (``tuned``, as cached), the tables' (``table``), or the
    tables' while this machine has no decision cached (``pending``)."""
    from engine.dtype_policy import DtypeChoice
    from engine.quant.policy import QuantChoice
    from engine.tuning.decision import Decision
    from engine.tuning.format_decision import FormatDecision
    tuned = Decision(key={}, choice=fmt, reason="fastest", source="cached") if mode == "tuned" else None
    return FormatDecision(QuantChoice(fmt["quantization"], "q"), DtypeChoice(fmt["dtype"], "d"), fmt["kv_cache_dtype"],
                          Kernels(fmt["kernels"]), tuned, "BATCHGEN_TUNE=off" if mode == "table" else "")


@pytest.fixture
def machine(tiny_tokenizer):
    """``machine.decision``: what this machine's tuner would choose now; ``machine.configs``: what was loaded."""
    state = type("Machine", (), {"decision": INT8, "configs": [], "refuse": None})()

    def factory(config):
        if state.refuse and config.quantization == state.refuse:
            raise ConfigError(f"quantization: {state.refuse} cannot run here")
        state.configs.append(config)
        return FormatLLM(tiny_tokenizer, config, state.decision)
    state.factory = factory
    return state


def _data(tmp_path, n):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(make_docs(n)), path)
    return path


def test_a_later_run_computes_in_the_recorded_format(tmp_path, machine, capsys):
    job = write_job(tmp_path, "nightly", _data(tmp_path, 6))
    run([job], machine.factory)
    record = json.loads((job_dir_for(tmp_path / "out/nightly.parquet") / engine_format.FILE).read_text())
    assert record["choice"] == INT8
    assert machine.configs[-1].quantization == "auto"          # the first run: the machine decided

    machine.decision = BF16                                     # e.g. `batchgen calibrate --retune` chose otherwise
    _data(tmp_path, 9)                                          # three new rows
    reports = run([job], machine.factory)
    pinned = machine.configs[-1]
    assert (pinned.quantization, pinned.dtype, pinned.kv_cache_dtype, pinned.kernels) == (
        "int8", "float32", "bfloat16", INT8["kernels"])
    tuning = reports[0].engine_info.format.record()
    assert tuning["mode"] == "pinned" and tuning["choice"] == INT8 and engine_format.FILE in tuning["reason"]
    manifest = json.loads((tmp_path / "out/nightly.parquet.manifest.json").read_text())
    assert manifest["model"]["tuning"]["mode"] == "pinned"


def test_explicit_settings_win_over_the_record(tmp_path, machine):
    job = write_job(tmp_path, "nightly", _data(tmp_path, 4))
    run([job], machine.factory)
    job.write_text(job.read_text() + "engine:\n  kv_cache_dtype: float32\n  kernels: {attention: torch}\n")
    run([job], machine.factory)
    c = machine.configs[-1]
    assert (c.quantization, c.dtype, c.kv_cache_dtype) == ("int8", "float32", "float32")
    assert c.kernels == {**INT8["kernels"], "attention": "torch"}


def test_a_record_that_cannot_run_here_is_dropped_with_a_warning(tmp_path, machine, capsys):
    job = write_job(tmp_path, "nightly", _data(tmp_path, 4))
    run([job], machine.factory)
    machine.refuse, machine.decision = "int8", BF16              # e.g. moved to a machine without the int8 kernels
    _data(tmp_path, 6)
    run([job], machine.factory)
    assert machine.configs[-1].quantization == "auto"
    assert "cannot run here" in capsys.readouterr().err
    record = json.loads((job_dir_for(tmp_path / "out/nightly.parquet") / engine_format.FILE).read_text())
    assert record["choice"] == BF16                              # what this run's rows were computed in


def test_jobs_whose_records_disagree_pin_nothing(tmp_path):
    from pipeline.job.state import RunState
    a, b = RunState(tmp_path / "a.parquet", "a"), RunState(tmp_path / "b.parquet", "b")
    engine_format.store([a], INT8, "m")
    assert engine_format.recorded([a, b], "m").choice == INT8    # one job has no record yet: the other's
    assert engine_format.recorded([a, b], "other-model") is None
    engine_format.store([b], BF16, "m")
    assert engine_format.recorded([a, b], "m") is None
    (a.dir / engine_format.FILE).write_text("{not json")
    assert engine_format.recorded([a], "m") is None


def test_replicas_get_the_drivers_format_measured_once_when_none_is_cached(monkeypatch):
    import engine
    measured = []

    def tune_format(cfg, retune=False):
        measured.append(cfg)
        return _format(BF16)

    monkeypatch.setattr(engine, "tune_format", tune_format, raising=False)

    def planning(mode):              # the driver's planning engine: int8, decided as ``mode`` says
        config = EngineConfig("m", device="cpu", max_model_len=64, max_num_seqs=8, **INT8)
        return EngineInfo("m", "id", "A", config, format=_format(INT8, mode))

    cfg, choice = engine_format.for_replicas(EngineConfig("m"), planning("tuned"))
    assert not measured and choice == INT8 and cfg.quantization == "int8" and cfg.kernels == INT8["kernels"]
    cfg, choice = engine_format.for_replicas(EngineConfig("m"), planning("table"))
    assert not measured and choice == INT8                       # the tables decide: nothing to measure
    cfg, choice = engine_format.for_replicas(EngineConfig("m"), planning("pending"))
    assert measured == [EngineConfig("m")] and choice == BF16 and cfg.dtype == "bfloat16"


RECORD_DAMAGE = {"empty choice": ({"choice": {}}, "choice.quantization"),
                 "kernels a string": ({"choice": {**INT8, "kernels": "c"}}, "choice.kernels"),
                 "unknown dtype": ({"choice": {**INT8, "dtype": "float8"}}, "choice.dtype"),
                 "unknown quantization": ({"choice": {**INT8, "quantization": "int4"}}, "choice.quantization"),
                 "choice a list": ({"choice": [1]}, "choice must be a mapping"),
                 "no model": ({"model": 3}, "model must be a string"),
                 "not an object": ([], "not a JSON object"),
                 "truncated": ("{\"model\": \"m", "unusable")}


@pytest.mark.parametrize("damage", RECORD_DAMAGE)
def test_a_damaged_record_is_dropped_with_a_warning_naming_the_file_and_field(tmp_path, machine, caplog, damage):
    job = write_job(tmp_path, "nightly", _data(tmp_path, 4))
    run([job], machine.factory)
    path = job_dir_for(tmp_path / "out/nightly.parquet") / engine_format.FILE
    edit, named = RECORD_DAMAGE[damage]
    if isinstance(edit, dict):
        edit = {**json.loads(path.read_text()), **edit}
    path.write_text(edit if isinstance(edit, str) else json.dumps(edit))
    machine.decision = BF16
    _data(tmp_path, 6)
    with caplog.at_level("WARNING", logger="batchgen.pipeline"):
        run([job], machine.factory)                               # no traceback, and the job runs
    assert f"engine format recorded in {path} is unusable" in caplog.text and named in caplog.text
    assert machine.configs[-1].quantization == "auto"             # nothing pinned: the machine's choice
    assert json.loads(path.read_text())["choice"] == BF16         # this run's format recorded in its place
