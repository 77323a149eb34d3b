"""What a request asks its output to match, and the check made before any compute."""
from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ConfigError):
    """A schema, regex, choice list or grammar that cannot constrain generation.

    ``field`` is where it was given (filled by the caller: a job file's key, a batch line's body path) and
    ``keyword`` the offending schema keyword or construct, when one is to blame.
    """

    def __init__(self, message: str, keyword: str | None = None):
        super().__init__(message)
        self.keyword = keyword


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON Schema: a mapping, or its JSON text), ``regex``, ``choice`` (strings),
    ``grammar`` (Lark / EBNF text) or ``json_object`` (any JSON object, OpenAI's ``{type: json_object}``).

    Stored hashable: ``json`` as canonical JSON text (``schema`` gives the mapping back), ``choice`` as a tuple.
    Canonical: keys sorted, except the members of ``properties``, which keep their order: JSON is generated with
    the properties in that order (a model reasons better when a "reasoning" field comes before the answer).
    ``disable_any_whitespace`` (default on): JSON is generated compact, no free whitespace between tokens.
    """
    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise StructuredOutputError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS[:4])}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise StructuredOutputError(
                    f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}")
            object.__setattr__(self, "json", _json.dumps(_canonical(schema), separators=(",", ":")))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict | None:
        """The JSON Schema as a mapping (None unless ``json`` was given)."""
        return _json.loads(self.json) if self.json is not None else None

    @property
    def key(self) -> str:
        """One text per distinct constraint: what compiled grammars are cached under."""
        value = {"json": self.json, "choice": list(self.choice or ())}.get(self.kind, getattr(self, self.kind))
        return _json.dumps([self.kind, value, self.disable_any_whitespace])


def _canonical(value: Any, keep_order: bool = False) -> Any:
    if isinstance(value, dict):
        items = list(value.items()) if keep_order else sorted(value.items())
        return {k: _canonical(v, keep_order=(k == "properties" and not keep_order)) for k, v in items}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def schema_path(path) -> str:
    """Where in a schema: ``properties.a.anyOf[1].type`` (keys dotted, list indices in brackets)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _schema_keyword(path: list) -> str | None:
    """The schema keyword at the end of ``path`` (not a property's or definition's name)."""
    for i in range(len(path) - 1, -1, -1):
        if isinstance(path[i], str) and not (i and path[i - 1] in _NAMED):
            return path[i]
    return None


def check_structured(params: StructuredOutputsParams) -> None:
    """Refuse what cannot constrain generation, before any model is loaded (``StructuredOutputError``).

    Checks the form (a valid JSON Schema, a compilable regex, a non-empty choice list, a non-empty grammar),
    then what the grammar backend (llguidance) cannot compile, without a tokenizer: a schema keyword it does not
    implement (``keyword`` names it), an unknown ``format``, a dangling ``$ref``, a regex with look-around, a
    grammar that does not parse.
    """
    if params.kind == "json":
        import jsonschema  # NOTE: only when a schema is given; keeps `import engine` light
        try:
            jsonschema.validators.validator_for(params.schema).check_schema(params.schema)
        except jsonschema.SchemaError as e:
            where = schema_path(e.absolute_path)
            raise StructuredOutputError(
                f"structured_outputs.json is not a valid JSON Schema: {where + ': ' if where else ''}{e.message}",
                keyword=_schema_keyword(list(e.absolute_path)) or str(e.validator)) from None
    elif params.kind == "regex":
        try:
            re.compile(params.regex)
        except re.error as e:
            raise StructuredOutputError(f"structured_outputs.regex does not compile: {e}") from None
    elif params.kind == "choice":
        if not params.choice or any(c == "" for c in params.choice):
            raise StructuredOutputError("structured_outputs.choice must list at least one non-empty string")
    elif params.kind == "grammar" and not params.grammar.strip():
        raise StructuredOutputError("structured_outputs.grammar is empty")
    # NOTE: llguidance only when a constraint is given; keeps `import engine` light.
    from engine.structured.llguidance_grammar import grammar_problem, grammar_text
    try:
        problem = grammar_problem(grammar_text(params))
    except ValueError as e:
        problem = (str(e), None)
    if problem is not None:
        raise StructuredOutputError(f"structured_outputs.{params.kind}: {problem[0]}", keyword=problem[1])
