"""The llguidance backend without a model: the tokenizer prepared from the disk cache behaves as the one prepared
from tokenizer.json, grammars compile once per distinct constraint, the request state follows the outputs."""
import pytest
import torch

import engine.structured.llguidance_backend as lb
from engine.structured.params import StructuredOutputsParams
from engine.structured.state import RequestGrammar
from tests.model_utils import tiny_tokenizer

VOCAB = 320      # the model's rows: more than the tokenizer's 300 ids
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 50}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture
def tok():
    return tiny_tokenizer()


def _walk(backend, tok, text):
    """(forced tokens, allowed mask) at every step of matching ``text`` token by token."""
    m = backend.new_matcher(backend.compile(StructuredOutputsParams(json=SCHEMA)))
    g = RequestGrammar(m, VOCAB, (2,))
    seen = []
    for t in tok.encode(text, add_special_tokens=False):
        seen.append((g.allowed().clone(), m.forced_tokens()))
        assert g.allows(t)
        g.advance([t], forced=False)
    seen.append((g.allowed().clone(), m.forced_tokens()))
    return seen


def test_disk_cached_tokenizer_matches_a_fresh_one(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    fresh = lb.LLGuidanceBackend(tok, VOCAB, (2,), cache_key="tiny")
    assert list(tmp_path.glob("tokenizers/tiny/llguidance-*.npz"))          # written beside the tokenizer cache
    assert lb.LLGuidanceBackend(tok, VOCAB, (2,), cache_key="tiny").ll_tokenizer is fresh.ll_tokenizer  # in-process
    lb._prepared.clear()
    cached = lb.LLGuidanceBackend(tok, VOCAB, (2,), cache_key="tiny")
    assert cached.ll_tokenizer is not fresh.ll_tokenizer
    text = '{"name":"fox","n":42}'
    for (a_mask, a_ff), (b_mask, b_ff) in zip(_walk(fresh, tok, text), _walk(cached, tok, text)):
        assert torch.equal(a_mask, b_mask) and a_ff == b_ff
    assert not _walk(cached, tok, text)[0][0][300:].any()                 # ids past the tokenizer's: never


def test_a_damaged_cache_is_rebuilt(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    lb.LLGuidanceBackend(tok, VOCAB, (2,), cache_key="tiny")
    path, = tmp_path.glob("tokenizers/tiny/llguidance-*.npz")
    path.write_bytes(b"not a zip")
    lb._prepared.clear()
    backend = lb.LLGuidanceBackend(tok, VOCAB, (2,), cache_key="tiny")
    assert _walk(backend, tok, '{"name":"a","n":1}')
    assert path.stat().st_size > 100


def test_compiled_once_per_distinct_constraint(tok):
    backend = lb.LLGuidanceBackend(tok, VOCAB, (2,))
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json=dict(reversed(list(SCHEMA.items()))))      # the same schema, other key order
    assert backend.compile(a) is backend.compile(b)
    backend.compile(StructuredOutputsParams(regex="[0-9]+"))
    assert backend._compiled.misses == 2
    m1, m2 = backend.new_matcher(backend.compile(a)), backend.new_matcher(backend.compile(a))
    m1.consume(tok.encode('{"name":"', add_special_tokens=False))
    assert m2.forced_tokens() != m1.forced_tokens()                          # each request its own state


def test_state_follows_the_outputs(tok):
    backend = lb.LLGuidanceBackend(tok, VOCAB, (2,))
    g = RequestGrammar(backend.new_matcher(backend.compile(StructuredOutputsParams(regex="ab(c|d)e"))), VOCAB, (2,))
    ids = [tok.convert_tokens_to_ids(c) for c in "abce"]
    forced = g.advance(ids[:1])                                              # 'b' is forced after 'a'
    assert forced == [ids[1]]
    outputs = ids[:1] + forced
    assert not g.allows(2)                                                   # EOS: not before the match is whole
    g.sync(outputs[:1])                                                      # cut back (a stop, a length cut)
    assert g.allows(ids[1]) and not g.allows(ids[2])
    g.sync(outputs + [ids[2]])                                               # forward again
    assert g.allows(ids[3]) and not g.allows(ids[2])
    assert g.advance([ids[3]]) == [2]                                        # complete: EOS is all that can follow
    assert g.valid_prefix([ids[0], ids[1]]) == 0


def test_allowed_ids_are_the_mask(tok):
    backend = lb.LLGuidanceBackend(tok, VOCAB, (2,))
    for constraint in ({"json": SCHEMA}, {"regex": "[0-9]{2,4}"}, {"choice": ["ab", "cd"]}):
        g = RequestGrammar(backend.new_matcher(backend.compile(StructuredOutputsParams(**constraint))), VOCAB, (2,))
        for _ in range(3):                                                   # the first states of each
            mask = g.allowed()
            assert torch.equal(g.allowed_ids(VOCAB), mask.nonzero().squeeze(1))
            assert g.allowed_ids(int(mask.sum()) - 1) is None
            g.advance([int(mask.nonzero()[0])], forced=False)
    g = RequestGrammar(backend.new_matcher(backend.compile(StructuredOutputsParams(regex="a"))), VOCAB, (2,))
    g.advance([tok.convert_tokens_to_ids("a")], forced=False)
    g.fill()
    assert g.allowed_ids(10).tolist() == [2]                                # complete: EOS alone
