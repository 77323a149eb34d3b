"""llguidance's grammar text for each kind of constraint, and what llguidance says is wrong with one.

Needs no tokenizer and no model, so ``check_structured`` runs it at plan time. ``params`` is a
``StructuredOutputsParams`` (not imported: that module calls this one).
"""
from __future__ import annotations

import json
import re

import llguidance as llg

# disable_any_whitespace: one separator, no free whitespace between tokens (vLLM's name).
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_FLEXIBLE = {"whitespace_flexible": True}


def grammar_text(params) -> str:
    """llguidance's grammar for the constraint, not yet validated (ValueError: not even that)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else '{"type": "object"}'
        options = _COMPACT if params.disable_any_whitespace else _FLEXIBLE
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(list(params.choice)))
    return llg.grammar_from("grammar", params.grammar)          # Lark, or GBNF (converted to Lark)


def grammar_problem(grammar: str, tokenizer: llg.LLTokenizer | None = None) -> tuple[str, str | None] | None:
    """None when llguidance accepts ``grammar``; else (its message, the schema keyword to blame or None).
    Without a tokenizer the check is the grammar's alone (plan time); with one, also its tokens."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if not is_error:
        return None
    message = (messages[0] if messages else "rejected by the grammar compiler").strip()
    return message, _keyword(message)


def _keyword(message: str) -> str | None:
    m = re.search(r'Unimplemented keys: \["([^"]+)"', message)       # e.g. if / then, uniqueItems
    if m:
        return m.group(1)
    if message.startswith("Unknown format"):
        return "format"
    return None
