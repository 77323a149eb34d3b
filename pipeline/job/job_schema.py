"""The job file's schema: every key with its type and whether it is required, and the checks that report a key
that is unknown (with a did-you-mean), missing or of the wrong type — ``pipeline.job.job_file`` parses with them."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml

from engine import EngineConfig, SamplingParams


class _Enum(tuple):
    """Allowed string values of a key."""


# Schema: key -> (type, required). Types: str, int, float, bool, list (of str), _Enum(...), or a nested dict.
_INPUT = {
    "path": (str, True),
    "format": (_Enum(("parquet", "datasets", "openai_batch")), False),
    "id_column": (str, False),
    "split": (str, False),
    "limit": (int, False),
    "batch_size": (int, False),
    "allow_duplicate_ids": (bool, False),
}
_PROMPT = {
    "system": (str, False),
    "system_column": (str, False),
    "reference": (str, False),
    "reference_column": (str, False),
    "document_column": (str, False),
    "template": (str, False),
    "chat_template": (bool, False),
    "on_too_long": (_Enum(("error", "truncate_document", "map_reduce")), False),
    "reduce_template": (str, False),
}
_OUTPUT = {
    "path": (str, True),
    "format": (_Enum(("parquet", "openai_batch")), False),
    "include_columns": (list, False),
    "rows_per_shard": (int, False),
    "keep_deleted_rows": (bool, False),
    "keep_runs": (int, False),
}


def _dataclass_schema(cls, skip=()) -> dict:
    kinds = {"int": int, "float": float, "bool": bool, "str": str, "int | None": int, "float | None": float,
             "str | None": str, "tuple[str, ...]": list, "tuple[int, ...]": "int_list", "int | str | None": str,
             "SpecConfig | None": "switch_or_mapping", "Kernels | None": "mapping"}
    return {f.name: (kinds.get(str(f.type), str), False) for f in dataclasses.fields(cls) if f.name not in skip}


_STRUCTURED = {    # vLLM's names (engine.StructuredOutputsParams); exactly one of the first four
    "json": ("schema", False),          # a JSON Schema mapping, or a .json file relative to the job file
    "regex": (str, False),
    "choice": (list, False),
    "grammar": (str, False),            # Lark / EBNF text, or a file relative to the job file
    "json_object": (bool, False),
    "disable_any_whitespace": (bool, False),
}
_GENERATION = {**_dataclass_schema(SamplingParams), "structured_outputs": (_STRUCTURED, False),
               "dedup": (bool, False)}     # identical requests computed once (pipeline.prepare.dedup); not sampling
_ENGINE = _dataclass_schema(EngineConfig, skip=("model",))
TOP = {
    "name": (str, True),
    "description": (str, False),
    "model": (str, False),
    "input": (_INPUT, True),
    "prompt": (_PROMPT, False),         # required unless input.format is openai_batch
    "generation": (_GENERATION, False),
    "output": (_OUTPUT, True),
    "engine": (_ENGINE, False),
    "schedule": (str, False),
    "allow_outside_files": (bool, False),   # schema / grammar files outside the job file's folder may be read
}


def line_map(node, prefix: str = "", out: dict | None = None) -> dict:
    """Dotted key -> 1-based line of that key in the YAML file."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{prefix}.{k.value}" if prefix else str(k.value)
            out[key] = k.start_mark.line + 1
            line_map(v, key, out)
    return out


def check_type(value: Any, kind, key: str, problems: list[tuple[str, str]]) -> Any:
    def bad(expected: str):
        problems.append((key, f"expected {expected}, got {type(value).__name__} {value!r}"))

    if isinstance(kind, _Enum):
        if value not in kind:
            hint = difflib.get_close_matches(str(value), list(kind), n=1)
            problems.append((key, f"must be one of {', '.join(kind)}; got {value!r}"
                                  + (f" (did you mean {hint[0]!r}?)" if hint else "")))
    elif kind is bool and not isinstance(value, bool):
        bad("true or false")
    elif kind is int and (isinstance(value, bool) or not isinstance(value, int)) and value is not None:
        bad("an integer")
    elif kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        bad("a number")
    elif kind is str and not isinstance(value, str):
        bad("a string")
    elif kind is list:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            bad("a list of strings" + ("; YAML reads yes, no, on, off as true / false: quote them"
                                       if isinstance(value, list) and any(isinstance(v, bool) for v in value) else ""))
    elif kind == "int_list":
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            bad("a list of integers")
    elif kind == "mapping" and value is not None and not isinstance(value, dict):     # e.g. engine.kernels
        bad("a mapping")
    elif kind == "schema" and not isinstance(value, (dict, str)):
        bad("a JSON Schema mapping or the path of a .json file")
    elif kind == "switch_or_mapping":          # e.g. speculative_config: off | auto | {key: value, ...}
        if isinstance(value, bool):            # YAML 1.1 reads a bare off / on as false / true
            return "auto" if value else "off"
        if value is not None and not isinstance(value, (str, dict)):
            bad("off, auto or a mapping")
    return value


def check_mapping(data: Any, schema: dict, prefix: str, problems: list[tuple[str, str]]) -> dict:
    if not isinstance(data, dict):
        problems.append((prefix or "(top level)", f"expected a mapping of keys, got {type(data).__name__}"))
        return {}
    out = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in schema:
            hint = difflib.get_close_matches(str(key), list(schema), n=1)
            problems.append((dotted, "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint
                                                     else f"; known keys: {', '.join(schema)}")))
            continue
        kind, _ = schema[key]
        if isinstance(kind, dict):
            out[key] = check_mapping(value, kind, dotted, problems)
        else:
            out[key] = check_type(value, kind, dotted, problems)
    for key, (_, required) in schema.items():
        if required and key not in data:
            problems.append((f"{prefix}.{key}" if prefix else key, "missing required key"))
    return out


__all__ = ["TOP", "line_map", "check_type", "check_mapping"]
