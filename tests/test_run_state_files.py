"""A job dir's files read back (issue 40): ``current_run`` that does not hold a run id (damaged, or a path) and an
unreadable committed part are warned about by file, and the run goes on: a new trace, the part's rows again."""
from __future__ import annotations

import pytest

from pipeline.job.state import RunState
from tests.test_pipeline import run, write_job


@pytest.mark.parametrize("content, want", [(b"20261204-061500\n", "20261204-061500"),
                                           (b"20261204-061500-2", "20261204-061500-2"),
                                           (b"\xff\xfe\x00garbage", None), (b"../../../tmp", None), (b"/", None),
                                           (b"", None)])
def test_current_run_is_a_run_id_or_none_with_a_warning(tmp_path, content, want, caplog):
    state = RunState(tmp_path / "out.parquet", "j")
    state.dir.mkdir()
    assert state.current_run() is None                          # no file: no unfinished run
    (state.dir / "current_run").write_bytes(content)
    with caplog.at_level("WARNING", logger="batchgen.pipeline"):
        assert state.current_run() == want
    assert (f"{state.dir / 'current_run'} does not hold a run id" in caplog.text) == (want is None)


def test_a_run_with_a_damaged_current_run_starts_a_new_trace(tmp_path, make_docs_dataset, fake_llm_factory):
    job = write_job(tmp_path, "t", make_docs_dataset(n=4))
    state = tmp_path / "out/.t.parquet.batchgen"
    state.mkdir(parents=True)
    (state / "current_run").write_bytes(b"\xff/..")
    [report] = run([job], fake_llm_factory)
    assert report.trace_dir.parent == state / "runs" and report.trace_dir.is_dir()


def test_an_unreadable_part_is_moved_aside_with_a_warning_and_its_rows_computed_again(
        tmp_path, make_docs_dataset, fake_llm_factory, caplog):
    job = write_job(tmp_path, "p", make_docs_dataset(n=4))
    run([job], fake_llm_factory)
    state = RunState(tmp_path / "out/p.parquet", "p")
    [part] = state.part_files()
    part.write_bytes(part.read_bytes()[:40])
    with caplog.at_level("WARNING", logger="batchgen.pipeline"):
        assert state.load_done().num_rows == 0
    assert f"committed part {part} is unreadable" in caplog.text and part.with_suffix(".corrupt").exists()
