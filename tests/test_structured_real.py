"""Structured extraction end to end on the real SmolLM2-135M-Instruct: the sample job jobs/extract-fields.yaml
(chat template, JSON Schema from a file), every row valid and typed; a too small max_tokens cuts the JSON off: that
row's json_error and finish_reason length, the batch goes on."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _job(tmp_path, name, limit, max_tokens):
    spec = yaml.safe_load((ROOT / "jobs/extract-fields.yaml").read_text())
    spec.update(name=name)
    spec["input"].update(path=str(ROOT / spec["input"]["path"]), limit=limit)
    spec["generation"].update(max_tokens=max_tokens)
    so = spec["generation"]["structured_outputs"]
    (tmp_path / "schemas").mkdir(exist_ok=True)                 # the schema beside the job file, as shipped
    (tmp_path / so["json"]).write_text((ROOT / "jobs" / so["json"]).read_text())
    spec["output"]["path"] = str(tmp_path / f"out/{name}.parquet")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_job(path)


def test_sample_extraction_job_every_row_valid_and_typed(tmp_path):
    schema = json.loads((ROOT / "jobs/schemas/case.json").read_text())
    jobs = [_job(tmp_path, "x", limit=4, max_tokens=128), _job(tmp_path, "cut", limit=2, max_tokens=6)]
    run_jobs(jobs, options=RunOptions(quiet=True, record_history=False))
    t = pq.read_table(tmp_path / "out/x.parquet")
    assert t.column_names[2:9] == ["category", "title", "key_points", "urgent", "severity", "summary", "json_error"]
    rows = t.to_pylist()
    assert all(r["json_error"] is None and r["error"] is None and r["finish_reason"] == "stop" for r in rows), rows
    for r in rows:
        assert r["category"] in schema["properties"]["category"]["enum"] and 1 <= r["severity"] <= 5
        assert 1 <= len(r["key_points"]) <= 3 and isinstance(r["urgent"], bool) and len(r["title"]) <= 60
        assert json.loads(r["summary"])["severity"] == r["severity"]
        assert " " not in r["summary"].split('"title"')[0]           # compact: no free whitespace
    m = json.loads((tmp_path / "out/x.parquet.manifest.json").read_text())["structured"]
    assert m["valid_rows"] == 4 and m["this_run"]["forced_tokens"] > 0
    cut = pq.read_table(tmp_path / "out/cut.parquet").to_pylist()
    assert all(r["finish_reason"] == "length" and r["error"] is None and "cut off at max_tokens (6)" in r["json_error"]
               and r["category"] is None for r in cut)
