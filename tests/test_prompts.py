"""Row -> prompt: head/document/tail split, shared head ids, bad cells, on_too_long policy."""
import pytest

from pipeline.job import PromptSpec
from pipeline.prompts import PromptRenderer, RowError, row_key


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
