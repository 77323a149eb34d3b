"""The committed keys of an incremental run as sorted 16-byte digests (pipeline/prepare/key_set.py)."""
import numpy as np

from pipeline.prepare.key_set import KeySet, digests


def test_membership_equals_a_python_set():
    members = [f"row-{i}#{i * 7919:020x}" for i in range(5000)] + ["", "é", "ids repeat"]
    ks = KeySet([digests(members[:1000]), digests(members[1000:])])
    assert len(ks) == len(members)
    probes = members[::3] + [f"row-{i}#{i * 7919 + 1:020x}" for i in range(2000)] + ["é ", "x"]
    want = [p in set(members) for p in probes]
    assert ks.contains_all(probes).tolist() == want
    assert [p in ks for p in probes[:50]] == want[:50]


def test_empty_sets_hash_nothing_and_hold_nothing():
    assert not KeySet() and len(KeySet([])) == 0
    assert KeySet().contains_all(["a", "b"]).tolist() == [False, False]
    assert "a" not in KeySet()


def test_repeated_high_words_are_decided_by_the_low_word():
    ks = KeySet([np.array([[5, 1], [5, 3], [5, 2], [9, 9]], dtype=np.uint64)])
    probe = np.array([[5, 2], [5, 4], [9, 9], [1, 1], [10, 0]], dtype=np.uint64)
    assert ks.contains(probe).tolist() == [True, False, True, False, False]
