"""Row -> prompt: head/document/tail split, shared head ids, bad cells, on_too_long policy."""
import pytest

from pipeline.job.job_file import PromptSpec
from pipeline.job.prompts import PromptRenderer, RowError, RowKeyer, row_key


def test_split_and_shared_head(tiny_tokenizer):
    spec = PromptSpec(system="Be brief.", reference_column="ref",
                      template="{system}\nRef: {reference}\n[{category}] Doc: {document}\nSummary:")
    r = PromptRenderer(spec, tiny_tokenizer)
    a = r.render({"document": "first doc", "ref": "R1", "category": "x"})
    b = r.render({"document": "second doc", "ref": "R1", "category": "x"})
    assert a.head == "Be brief.\nRef: R1\n[x] Doc: " and a.tail == "\nSummary:" and a.head == b.head
    assert r.head_ids(a.head)[0] == tiny_tokenizer.bos_token_id
    assert r.tail_ids(a.tail)[0] != tiny_tokenizer.bos_token_id


@pytest.mark.parametrize("doc, needle", [(None, "null"), ("  ", "empty"), (42, "must be text"),
                                         (b"\xff\xfe", "not valid UTF-8")])
def test_bad_cells(tiny_tokenizer, doc, needle):
    r = PromptRenderer(PromptSpec(), tiny_tokenizer)
    with pytest.raises(RowError, match=needle):
        r.render({"document": doc})


def test_too_long_policy(tiny_tokenizer):
    head, tail, doc = (1, 5, 6), (7,), list(range(10, 30))
    err = PromptRenderer(PromptSpec(), tiny_tokenizer)
    with pytest.raises(RowError, match="exceeds the model's context of 16"):
        err.fit(head, doc, tail, max_model_len=16, max_tokens=4)
    cut = PromptRenderer(PromptSpec(on_too_long="truncate_document"), tiny_tokenizer)
    assert cut.fit(head, doc, tail, max_model_len=16, max_tokens=4) == doc[:8]
    with pytest.raises(RowError, match="alone"):
        cut.fit(head, doc, tail, max_model_len=6, max_tokens=4)


def test_row_key_changes_with_content():
    assert row_key("a", "x", "f") == row_key("a", "x", "f")
    assert row_key("a", "x", "f") != row_key("a", "y", "f") != row_key("a", "x", "g")
    assert row_key("a", "x", "f").startswith("a#")


def test_row_keyer_gives_row_key_of_the_whole_text():
    """prepare's per-head hash states give exactly row_key(head + rest): committed results keep matching."""
    keyer = RowKeyer("fp")
    cases = [("r1", "shared head ", "doc one"), ("r2", "shared head ", "doc two"), ("r3", "", "no head"),
             ("r4", "h\ud800", "lone surrogate"), ("r1", "shared head ", "doc one")]
    for rid, head, rest in cases:
        assert keyer.key(rid, head, rest) == row_key(rid, head + rest, "fp")
    assert keyer.key("r1", "ab", "c") != keyer.key("r1", "a", "bd")
