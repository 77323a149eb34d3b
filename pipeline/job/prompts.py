"""Row -> prompt: render the job's template around one document and tokenize it in three parts.

A prompt is ``head + document + tail``. The head (everything the template puts before ``{document}``:
system prompt, reference material, other columns) is the planner's grouping key; every document under the
same head shares its token ids exactly, because the three parts are tokenized separately:

    [ head ids (BOS + system + reference ...) | document ids | tail ids ("\\n\\nSummary:") ]

NOTE: tokenizing the parts separately can differ from tokenizing the joined string at the two seams; it is
what makes prefix sharing exact, and the template's newlines keep the seams on token boundaries in practice.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer as _RustTokenizer

from pipeline.io.openai_batch import COLUMNS, RequestError, parse_body
from pipeline.job.job_file import BUILTIN_PLACEHOLDERS, PromptSpec
from pipeline.job.token_count import counter_for

_SENTINEL = "\x00BATCHGEN_DOCUMENT\x00"


class RowError(Exception):
    """One row cannot be turned into a prompt; the message becomes that output row's ``error``."""


@dataclass(frozen=True)
class RenderedRow:
    head: str
    document: str
    tail: str
    params: tuple = ()          # per-row SamplingParams overrides, sorted (key, value) pairs (OpenAI batch bodies)

    @property
    def text(self) -> str:
        return self.head + self.document + self.tail


def template_columns(spec: PromptSpec) -> list[str]:
    """Input columns the template names besides the built-in placeholders."""
    return [f for f in dict.fromkeys(spec.placeholders) if f not in BUILTIN_PLACEHOLDERS]


def needed_columns(spec: PromptSpec) -> list[str]:
    if spec.kind == "openai_batch":
        return list(COLUMNS)
    cols = [spec.document_column]
    cols += [c for c in (spec.system_column, spec.reference_column) if c]
    cols += template_columns(spec)
    return list(dict.fromkeys(cols))


def _cell_text(value, column: str, *, required: bool) -> str:
    if value is None:
        if required:
            raise RowError(f"column {column!r} is null")
        return ""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError(f"column {column!r} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(value, str):
        if required:
            raise RowError(f"column {column!r} must be text, got {type(value).__name__}")
        return str(value)
    if required and not value.strip():
        raise RowError(f"column {column!r} is empty")
    return value


class PromptRenderer:
    """Renders rows of one job into ``RenderedRow``s and token ids, with the job's tokenizer."""

    def __init__(self, spec: PromptSpec, tokenizer=None):
        self.spec = spec
        self.tokenizer = tokenizer
        self._pieces = spec.parsed.pieces          # parsed once; load_job refused a template that does not parse
        self._encode_cached = lru_cache(maxsize=4096)(self._encode_part)

    # ---- text -------------------------------------------------------------------------------------------
    def render(self, row: dict) -> RenderedRow:
        """Render one row (a dict of column -> value). Raises ``RowError`` for a bad cell."""
        spec = self.spec
        if spec.kind == "openai_batch":
            return self._render_request(row)
        document = _cell_text(row.get(spec.document_column), spec.document_column, required=True)
        system = (_cell_text(row.get(spec.system_column), spec.system_column, required=True)
                  if spec.system_column else spec.system or "")
        reference = (_cell_text(row.get(spec.reference_column), spec.reference_column, required=True)
                     if spec.reference_column else spec.reference or "")
        values = {"system": system, "reference": reference}
        for col in template_columns(spec):
            values[col] = _cell_text(row.get(col), col, required=False)
        if spec.chat_template:
            return self._render_chat(values, document)
        head, tail, seen_doc = [], [], False
        for literal, field in self._pieces:
            (tail if seen_doc else head).append(literal)
            if field is None:
                continue
            if field.name == "document" and not seen_doc:
                seen_doc = True
                continue
            (tail if seen_doc else head).append(document if field.name == "document" else values[field.name])
        return RenderedRow("".join(head), document, "".join(tail))

    def _chat_split(self, messages: list[dict], what: str) -> tuple[str, str]:
        """The chat template applied to ``messages`` (the document given as ``_SENTINEL``), split around it;
        ``what`` names the messages' source in the errors."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RowError(f"{what} needs a chat template, and the model's tokenizer has none")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:           # NOTE: templates raise on role orders they do not support
            raise RowError(f"{what}: the model's chat template refuses these messages ({e})") from None
        head, _, tail = text.partition(_SENTINEL)
        return head, tail

    def _render_chat(self, values: dict, document: str) -> RenderedRow:
        user = self.spec.parsed.fill({**values, "document": _SENTINEL})
        messages = ([{"role": "system", "content": values["system"]}] if values["system"] else [])
        messages.append({"role": "user", "content": user})
        head, tail = self._chat_split(messages, "prompt.chat_template: true")
        return RenderedRow(head, document, tail.replace(_SENTINEL, document))

    def _render_request(self, row: dict) -> RenderedRow:
        """An OpenAI Batch request: its messages through the chat template, split at the last user message (a
        ``/v1/completions`` request: its prompt, all of it the document)."""
        try:
            messages, overrides = parse_body(row.get("body"), row.get("problem"), row.get("url"))
        except RequestError as e:
            raise RowError(str(e)) from None
        if isinstance(messages, str):           # /v1/completions: the prompt as it is, no template
            return RenderedRow("", messages, "", tuple(sorted(overrides.items())))
        document = messages[-1]["content"]
        messages[-1] = {"role": "user", "content": _SENTINEL}
        head, tail = self._chat_split(messages, "body.messages")
        return RenderedRow(head, document, tail, tuple(sorted(overrides.items())))

    # ---- tokens -----------------------------------------------------------------------------------------
    def _encode_part(self, text: str, is_head: bool) -> tuple[int, ...]:
        tok = self.tokenizer
        add_special = is_head and not (tok.bos_token and text.startswith(tok.bos_token))
        return tuple(tok.encode(text, add_special_tokens=add_special))

    def head_ids(self, head: str) -> tuple[int, ...]:
        return self._encode_cached(head, True)

    def tail_ids(self, tail: str) -> tuple[int, ...]:
        return self._encode_cached(tail, False)

    def _encodings(self, documents: list[str]):
        """The Rust tokenizer's encodings of many documents, or None when the tokenizer is not a Rust one."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, _RustTokenizer):
            return None
        # NOTE: straight to the Rust tokenizer (what transformers' fast tokenizer calls underneath): the same
        # ids without transformers' per-encoding Python conversion (a large share of a large plan's time).
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we never read. Numbers:
        # docs/perf/code-notes-pipe.md.
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return encode(documents, add_special_tokens=False)

    def document_ids(self, documents: list[str]) -> list[list[int]]:
        """Tokenize many documents at once (fast tokenizers batch them in native code)."""
        if not documents:
            return []
        encodings = self._encodings(documents)
        if encodings is not None:
            return [e.ids for e in encodings]
        return list(self.tokenizer(documents, add_special_tokens=False)["input_ids"])

    def document_lengths(self, documents: list[str]) -> list[int]:
        """Token counts of many documents (dry runs): exact, from cached pieces where the tokenizer allows
        (``pipeline.job.token_count``), else the Rust encodings' lengths, never turned into lists."""
        if not documents:
            return []
        counter = counter_for(self.tokenizer)
        if counter is not None:
            return counter.lengths(documents)
        encodings = self._encodings(documents)
        if encodings is not None:
            return [len(e) for e in encodings]
        return [len(ids) for ids in self.document_ids(documents)]

    def fit(self, head: tuple[int, ...], doc: list[int], tail: tuple[int, ...], max_model_len: int,
            max_tokens: int) -> list[int]:
        """Apply the job's ``on_too_long`` policy: the prompt plus ``max_tokens`` must fit the context.

        Returns the (possibly truncated) document ids; raises ``RowError`` when it cannot fit.
        """
        total = len(head) + len(doc) + len(tail)
        if total + max_tokens <= max_model_len:
            return doc
        room = max_model_len - max_tokens - len(head) - len(tail)
        if self.spec.on_too_long == "truncate_document" and room > 0:
            return doc[:room]
        if room <= 0:
            raise RowError(f"the template, system prompt and reference alone are {len(head) + len(tail)} "
                           f"tokens; with max_tokens {max_tokens} they exceed the model's context of "
                           f"{max_model_len} tokens")
        raise RowError(f"prompt is {total} tokens; with max_tokens {max_tokens} it exceeds the model's "
                       f"context of {max_model_len} tokens (set prompt.on_too_long: truncate_document to "
                       f"cut the document to {room} tokens)")


def row_key(row_id: str, content: str, fingerprint: str) -> str:
    """Idempotency key: the row id plus a hash of what determines the row's result.

    ``content`` is the rendered prompt (or the bad cell for a row error); ``fingerprint`` covers the model
    identity, generation parameters and prompt policy (see ``runner.job_fingerprint``).
    """
    return _keyed(row_id, _key_state(fingerprint, ""), content)


def _key_state(fingerprint: str, head: str):
    """The hash state of a row key after the fingerprint and the first part of the content."""
    h = hashlib.sha256()
    h.update(fingerprint.encode())
    h.update(b"\0")
    h.update(head.encode("utf-8", "surrogatepass"))
    return h


def _keyed(row_id: str, state, rest: str) -> str:
    """The row key from a hash state (consumed) and the rest of the content."""
    state.update(rest.encode("utf-8", "surrogatepass"))
    return f"{row_id}#{state.hexdigest()[:20]}"


class RowKeyer:
    """``row_key`` for many rows that share prompt heads: the hash state after fingerprint + head is computed
    once per distinct head and copied, so each row hashes only its document and tail (the same keys)."""

    def __init__(self, fingerprint: str):
        self._fingerprint = fingerprint
        self._heads: dict[str, "hashlib._Hash"] = {}

    def key(self, row_id: str, head: str, rest: str) -> str:
        base = self._heads.get(head)
        if base is None:
            if len(self._heads) >= 4096:         # heads unique per row: stay bounded
                self._heads.clear()
            base = self._heads[head] = _key_state(self._fingerprint, head)
        return _keyed(row_id, base.copy(), rest)


def fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
