"""Per-row records on disk (pipeline/prepare/spool.py): read back in append order whatever the buffering and
chunking; partitions keep every record, each in the part its hash names."""
import numpy as np

from pipeline.prepare.spool import Partitions, Spool

REC = np.dtype([("group", "<i4"), ("len", "<i4")])


def test_records_come_back_in_order_across_flushes_and_chunks():
    s = Spool(REC, buffer_rows=7)
    expected = np.zeros(0, REC)
    rng = np.random.default_rng(0)
    for n in (3, 0, 10, 1, 25, 6):
        part = np.zeros(n, REC)
        part["group"], part["len"] = rng.integers(0, 9, n), rng.integers(1, 500, n)
        s.append(part)
        expected = np.concatenate([expected, part])
    assert s.rows == len(expected) == 45
    for rows in (1, 4, 45, 100):
        chunks = list(s.chunks(rows))
        assert [len(c) for c in chunks[:-1]] == [rows] * (len(chunks) - 1)
        assert np.concatenate(chunks).tolist() == expected.tolist()
    s.close()
    assert list(Spool(REC).chunks()) == []


def test_partitions_keep_every_record_in_its_hashs_part():
    p = Partitions(np.uint64, count=8, buffer_rows=5)
    values = np.arange(1000, dtype=np.uint64) * np.uint64(2654435761)
    for a in range(0, 1000, 97):
        p.add(values[a:a + 97], values[a:a + 97])
    parts = list(p.parts())
    assert p.rows == 1000 and sum(len(x) for x in parts) == 1000
    assert sorted(np.concatenate(parts).tolist()) == sorted(values.tolist())
    for x in parts:                                    # one part: one residue, records in the order added
        assert len(set((x % np.uint64(8)).tolist())) == 1 and (np.diff(x.astype(np.float64)) > 0).all()
    p.close()
