"""pipeline.job.rows: the one ResultRow type agrees with the part files' schema, and a row survives a commit."""
from __future__ import annotations

import dataclasses

from pipeline.job.rows import RESULT_COLUMNS, RESULT_SCHEMA, ResultRow, results_table
from pipeline.job.state import RunState


def test_result_row_fields_are_the_result_schema():
    assert [f.name for f in dataclasses.fields(ResultRow)] == RESULT_COLUMNS == RESULT_SCHEMA.names


def test_rows_round_trip_through_a_commit(tmp_path):
    rows = [ResultRow("a#1", summary="s", finish_reason="stop", prompt_tokens=3, cached_tokens=1, output_tokens=2,
                      e2e_s=0.5), ResultRow.failed("b#2", "bad row")]
    assert results_table(rows).schema == RESULT_SCHEMA
    state = RunState(tmp_path / "out.parquet", "job")
    state.commit(rows)
    back = [ResultRow.from_dict(d) for d in state.load_done().to_pylist()]
    assert back == rows and back[1].finish_reason == "error" and back[1].prompt_tokens is None
