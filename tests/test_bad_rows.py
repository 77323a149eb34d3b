"""Bad rows never kill a batch: one dataset mixing good rows with every kind of bad row, on the real engine
(tiny random Llama, a small context and KV pool): every good row is summarized, every bad row carries its
error, and the summary line counts them."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_docs
from tests.test_pipeline import write_job

ENGINE = ("engine:\n  dtype: float32\n  block_size: 16\n  max_num_seqs: 4\n  max_num_batched_tokens: 256\n"
          "  max_model_len: 1024\n  num_gpu_blocks_override: 32\n")      # 512 tokens of KV for 1024 of context


def test_mixed_good_and_bad_rows(tmp_path, tiny_llama_dir):
    docs = make_docs(12)
    rows = [{"id": d["id"], "category": d["category"], "reference": d["reference"],
             "document": d["document"].encode()} for d in docs]
    bad = {
        1: ("document", None, "'document' is null"),
        3: ("document", b"   \n ", "'document' is empty"),
        5: ("document", b"caf\xe9 au lait \xff", "not valid UTF-8"),
        7: ("document", b"word " * 600, "exceeds the model's context of 1024"),      # > context
        9: ("document", b"word " * 220, "but the pool has only 32"),                  # fits context, not the pool
        10: ("reference", None, "'reference' is null"),
    }
    for i, (col, value, _) in bad.items():
        rows[i][col] = value
    rows[11]["id"] = rows[0]["id"]                            # a duplicate id, allowed by this job
    data = tmp_path / "mixed"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
        ("id", pa.string()), ("category", pa.string()), ("reference", pa.string()), ("document", pa.binary())])),
        data / "part-0.parquet")
    # A second file whose document column is not text at all (files of one dataset whose types drifted).
    pq.write_table(pa.table({"id": ["doc-0100"], "category": ["billing"], "reference": [docs[0]["reference"]],
                             "document": pa.array([12345], pa.int64())}), data / "part-1.parquet")
    job = write_job(tmp_path, "mixed", data, extra=f"model: {tiny_llama_dir}\n" + ENGINE)
    job.write_text(job.read_text().replace("  id_column: id\n", "  id_column: id\n  allow_duplicate_ids: true\n"))

    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 0, res.output
    t = pq.read_table(tmp_path / "out/mixed.parquet")
    assert t.num_rows == 13 and t.column("id").to_pylist() == [r["id"] for r in rows] + ["doc-0100"]
    errors, summaries = t.column("error").to_pylist(), t.column("summary").to_pylist()
    for i in range(13):
        if i in bad:
            assert bad[i][2] in (errors[i] or ""), (i, errors[i])
            assert summaries[i] is None and t.column("finish_reason")[i].as_py() == "error"
        elif i == 12:
            assert "'document' must be text, got int" in errors[i]
        else:
            assert errors[i] is None and summaries[i] is not None, (i, errors[i])
            assert t.column("output_tokens")[i].as_py() > 0
    assert "7 with errors" in res.output
