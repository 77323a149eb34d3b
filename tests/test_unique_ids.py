"""Row ids checked unique from 8-byte hashes (pipeline/prepare/unique_ids.py): a repeat is found and named with
its row; a hash collision between different ids is confirmed away, never reported."""
import pipeline.prepare.unique_ids as unique_ids
from pipeline.prepare.unique_ids import UniqueIds


def _check(ids):
    u = UniqueIds()
    for rid in ids:
        u.add(rid)
    return u.first_repeat(lambda: enumerate(ids))


def test_a_repeated_id_is_named_with_the_row_it_repeats_at():
    assert _check([f"r{i}" for i in range(1000)]) is None
    assert _check(["a", "b", "c", "b", "a"]) == ("b", 3)


def test_a_hash_collision_is_not_a_repeat(monkeypatch):
    monkeypatch.setattr(unique_ids, "id_hash", lambda rid: 7)          # every id collides
    u = UniqueIds()
    for rid in ("x", "y", "z"):
        u.add(rid)
    assert u.repeated_hashes() == {7}
    assert u.first_repeat(lambda: enumerate(["x", "y", "z"])) is None
    assert u.first_repeat(lambda: enumerate(["x", "y", "x"])) == ("x", 2)


def test_ids_are_read_again_only_when_a_hash_repeats():
    u = UniqueIds()
    u.add("only")
    assert u.first_repeat(lambda: (_ for _ in ()).throw(AssertionError("read again"))) is None


def test_ids_past_the_memory_buffer_are_checked_on_disk():
    """More ids than the in-memory buffer holds (they go to the on-disk parts): a repeat is still found."""
    ids = [f"id-{i}" for i in range(3 * unique_ids._BUFFER)] + ["id-5"]
    assert _check(ids) == ("id-5", len(ids) - 1)
    assert _check(ids[:-1]) is None
