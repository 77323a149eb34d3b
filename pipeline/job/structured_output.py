"""Structured outputs in the pipeline (the engine constrains generation; engine/structured):

    job syntax     ``generation.structured_outputs``: one of ``json`` (a mapping, or a ``.json`` file relative to the
                   job file), ``regex``, ``choice``, ``grammar`` (text or a file) -> ``resolve_job_spec``
    typed columns  an object schema's top-level properties, one Arrow column each (``output_fields``), named
                   exactly after the property; refused at plan time when a name is an output column's
    row check      every result against its schema before it is committed (``json_error``: None when valid)

Columns are derived from ``summary`` (the raw JSON) when the output is assembled, so every part of a resumed or
incremental run gives the same typed schema.
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

import pyarrow as pa

from engine import StructuredOutputError, StructuredOutputsParams
from pipeline.job.rows import RESULT_COLUMNS

JSON_KINDS = ("json", "json_object")        # kinds whose results are checked and get a ``json_error`` column
_GRAMMAR_FILES = (".lark", ".ebnf", ".gbnf", ".txt")
_INT64 = (-(1 << 63), (1 << 63) - 1)


class Unfit(ValueError):
    """A value the schema allowed but its column cannot hold (an integer beyond int64)."""


# ---- job syntax ----------------------------------------------------------------------------------------------
def resolve_job_spec(spec: dict, job_file: str, allow_outside: bool = False) -> tuple[dict, dict]:
    """``generation.structured_outputs`` as written -> (``StructuredOutputsParams`` keywords, the files read:
    kind -> path as written). A ``json`` path is read (relative to the job file), a ``grammar`` that names a file is
    read; a file outside the job file's folder (after symlinks) only with ``allow_outside``. Raises
    ``ValueError(key, message)``; messages name paths and positions, never a file's contents."""
    out, files = dict(spec), {}
    base = Path(job_file).parent
    schema = out.get("json")
    if isinstance(schema, str) and not schema.lstrip().startswith("{"):
        text = _read_job_file(base, schema, "json", "schema", allow_outside)
        try:
            out["json"] = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError("json", f"the schema file {schema} is not valid JSON ({e.msg} at line {e.lineno}, "
                                     f"column {e.colno})") from None
        files["json"] = schema
    grammar = out.get("grammar")
    if isinstance(grammar, str) and "\n" not in grammar.strip():
        path = base / grammar.strip()
        if path.is_file() or path.suffix in _GRAMMAR_FILES:
            out["grammar"] = _read_job_file(base, grammar.strip(), "grammar", "grammar", allow_outside)
            files["grammar"] = grammar.strip()
    return out, files


_MAX_FILE_BYTES = 16 << 20


def _read_job_file(base: Path, written: str, key: str, what: str, allow_outside: bool) -> str:
    """The text of a file a job names (relative to its folder ``base``); ``ValueError(key, message)`` when it leaves
    that folder (unless ``allow_outside``), is not a regular file, is too large or is not UTF-8 text."""
    real, root = Path(os.path.realpath(base / written)), Path(os.path.realpath(base))
    if not allow_outside and real != root and root not in real.parents:
        raise ValueError(key, f"the {what} file {written} resolves to {real}, outside the job file's folder {root}; "
                              "move it beside the job file, or set allow_outside_files: true in the job file")
    try:
        if not real.is_file():
            raise ValueError(key, f"cannot read the {what} file {written} ({real}): "
                                  + ("not a regular file" if real.exists() else "no such file"))
        if real.stat().st_size > _MAX_FILE_BYTES:
            raise ValueError(key, f"the {what} file {written} is larger than {_MAX_FILE_BYTES >> 20} MiB")
        return real.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(key, f"cannot read the {what} file {written} ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(key, f"the {what} file {written} is not UTF-8 text ({e.reason} at byte {e.start})") \
            from None


_POSITION = re.compile(r"\b(line|column|col|char|character|position|offset|byte) (\d+)", re.IGNORECASE)
_SCHEMA_KEYWORDS = frozenset(
    "$ref $defs definitions type enum const properties required additionalProperties patternProperties items "
    "prefixItems minItems maxItems uniqueItems contains minLength maxLength pattern format minimum maximum "
    "exclusiveMinimum exclusiveMaximum multipleOf anyOf oneOf allOf not if then else dependentRequired "
    "dependentSchemas propertyNames minProperties maxProperties unevaluatedProperties unevaluatedItems".split())


def file_error(kind: str, written: str, e: Exception) -> str:
    """A structured-outputs error about a file the job named, without the file's contents (engines quote
    grammars and schemas): what is wrong, where in the file when the engine says, the schema keyword to blame."""
    what = "schema file" if kind == "json" else "grammar file"
    where = ", ".join(f"{m.group(1).lower()} {m.group(2)}" for m in _POSITION.finditer(str(e)))
    keyword = getattr(e, "keyword", None)
    detail = "; ".join(filter(None, (where, f"keyword {keyword!r}" if keyword in _SCHEMA_KEYWORDS else "")))
    return (f"the {what} {written} is not a valid {'JSON Schema' if kind == 'json' else 'grammar'} for "
            f"structured outputs" + (f" ({detail})" if detail else "") + "; its contents are not shown")


def error_key(e: StructuredOutputError, params: StructuredOutputsParams | None) -> str:
    """The sub-key of ``structured_outputs`` an error is about (its kind, when the params were built)."""
    if params is not None:
        return params.kind
    return next((k for k in ("json", "regex", "choice", "grammar") if f"structured_outputs.{k}" in str(e)), "")


def describe_error(e: StructuredOutputError) -> str:
    """The message, naming the schema keyword to blame when one is."""
    return f"{e}" + (f" (keyword {e.keyword!r})" if getattr(e, "keyword", None) and e.keyword not in str(e) else "")


# ---- typed columns -------------------------------------------------------------------------------------------
def _resolve(schema, root: dict, seen: tuple = ()) -> dict | None:
    """A local ``$ref`` (``#/$defs/x``) followed; None for a recursive or remote one (-> a JSON text column)."""
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/") or ref in seen:
            return None
        seen = seen + (ref,)
        node = root
        for part in ref[2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        schema = node
    return schema if isinstance(schema, dict) else None


_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
_PLAIN = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
JSON_TEXT = {"json": "true"}         # field metadata: the column holds each value's JSON text (strings quoted)


def _types(schema: dict) -> tuple[set, bool]:
    """The JSON types a (sub)schema admits ({"any"} when it does not say) and whether null is one of them. Only
    ``type`` (or, without it, the values of ``enum`` / ``const``) says: a schema without ``type`` admits any value
    its other keywords allow (``properties`` alone does not make an object)."""
    t = schema.get("type")
    if isinstance(t, str):
        kinds = {t}
    elif isinstance(t, list) and t and all(isinstance(k, str) for k in t):
        kinds = set(t)
    elif isinstance(schema.get("enum"), list) or "const" in schema:
        values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]]
        kinds = {_NAMES.get(type(v), "other") for v in values}
    else:
        kinds = {"any"}
    return kinds - {"null"}, "null" in kinds


def _arrow(schema, root: dict, depth: int = 0) -> tuple[pa.DataType, bool, bool]:
    """(Arrow type, may be null, holds JSON text) of a (sub)schema: one plain type (numbers: integer and number
    together) gets its column type; anything else (no ``type``, a union, an object without ``properties``, an
    array without one ``items`` schema, a recursive ``$ref``) its JSON text in a string column."""
    schema = _resolve(schema, root)
    if schema is None or depth > 16:
        return pa.string(), True, True
    kinds, nullable = _types(schema)
    if kinds == {"integer", "number"}:
        kinds = {"number"}
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    if kind in _PLAIN:
        return _PLAIN[kind], nullable, False
    items = schema.get("items")
    if kind == "array" and isinstance(items, dict) and "prefixItems" not in schema:
        item, item_null, item_json = _arrow(items, root, depth + 1)
        return pa.list_(_field("item", item, item_null, item_json)), nullable, False
    props = schema.get("properties")
    if kind == "object" and isinstance(props, dict) and props:
        required = schema.get("required") if isinstance(schema.get("required"), list) else ()
        fields = []
        for name, sub in props.items():
            t, n, js = _arrow(sub, root, depth + 1)
            fields.append(_field(name, t, n or name not in required, js))
        return pa.struct(fields), nullable, False
    return pa.string(), True, True


def _field(name: str, t: pa.DataType, nullable: bool, json_text: bool, metadata: dict | None = None) -> pa.Field:
    meta = {**(metadata or {}), **(JSON_TEXT if json_text else {})}
    return pa.field(name, t, nullable=nullable, metadata=meta or None)


def written_schema(generation: dict) -> dict | None:
    """The JSON Schema of a job's ``generation`` (resolved by ``resolve_job_spec``) in the order it was written:
    columns follow the properties' order (``StructuredOutputsParams`` keeps its schema with sorted keys)."""
    spec = generation.get("structured_outputs")
    schema = spec.get("json") if isinstance(spec, dict) else None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    return schema if isinstance(schema, dict) else None


def output_fields(schema: dict | None) -> list[pa.Field]:
    """The typed columns of an object schema's top-level properties ([] for anything else: a schema that admits
    no object, or lists no ``properties``). Top-level columns are all nullable (a row whose JSON is invalid, or is
    not an object, has them null); field metadata says which the schema requires and which hold JSON text;
    nested fields are nullable only where the schema lets them be absent or null."""
    if not isinstance(schema, dict):
        return []
    root = _resolve(schema, schema) or {}
    props = root.get("properties")
    kinds = _types(root)[0]
    if not isinstance(props, dict) or not props or not kinds & {"object", "any"}:
        return []
    required = root.get("required") if isinstance(root.get("required"), list) else ()
    fields = []
    for name, sub in props.items():
        t, _, json_text = _arrow(sub, schema)
        fields.append(_field(name, t, True, json_text, {"required": "true" if name in required else "false"}))
    return fields


def collisions(schema: dict | None, passthrough: tuple[str, ...] = ()) -> list[str]:
    """Top-level properties named like an output column (result, metric, ``json_error`` or passthrough)."""
    taken = set(RESULT_COLUMNS) | set(passthrough)
    return [f.name for f in output_fields(schema) if f.name in taken]


def _json_text(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _convert(value, f: pa.Field):
    """``value`` (parsed JSON that the schema accepted) as field ``f``'s Python value; ``Unfit`` if it cannot be
    (an integer beyond int64, a number beyond double)."""
    t = f.type
    if value is None:
        return None
    if f.metadata and f.metadata.get(b"json") == b"true":
        return _json_text(value)
    if pa.types.is_string(t):
        if isinstance(value, str):
            return value
    elif pa.types.is_boolean(t):
        if isinstance(value, bool):
            return value
    elif pa.types.is_int64(t):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT64[0] <= value <= _INT64[1]:
                raise Unfit(f"{value} does not fit a 64-bit integer column")
            return value
    elif pa.types.is_float64(t):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise Unfit(f"{value} does not fit a double column") from None
    elif pa.types.is_list(t):
        if isinstance(value, list):
            return [_convert(v, t.value_field) for v in value]
    elif pa.types.is_struct(t):
        if isinstance(value, dict):
            return {t.field(i).name: _convert(value.get(t.field(i).name), t.field(i)) for i in range(t.num_fields)}
    raise Unfit(f"{_json_text(value)[:60]} does not fit a {t} column")


def typed_values(obj, fields: list[pa.Field]) -> dict:
    """A valid result's top-level properties as column values (``Unfit`` naming the property); all None when the
    result is not an object (a schema may admit other values too)."""
    if not isinstance(obj, dict):
        return {f.name: None for f in fields}
    out = {}
    for f in fields:
        try:
            out[f.name] = _convert(obj.get(f.name), f)
        except Unfit as e:
            raise Unfit(f"property {f.name!r}: {e}") from None
    return out


def typed_columns(summaries: list, json_errors: list, fields: list[pa.Field]) -> list[pa.Array]:
    """The typed columns of rows (their raw JSON and ``json_error``): a row whose JSON is missing or invalid
    has them all null."""
    cols: dict[str, list] = {f.name: [] for f in fields}
    for text, err in zip(summaries, json_errors):
        values = {}
        if text is not None and err is None:
            try:
                values = typed_values(json.loads(text), fields)
            except (ValueError, TypeError, AttributeError, RecursionError):   # checked when committed; never fail
                values = {}
        for f in fields:
            cols[f.name].append(values.get(f.name))
    return [pa.array(cols[f.name], type=f.type) for f in fields]


# ---- the row check -------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _validator(schema_text: str):
    import jsonschema  # NOTE: only when a job asks for JSON; keeps CLI start-up light
    schema = json.loads(schema_text)
    return jsonschema.validators.validator_for(schema)(schema)


def json_error(text: str | None, finish_reason: str | None, params: StructuredOutputsParams | None,
               fields: list[pa.Field] = (), max_tokens: int | None = None) -> str | None:
    """Why a result does not match its JSON schema (None when it does, or when no JSON was asked for)."""
    if params is None or params.kind not in JSON_KINDS or text is None:
        return None
    try:
        obj = json.loads(text)
    except RecursionError:
        return "not valid JSON (nested too deeply)"
    except ValueError as e:
        if finish_reason == "length":
            return (f"cut off at max_tokens{f' ({max_tokens})' if max_tokens else ''} before the JSON was "
                    "complete (finish_reason length)")
        return f"not valid JSON ({e})"
    if params.kind == "json_object":
        return None if isinstance(obj, dict) else f"not a JSON object (a {type(obj).__name__})"
    errors = sorted(_validator(params.json).iter_errors(obj), key=lambda e: (len(e.path), e.message))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.path)
        cut = " (cut off at max_tokens)" if finish_reason == "length" else ""
        return f"does not match the schema{cut}: {e.message}" + (f" at {where}" if where else "") + \
            f" (keyword {e.validator!r})"
    try:
        typed_values(obj, list(fields))
    except Unfit as e:
        return str(e)
    return None


__all__ = ["JSON_KINDS", "resolve_job_spec", "file_error", "error_key", "describe_error", "written_schema",
           "output_fields",
           "collisions",
           "typed_values", "typed_columns", "json_error"]
