"""The output's join in bounded memory (pipeline/assemble/join.py): keys in input order joined with committed results
through P bucket files, merged back in input order; the first committed result of a key wins."""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from pipeline.assemble.join import KeyedResults, key_buckets
from pipeline.job.rows import KEYS_SCHEMA, ResultRow, results_table


def _key(i: int) -> str:
    return f"doc-{i}#{random.Random(i).getrandbits(80):020x}"


def _keys_file(path, keys: list[str], batch: int = 1000):
    with pa.ipc.new_file(str(path), KEYS_SCHEMA) as w:
        for a in range(0, len(keys), batch):
            w.write_batch(pa.record_batch([pa.array(range(a, a + len(keys[a:a + batch])), pa.int64()),
                                           pa.array(keys[a:a + batch], pa.string())], schema=KEYS_SCHEMA))
    return path


def _parts(keys: list[str], seed: int, per_part: int = 97) -> list[pa.Table]:
    """Results of ``keys`` committed in a shuffled order, in parts; each summary names the key and the part."""
    order = list(keys)
    random.Random(seed).shuffle(order)
    return [results_table([ResultRow(k, summary=f"{k}@{seed}/{a}", finish_reason="length", prompt_tokens=3,
                                     cached_tokens=1, error="bad" if k.endswith("0") else None)
                           for k in order[a:a + per_part]]) for a in range(0, len(order), per_part)]


@pytest.mark.parametrize("chunk_rows", [64, 1000, 5000])
def test_rows_come_back_in_input_order_whatever_the_buckets(tmp_path, chunk_rows):
    keys = [_key(i) for i in range(2500)]
    parts = _parts(keys, seed=1) + _parts(keys[:300], seed=2)       # 300 keys committed twice: the first wins
    parts.append(results_table([ResultRow("gone#" + "0" * 20, summary="a deleted row's")]))
    kr = KeyedResults(_keys_file(tmp_path / "keys.arrow", keys), parts, tmp_path / "scratch", len(keys),
                      chunk_rows=chunk_rows)
    assert kr.num_buckets == -(-2500 // chunk_rows)
    counts = kr.prepare()
    rows = pa.concat_tables(list(kr.rows_in_order()))
    assert rows.column("row_idx").to_pylist() == list(range(2500))
    assert rows.column("row_key").to_pylist() == keys
    assert all(s.startswith(f"{k}@1/") for s, k in zip(rows.column("summary").to_pylist(), keys))
    assert (counts.rows, counts.missing, counts.prompt_tokens, counts.cached_tokens) == (2500, 0, 7500, 2500)
    assert counts.rows_with_error == sum(k.endswith("0") for k in keys)
    compacted = pa.concat_tables(list(kr.results()))
    assert sorted(compacted.column("row_key").to_pylist()) == sorted(keys + ["gone#" + "0" * 20])
    assert all("@1/" in s for s in compacted.column("summary").to_pylist() if "@" in s)
    kr.close()
    assert not (tmp_path / "scratch").exists()


def test_rows_without_a_result_are_counted_before_anything_is_written(tmp_path):
    keys = [_key(i) for i in range(500)]
    kr = KeyedResults(_keys_file(tmp_path / "keys.arrow", keys), _parts(keys[:450], seed=3), tmp_path / "s",
                      len(keys), chunk_rows=128)
    assert kr.prepare().missing == 50
    rows = pa.concat_tables(list(kr.rows_in_order()))
    assert rows.column("row_key").to_pylist() == keys
    assert rows.column("finish_reason").null_count == 50


def test_no_rows(tmp_path):
    kr = KeyedResults(_keys_file(tmp_path / "keys.arrow", []), [], tmp_path / "s", 0)
    assert kr.prepare().rows == 0
    assert list(kr.rows_in_order()) == []
    assert sum(t.num_rows for t in kr.results()) == 0


def test_key_buckets_are_a_function_of_the_key_and_spread_evenly():
    keys = [_key(i) for i in range(40_000)] + ["", "a", "é", "ab#c"]
    b = key_buckets(pa.array(keys), 16)
    assert b.min() >= 0 and b.max() < 16
    again = key_buckets(pa.chunked_array([pa.array(keys[:7]), pa.array(keys[7:])]).slice(3), 16)
    assert np.array_equal(again, b[3:])                         # chunking and slicing change nothing
    assert np.array_equal(key_buckets(pa.array(keys, pa.large_string()), 16), b)
    counts = np.bincount(b[:40_000], minlength=16)
    assert counts.min() > 0.9 * 2500 and counts.max() < 1.1 * 2500
    assert not key_buckets(pa.array(keys), 1).any()


def test_a_keys_file_that_does_not_cover_every_row_once_is_refused(tmp_path):
    from pipeline.problems import RunError
    keys = [_key(i) for i in range(3)]
    path = tmp_path / "keys.arrow"
    with pa.ipc.new_file(str(path), KEYS_SCHEMA) as w:
        w.write_batch(pa.record_batch([pa.array([0, 0, 2], pa.int64()), pa.array(keys, pa.string())],
                                      schema=KEYS_SCHEMA))
    kr = KeyedResults(path, _parts(keys, seed=4), tmp_path / "s", 3)
    assert kr.prepare().missing == 0
    with pytest.raises(RunError, match="not each keyed once"):
        list(kr.rows_in_order())
