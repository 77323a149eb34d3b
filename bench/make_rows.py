"""A large input for the planner's memory and speed: N short documents under 16 shared prefixes (references), as
Parquet written in row groups (never all rows in memory), and a job file over it.

    python -m bench.make_rows 1000000 /tmp/rows-1m        # -> /tmp/rows-1m/docs.parquet, /tmp/rows-1m/job.yaml
    /usr/bin/time -v batchgen plan /tmp/rows-1m/job.yaml   # peak RSS: "Maximum resident set size"

``--duplicates F``: that fraction of the rows repeat an earlier row's document under a new id (generation.dedup).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

GROUPS = 16
ROW_GROUP = 100_000
_WORDS = ("order refund parcel delayed invoice charged twice account locked password reset screen cracked "
          "battery drains fast warranty claim courier missed delivery subscription renewal upgrade plan "
          "discount code expired support ticket reopened replacement unit arrived damaged").split()


def reference(g: int) -> str:
    rng = random.Random(1000 + g)
    return f"Policy {g}. " + " ".join(rng.choice(_WORDS) for _ in range(120)) + "."


def write_rows(n: int, out: Path, duplicates: float = 0.0, seed: int = 0) -> Path:
    """``out``/docs.parquet with ``n`` rows: id, category, reference, document."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "docs.parquet"
    refs = [reference(g) for g in range(GROUPS)]
    schema = pa.schema([("id", pa.string()), ("category", pa.string()), ("reference", pa.string()),
                        ("document", pa.string())])
    rng = random.Random(seed)
    origin = np.arange(n, dtype=np.int64)          # the row whose document each row carries
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, n, ROW_GROUP):
            ids, cats, docs = [], [], []
            for i in range(start, min(n, start + ROW_GROUP)):
                if i and rng.random() < duplicates:           # a repeat of an earlier row's document
                    origin[i] = origin[rng.randrange(i)]
                src = int(origin[i])
                r = random.Random(src * 7919 + seed)
                ids.append(f"row-{i:09d}")
                cats.append(f"c{src % GROUPS}")
                docs.append(" ".join(r.choice(_WORDS) for _ in range(r.randint(12, 30))) + f" (case {src}).")
            w.write_table(pa.table({"id": ids, "category": cats,
                                    "reference": [refs[int(c[1:])] for c in cats], "document": docs},
                                   schema=schema))
    return path


def write_job(out: Path, data: Path, max_tokens: int = 4) -> Path:
    job = out / "job.yaml"
    job.write_text(f"""name: rows-{out.name}
input: {{path: {data}, id_column: id}}
prompt: {{system: "Summarize the case in one line.", reference_column: reference, document_column: document}}
generation: {{max_tokens: {max_tokens}, temperature: 0.0}}
output: {{path: {out / 'out.parquet'}}}
""")
    return job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=int)
    ap.add_argument("out", type=Path)
    ap.add_argument("--duplicates", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=4)
    a = ap.parse_args()
    data = write_rows(a.rows, a.out, a.duplicates)
    print(write_job(a.out, data, a.max_tokens))


if __name__ == "__main__":
    main()
