"""OpenAI Batch files in and out (``input.format: openai_batch``, ``output.format: openai_batch``).

Input: JSONL, one request per line, as OpenAI's Batch API and vLLM's ``run-batch`` read it (``/v1/completions`` too:
its ``body.prompt`` is the text as it is, no chat template, and its output a ``text_completion``):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "system", "content": "..."}, {"role": "user", ...}],
              "max_tokens": 64, "temperature": 0}}

Each line becomes a row (``custom_id``, ``body`` as JSON text, ``line``, ``problem``); the messages go through
the model's chat template, split at the last user message's content (the "document") so that requests with
the same system and earlier messages share a head: the planner groups them and their prefix is prefilled
once. ``body`` sampling fields override the job's ``generation`` per request; ``body.response_format``
(json_schema, json_object, text) becomes the request's structured outputs. A malformed line, an unsupported
endpoint or field, a schema that cannot constrain generation becomes that row's error (named by line and field);
the batch goes on. A JSON answer cut off by max_tokens is returned, with ``finish_reason: length``, as OpenAI does.

Output: JSONL in the Batch output shape, one line per input line in input order:

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {"object": "chat.completion", "choices":
                  [{"index": 0, "message": {"role": "assistant", "content": "..."}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
                            "prompt_tokens_details": {"cached_tokens"}}, ...}},
     "error": null}

and for a failed row ``"response": null, "error": {"code": "invalid_request" | "batchgen_error", "message"}``.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from engine import StructuredOutputError, StructuredOutputsParams, check_structured

READ_SCHEMA = pa.schema([("custom_id", pa.string()), ("body", pa.string()), ("line", pa.int64()),
                         ("problem", pa.string()), ("url", pa.string())])
COLUMNS = ("body", "problem", "line", "url")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT, COMPLETIONS)
ROLES = ("system", "developer", "user", "assistant")

# body field -> SamplingParams field (None: accepted and ignored)
_PARAMS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
           "top_p": "top_p", "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty",
           # vLLM's extensions, same names
           "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
           "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
           "model": None, "user": None, "metadata": None, "store": None,
           "response_format": None}     # -> structured_outputs (``_response_format``)
# accepted only at the value that means "as batchgen does anyway"
_ONLY = {"n": 1, "stream": False, "logprobs": False, "parallel_tool_calls": None,
         "echo": False, "best_of": 1, "suffix": None}            # the last three: /v1/completions


class RequestError(ValueError):
    """One request cannot run as written; the message becomes its row's error."""


# ---- reading ---------------------------------------------------------------------------------------------
def _parse_line(text: str, lineno: int) -> dict:
    row = {"custom_id": None, "body": None, "line": lineno, "problem": None, "url": None}
    try:
        req = json.loads(text)
    except ValueError as e:
        row["problem"] = f"line {lineno}: not valid JSON ({e})"
        return row
    if not isinstance(req, dict):
        row["problem"] = f"line {lineno}: expected a JSON object, got {type(req).__name__}"
        return row
    cid = req.get("custom_id")
    row["custom_id"] = str(cid) if cid is not None else None
    problems = []
    if cid is None:
        problems.append("missing custom_id")
    if req.get("method", "POST") != "POST":
        problems.append(f"method {req.get('method')!r} is not supported (only POST)")
    if req.get("url") not in URLS:
        problems.append(f"url {req.get('url')!r} is not supported (only {', '.join(URLS)})")
    else:
        row["url"] = req["url"]
    body = req.get("body")
    if not isinstance(body, dict):
        problems.append("body must be a JSON object")
    else:
        row["body"] = json.dumps(body, sort_keys=True, ensure_ascii=False)
    if problems:
        row["problem"] = f"line {lineno}: " + "; ".join(problems)
    return row


def iter_request_batches(path: str, batch_size: int = 1024) -> Iterator[pa.RecordBatch]:
    """The file's requests (blank lines skipped) as record batches of ``READ_SCHEMA``."""
    rows = []
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            rows.append(_parse_line(text, lineno))
            if len(rows) >= batch_size:
                yield pa.RecordBatch.from_pylist(rows, schema=READ_SCHEMA)
                rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=READ_SCHEMA)


def count_requests(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


# ---- one request -> prompt + sampling overrides ----------------------------------------------------------
def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) for p in c):
        kinds = {p.get("type") for p in c}
        if kinds <= {"text"}:
            return "".join(str(p.get("text", "")) for p in c)
        raise RequestError(f"body.messages[{i}].content: only text parts are supported, got "
                           f"{', '.join(sorted(str(k) for k in kinds - {'text'}))}")
    raise RequestError(f"body.messages[{i}].content must be a string or a list of text parts")


def parse_body(body_json: str, problem: str | None, url: str | None = CHAT) -> tuple[list[dict] | str, dict]:
    """(messages with text content, SamplingParams overrides) of a chat request; of a ``/v1/completions`` one
    (``url``), (its prompt text, overrides). ``RequestError`` names the field."""
    if problem:
        raise RequestError(problem)
    body = json.loads(body_json)
    completion = url == COMPLETIONS
    _check_fields(body, "prompt" if completion else "messages")
    text = _completion_prompt(body) if completion else _messages(body)
    return text, _overrides(body)


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("body.prompt must be a string (one prompt a request)")
    return prompt


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"body.messages[{i}].role must be one of {', '.join(ROLES)}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    if out[-1]["role"] != "user":
        raise RequestError("body.messages: the last message must be the user's")
    return out


def _check_fields(body: dict, text_field: str) -> None:
    """Every field known (``text_field``: the prompt's, messages or prompt), the fixed ones at their value."""
    unknown = [k for k in body if k not in _PARAMS and k not in _ONLY and k != text_field]
    if unknown:
        raise RequestError(f"body.{unknown[0]} is not supported by batchgen (supported: "
                           f"{', '.join(sorted(set(_PARAMS) | set(_ONLY) | {text_field}))})")
    for k, allowed in _ONLY.items():
        if k in body and body[k] not in (allowed, None):
            raise RequestError(f"body.{k} = {body[k]!r} is not supported (only {allowed!r})")


def _overrides(body: dict) -> dict:
    """The body's sampling fields as SamplingParams overrides."""
    overrides = {_PARAMS[k]: v for k, v in body.items() if _PARAMS.get(k) and v is not None}
    if "stop" in overrides:
        stop = overrides["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise RequestError(f"body.stop must be a string or a list of strings, got {overrides['stop']!r}"[:200])
        overrides["stop"] = tuple(stop)
    so = _response_format(body.get("response_format"))
    if so is not None:
        overrides["structured_outputs"] = so
    return overrides


def _response_format(rf) -> StructuredOutputsParams | None:
    """``body.response_format`` as structured outputs: ``{type: json_schema, json_schema: {name, schema, strict}}``
    (always generated strictly), ``{type: json_object}``, ``{type: text}`` (None: the job's generation applies).
    A schema that cannot constrain generation is this request's error, naming the field and the keyword."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RequestError(f"body.response_format.type must be text, json_object or json_schema; got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError("body.response_format.json_schema.schema must be a JSON Schema object")
    try:
        so = StructuredOutputsParams(json=spec["schema"])
        check_structured(so)
    except StructuredOutputError as e:
        keyword = f" (keyword {e.keyword!r})" if e.keyword else ""
        raise RequestError(f"body.response_format.json_schema.schema: {e}{keyword}") from None
    return so


# ---- writing ---------------------------------------------------------------------------------------------
def response_line(custom_id: str | None, row: dict, model: str, created: int) -> dict:
    """One output line from a committed result row (``rows.RESULT_COLUMNS``; ``url``: the request's endpoint, a
    ``text_completion`` for ``/v1/completions``, else a ``chat.completion``). ``created``: the output file's
    write time, one value per file (committed results keep no clock, so a reused row gets the rerun's)."""
    key = row.get("row_key") or ""
    if custom_id is None:
        custom_id = key.rpartition("#")[0]
    rid = hashlib.sha256(key.encode()).hexdigest()[:24]
    if row.get("error"):
        code = "invalid_request" if row.get("finish_reason") == "error" and not row.get("prompt_tokens") \
            else "batchgen_error"
        return {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": None,
                "error": {"code": code, "message": row["error"]}}
    prompt, completion = int(row.get("prompt_tokens") or 0), int(row.get("output_tokens") or 0)
    finish = row.get("finish_reason")
    finish = finish if finish in ("stop", "length") else "stop"
    text = row.get("summary") or ""
    if row.get("url") == COMPLETIONS:
        head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    else:
        head = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}]}
    body = {**head,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0)}}}
    return {"id": f"batch_req_{rid}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": key, "body": body}, "error": None}


def write_output(tables: Iterator[pa.Table], path: str | Path, id_column: str, model: str) -> int:
    """Write the output JSONL atomically (temp file, fsync, rename); returns the number of lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    created = int(time.time())
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for t in tables:
                for row in t.to_pylist():
                    fh.write(json.dumps(response_line(row.get(id_column), row, model, created), ensure_ascii=False))
                    fh.write("\n")
                    n += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def read_output(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


__all__ = ["READ_SCHEMA", "COLUMNS", "RequestError", "iter_request_batches", "count_requests", "parse_body",
           "response_line", "write_output", "read_output"]
