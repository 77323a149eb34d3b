"""Fuzz (issue 40 A): every ``batchgen`` command on random input ends cleanly through click's CliRunner: exit 0, or
1 / 2 with a message, never a traceback, never an exception other than SystemExit.

The commands and what each takes from the user:

* ``validate``, ``plan``, ``submit`` JOB_FILES: random job files (tests/test_fuzz_job_files.py's strategies), and
  submit's options with random values. ``submit`` runs on the fake engine (tests/conftest.py), so a job that
  validates runs for real in milliseconds; ``--ray`` only with a runtime env that is refused before any work.
* ``cron install|list|remove``: the same job files and random job names / users, against a crontab kept in
  memory (``crontab`` is never run: the machine's crontab is not touched).
* ``status`` [JOB] -n N: random names and limits, over a history database that is fine, damaged or missing.
* ``report`` RUN_DIR...: missing / empty / file paths and run directories with a damaged run.json or Parquet file.
* ``calibrate --show``: random devices, dtypes, cache dirs with damaged calibrations. Measuring (calibrate without
  --show, --retune) is compute, not input handling: skipped here (tests/test_report.py runs a quick one).
* ``bench``: random option values; the compute behind it (run_bench, the size sweep, the quality measurement) is
  replaced by a stand-in that stops the command once its options were accepted.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batchgen.cli import main
from pipeline.run import history
from pipeline.schedule import cron
from tests.test_fuzz_cache_files import damaged
from tests.test_fuzz_job_files import VALUES, job_files, world  # noqa: F401  (world: a fixture)
from tests.test_openai_batch import chat_model  # noqa: F401  (a fixture)

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", "-1", "0", "x", "--", "nan", "1e99", "../..", "\x7f"]))
NUMBERS = st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(["0", "-0.5", "nan", "inf", "1e400", "x", ""]))


class Computed(Exception):
    """Raised by the stand-ins for bench's compute: the command got past its option checks."""


def check(args: list[str], allowed: tuple[type, ...] = ()) -> None:
    res = CliRunner().invoke(main, [str(a) for a in args])
    event(f"{args[0]} exit {res.exit_code}")
    if isinstance(res.exception, allowed):
        return
    assert "Traceback" not in res.output, res.output
    assert res.exit_code in (0, 1, 2), (args, res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), (args, res.exception, res.output)
    if res.exit_code:
        assert res.output.strip(), f"{args}: a failure without a message"


@pytest.fixture
def memory_crontab(monkeypatch):
    """``crontab -l`` / ``crontab -`` on a text in memory; ``-u USER`` is refused as crontab refuses an unknown
    user."""
    tab = {"text": "MAILTO=\"\"\n"}

    def fake(args, user, stdin=None):
        if user is not None:
            return subprocess.CompletedProcess(args, 1, "", f"crontab: user '{user}' unknown\n")
        if args == ["-l"]:
            return subprocess.CompletedProcess(args, 0, tab["text"], "")
        tab["text"] = stdin
        return subprocess.CompletedProcess(args, 0, "", "")
    monkeypatch.setattr(cron, "_crontab", fake)
    return tab


def _job_file(data, world) -> Path:                                 # noqa: F811
    jobdir = Path(tempfile.mkdtemp(dir=world["root"]))
    doc = job_files(data.draw, world, jobdir)
    if data.draw(st.integers(0, 3)) == 0:            # a good job (random ones rarely are): submit runs it whole
        doc = {**doc, "input": {"path": str(world["root"] / "in"), "id_column": "id"},
               "prompt": {"system": "S", "document_column": "document", "template": "{system} {document}"},
               "output": {"path": str(jobdir / "out.parquet")}, "generation": {"max_tokens": 4},
               "name": "fz", "model": world["model"]}
        doc = {k: v for k, v in doc.items() if k in ("name", "model", "input", "prompt", "generation", "output")}
    if data.draw(st.booleans()):
        doc["schedule"] = data.draw(st.one_of(st.sampled_from(["0 2 * * *", "*/5 * * *", "61 * * * *", "@daily"]),
                                              VALUES))
    text = yaml.safe_dump(doc, allow_unicode=True)
    if data.draw(st.integers(0, 9)) == 0:
        text = text[:data.draw(st.integers(0, len(text)))]
    path = jobdir / "job.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _submit_options(data) -> list[str]:
    opts = []
    for flag, values in [("--commit-every", NUMBERS), ("--order", st.sampled_from(["planned", "input", "x"])),
                         ("--replicas", NUMBERS), ("--replica-cpus", NUMBERS), ("--replica-threads", NUMBERS)]:
        if data.draw(st.integers(0, 4)) == 0:
            opts += [flag, data.draw(values)]
    if data.draw(st.integers(0, 4)) == 0:           # --ray only with a runtime env refused before any work
        opts += ["--ray", "--ray-runtime-env", data.draw(st.sampled_from(["[1]", "{", "null", "3", "'x'"]))]
    return opts + [f for f in ("--quiet", "--fail-fast", "--no-wait") if data.draw(st.booleans())]


@FUZZ
@given(data=st.data())
def test_random_job_files_through_every_command_that_reads_them(world, data, monkeypatch,  # noqa: F811
                                                                fake_llm_factory, memory_crontab, tmp_path):
    import pipeline.run.runner
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    monkeypatch.chdir(tmp_path)
    path = _job_file(data, world)
    check(["validate", path])
    check(["plan", path])
    check(["submit", *_submit_options(data), path])
    check(["cron", "install", "--dry-run", path])
    check(["cron", "install", path, "--workdir", data.draw(st.sampled_from([str(tmp_path), "/nonexistent"]))])
    check(["cron", "remove", "--dry-run", path])


@FUZZ
@given(data=st.data())
def test_random_names_users_and_limits_to_cron_and_status(data, memory_crontab, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user = ["--user", data.draw(TEXT)] if data.draw(st.booleans()) else []
    check(["cron", "list", *user, *(["-v"] if data.draw(st.booleans()) else [])])
    check(["cron", "remove", *data.draw(st.lists(TEXT, max_size=3)), *user])
    if data.draw(st.booleans()):
        history.start_run(data.draw(TEXT) or "j", data.draw(st.one_of(st.none(), st.dictionaries(TEXT, TEXT))))
    limit = data.draw(st.one_of(st.integers(1, 30).map(str), NUMBERS))
    check(["status", *data.draw(st.lists(TEXT, max_size=1)), "-n", limit])


_RUN_DIRS: dict[str, Path] = {}


def _pristine_run() -> Path:
    if "run" not in _RUN_DIRS:
        from tests.test_report import _sim_run
        _RUN_DIRS["run"] = _sim_run(Path(tempfile.mkdtemp()) / "run")
    return _RUN_DIRS["run"]


@settings(FUZZ, max_examples=15)           # each report renders a page with plots: ~0.5 s
@given(data=st.data())
def test_report_on_random_paths_and_damaged_run_directories(data, tmp_path):
    pristine = _pristine_run()
    run = tmp_path / "run"
    shutil.copytree(pristine, run, dirs_exist_ok=True)
    which = data.draw(st.sampled_from(["run.json", "requests.parquet", "steps.parquet", "none"]))
    if which == "run.json":
        (run / "run.json").write_bytes(data.draw(damaged(json.loads((pristine / "run.json").read_text()))))
    elif which != "none":
        part = sorted((run / which).glob("*.parquet"))[0] if (run / which).is_dir() else run / which
        raw = part.read_bytes()
        part.write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    dirs = data.draw(st.one_of(st.just([str(run)]), st.lists(
        st.sampled_from([str(run), str(empty), str(run / "run.json"), "/nonexistent"]), min_size=0, max_size=3)))
    opts = []
    for flag in ("--prompt-threshold", "--output-threshold"):
        if data.draw(st.integers(0, 3)) == 0:
            opts += [flag, data.draw(NUMBERS)]
    if data.draw(st.booleans()):
        opts += ["-o", data.draw(st.sampled_from([str(tmp_path / "r.html"), "/nonexistent/r.html", str(empty)]))]
    check(["report", *dirs, *opts])


@FUZZ
@given(device=st.one_of(st.sampled_from(["auto", "cpu", "cpu:0"]), st.sampled_from(["cuda", "meta", "cuda:x"]),
                        TEXT),
       dtype=st.one_of(st.sampled_from(["auto", "bfloat16", "float32", "int8"]), st.just("x")),
       all_formats=st.sampled_from([False, False, False, True]), content=st.one_of(st.none(), st.binary(max_size=40),
                                                   damaged({"device": "cpu-2t", "device_name": "cpu (2 threads)",
                                                            "dtype": "float32", "matmul_flops": 5e9,
                                                            "memory_bandwidth": 1e9, "copy_bandwidth": 2e9,
                                                            "small_m_flops": 1e9, "matmul_by_shape": {"1x2x3": 1e9},
                                                            "kernel_flops": {"torch.matmul": {"matmul_flops": 5e9}},
                                                            "quick": True})))
def test_calibrate_show_on_random_devices_dtypes_and_damaged_caches(device, dtype, all_formats, content):
    import torch
    cache = Path(tempfile.mkdtemp())
    if content is not None:
        for fmt in ("float32", "bfloat16", "int8"):
            (cache / f"calibration-cpu-{torch.get_num_threads()}t-{fmt}.json").write_bytes(content)
    check(["calibrate", "--show", "--device", device, "--dtype", dtype, "--cache-dir", cache,
           *(["--all-formats"] if all_formats else [])])


@FUZZ
@given(data=st.data())
def test_bench_options_are_checked_before_any_compute(data, monkeypatch, tmp_path):
    import batchgen.bench_cmd
    import bench.quality
    import bench.run

    def computed(*args, **kwargs):
        raise Computed
    for module, name in [(bench.run, "run_bench"), (bench.quality, "measure"), (batchgen.bench_cmd, "_size_sweep")]:
        monkeypatch.setattr(module, name, computed)
    args = ["bench", data.draw(st.sampled_from(["shared-prefix", "long-prompt", "nope"]))]
    for flag in ("--n", "--groups", "--prefix-tokens", "--doc-tokens", "--output-tokens", "--threads",
                 "--max-num-seqs", "--contend", "--positions", "--seed", "--kv-cache-memory"):
        if data.draw(st.integers(0, 5)) == 0:
            args += [flag, data.draw(NUMBERS)]
    for flag, values in [("--systems", st.one_of(TEXT, st.sampled_from(["batchgen", "batchgen,hf-generate"]))),
                         ("--hf-batch-sizes", st.one_of(TEXT, st.just("4,8"))), ("--sweep-only", TEXT),
                         ("--dtype", st.sampled_from(["auto", "float32", "int8"])),
                         ("--json", st.sampled_from([str(tmp_path / "b.json"), "/nonexistent/b.json"]))]:
        if data.draw(st.integers(0, 4)) == 0:
            args += [flag, data.draw(values)]
    args += [f for f in ("--quick", "--structured", "--quality", "--formats", "--size-sweep", "--no-roofline")
             if data.draw(st.integers(0, 3)) == 0]
    check(args, allowed=(Computed,))


# ---- what the fuzzing found, one regression test each ----------------------------------------------------------
@pytest.mark.parametrize("device", ["bogus", "", "cuda:x", "meta"])
def test_calibrate_with_a_device_that_is_not_one_is_a_usage_error_naming_the_option(device, tmp_path):
    res = CliRunner().invoke(main, ["calibrate", "--show", "--device", device, "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2 and (res.exception is None or isinstance(res.exception, SystemExit)), res.output
    assert "Invalid value for --device" in res.output and "cpu, cuda, cuda:N or auto" in res.output


@pytest.mark.parametrize("content", ["null", "[1]", '{"device": "cpu-2t", "device_name": "cpu", "dtype": "float32", '
                                     '"matmul_flops": "x", "memory_bandwidth": 1, "copy_bandwidth": 1, '
                                     '"small_m_flops": 1}'])
def test_calibrate_show_of_a_damaged_calibration_says_it_is_unreadable(content, tmp_path):
    import torch
    path = tmp_path / f"calibration-cpu-{torch.get_num_threads()}t-float32.json"
    path.write_text(content)
    res = CliRunner().invoke(main, ["calibrate", "--show", "--dtype", "float32", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert f"the calibration cached at {path} is unreadable" in res.output


@pytest.mark.parametrize("field, value", [("model_info", [1]), ("model_config", "x"), ("model_config", {"a": 1}),
                                          ("calibration", {"a": 1}), ("sessions", {"a": 1}), ("sessions", [1]),
                                          ("prediction", -1), ("phases", "x")])
def test_report_of_a_run_json_with_a_damaged_field_drops_it_with_a_warning(field, value, tmp_path, caplog):
    run = shutil.copytree(_pristine_run(), tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    meta[field] = value
    (run / "run.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="batchgen.pipeline"):
        res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 0 and res.exception is None, res.output
    assert (run / "report.html").is_file()
    assert f"run trace {run / 'run.json'}: {field}" in caplog.text


def test_report_of_a_truncated_trace_table_is_one_message_naming_the_run(tmp_path):
    run = shutil.copytree(_pristine_run(), tmp_path / "run")
    part = sorted((run / "requests.parquet").glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:20])
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert f"{run}: the run trace is damaged" in res.output and "Traceback" not in res.output


def test_a_resumed_trace_drops_damaged_sessions_of_its_run_json(tmp_path, caplog):
    from pipeline.run.trace import RunTrace, read_run
    run = shutil.copytree(_pristine_run(), tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    meta["sessions"] = [{"wall_s": "x"}, 3] + meta["sessions"]
    (run / "run.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="batchgen.pipeline"):
        trace = RunTrace(run, meta["model_info"], 0.5)
        trace.write()
    assert "sessions 2 of 3 are not sessions; ignored" in caplog.text
    assert len(read_run(run).meta["sessions"]) == 2


@pytest.fixture
def chat_llm_factory(chat_model, monkeypatch):
    """The fake engine (tests/conftest.py) over the chat model's tokenizer (it has a chat template), as the runner's
    engine."""
    from transformers import AutoTokenizer

    import pipeline.run.runner
    from tests.conftest import FakeLLM, changed_options
    tok = AutoTokenizer.from_pretrained(chat_model)
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory",
                        lambda config: FakeLLM(tok, **changed_options(config)))


def _batch_line(draw) -> str:
    """One line of an OpenAI Batch file: a good chat request with a random body value, or random JSON / text."""
    from tests.test_openai_batch import req, sys_user
    kind = draw(st.sampled_from(["good", "good", "body", "messages", "json", "text"]))
    if kind == "json":
        return json.dumps(draw(VALUES))
    if kind == "text":
        return draw(st.sampled_from(["", "{not json", "[", "null", '{"custom_id": 1}', "\x00"]))
    cid = draw(st.one_of(st.sampled_from(["r1", "r2", "r1"]), VALUES))
    messages = sys_user(draw(st.text(max_size=20)) or "hello")
    if kind == "messages":
        messages = draw(st.one_of(VALUES, st.lists(st.fixed_dictionaries({"role": VALUES, "content": VALUES}),
                                                   max_size=2)))
    body = {}
    if kind == "body":
        body[draw(st.sampled_from(["max_tokens", "temperature", "stop", "response_format", "n", "seed", "top_p",
                                   "max_completion_tokens", "model", "tools"]))] = draw(VALUES)
    return req(cid, messages, url=draw(st.sampled_from(["/v1/chat/completions", "/v1/chat/completions", "/x"])),
               **body)


@FUZZ
@given(data=st.data())
def test_random_openai_batch_files_through_validate_plan_and_submit(data, chat_model, chat_llm_factory, tmp_path):
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    lines = [_batch_line(data.draw) for _ in range(data.draw(st.integers(0, 5)))]
    (work / "requests.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out_format = data.draw(st.sampled_from(["openai_batch", "parquet"]))
    out = work / ("out/results.jsonl" if out_format == "openai_batch" else "out/results.parquet")
    job = work / "job.yaml"
    job.write_text(f"name: ob\nmodel: {chat_model}\ninput:\n  path: {work / 'requests.jsonl'}\n  format: openai_batch\n"
                   f"generation:\n  max_tokens: 4\noutput:\n  path: {out}\n  format: {out_format}\n")
    for command in ("validate", "plan", "submit"):
        check([command, job])


@pytest.mark.parametrize("value", [[], {"a": 1}, [[1]], "x"])
def test_an_openai_batch_body_with_a_list_for_a_number_is_a_bad_row_naming_the_field(value, chat_model, tmp_path,
                                                                                      chat_llm_factory):
    import pyarrow.parquet as pq

    from tests.test_openai_batch import req, sys_user
    (tmp_path / "requests.jsonl").write_text(req("bad", sys_user("hi"), max_tokens=value) + "\n"
                                             + req("good", sys_user("hello")) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: ob\nmodel: {chat_model}\ninput:\n  path: {tmp_path / 'requests.jsonl'}\n"
                   f"  format: openai_batch\ngeneration:\n  max_tokens: 4\noutput:\n"
                   f"  path: {tmp_path / 'out.parquet'}\n")
    res = CliRunner().invoke(main, ["submit", "--quiet", str(job)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    rows = {r["custom_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert rows["bad"]["error"].startswith("body: ") and "max_tokens" in rows["bad"]["error"]
    assert rows["good"]["error"] is None


@pytest.mark.parametrize("value", [False, 3, ["ok", 1], {"a": "b"}])
def test_an_openai_batch_body_with_a_stop_that_is_not_text_is_a_bad_row_naming_the_field(value, chat_model, tmp_path,
                                                                                        chat_llm_factory):
    """``stop: false`` made plan / submit raise TypeError (found by the fuzz above)."""
    import pyarrow.parquet as pq

    from tests.test_openai_batch import req, sys_user
    (tmp_path / "requests.jsonl").write_text(req("bad", sys_user("hi"), stop=value) + "\n"
                                             + req("good", sys_user("hello")) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: ob\nmodel: {chat_model}\ninput:\n  path: {tmp_path / 'requests.jsonl'}\n"
                   f"  format: openai_batch\ngeneration:\n  max_tokens: 4\noutput:\n"
                   f"  path: {tmp_path / 'out.parquet'}\n")
    for cmd in (["plan", str(job)], ["submit", "--quiet", str(job)]):
        res = CliRunner().invoke(main, cmd)
        assert res.exception is None or isinstance(res.exception, SystemExit), (cmd, res.exception)
    rows = {r["custom_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert rows["bad"]["error"].startswith("body.stop must be a string or a list of strings")
    assert rows["good"]["error"] is None
