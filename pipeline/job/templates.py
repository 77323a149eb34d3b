"""Prompt templates, parsed once when the job file is read: literal text and ``{name}`` fields.

``{{`` and ``}}`` write literal braces. A field is a name (a built-in placeholder or an input column) and nothing
else: a format spec (``{x:>9}``), a conversion (``{x!r}``) or an empty field (``{}``) is refused with its
position, so a template that validates always renders. Rendering fills the parsed pieces (``Template.fill``);
nothing calls ``str.format`` on a template, so no cell value or template text reaches a format spec.
"""
from __future__ import annotations

import string
from dataclasses import dataclass


class TemplateError(ValueError):
    """A template that cannot be used; the message names the field and its position (no key, no file)."""


@dataclass(frozen=True)
class Field:
    name: str
    raw: str            # as written, braces included: "{system:d}"
    at: int             # 1-based character position of its "{" in the template


@dataclass(frozen=True)
class Template:
    text: str
    pieces: tuple[tuple[str, Field | None], ...]     # (literal text, the field after it or None)

    @property
    def fields(self) -> list[str]:
        """The field names, in order, repeats included."""
        return [f.name for _, f in self.pieces if f is not None]

    def fill(self, values: dict) -> str:
        """The text with every field replaced by ``values[name]`` (a missing name is a KeyError: parse checks
        names against what the caller can fill, so this is a bug, not a user error)."""
        return "".join(lit + (values[f.name] if f is not None else "") for lit, f in self.pieces)


def _field_end(text: str, start: int, name: str, spec: str, conv: str | None) -> int:
    """The index after the ``}`` that closes the field opened at ``start``, from its parsed parts."""
    i = start + 1 + len(name) + (2 if conv is not None else 0)
    if i < len(text) and text[i] == ":":            # "{x:}": an empty spec, still written
        i += 1 + len(spec)
    return i + 1


def parse_template(text: str, allowed: set[str] | tuple[str, ...] | None = None) -> Template:
    """The template's pieces; ``TemplateError`` for a malformed template, a format spec, a conversion, an empty
    field, or (when ``allowed`` is given) a name outside ``allowed``."""
    pieces: list[tuple[str, Field | None]] = []
    pos = 0                                 # where the next piece starts in ``text``
    parsed = string.Formatter().parse(text)
    while True:
        try:
            literal, name, spec, conv = next(parsed)
        except StopIteration:
            break
        except ValueError as e:
            raise TemplateError(f"not a valid template ({e}); write literal braces as {{{{ and }}}}") from None
        pos += len(literal) + literal.count("{") + literal.count("}")    # each literal brace was written twice
        if name is None:
            pieces.append((literal, None))
            continue
        end = _field_end(text, pos, name, spec, conv)
        field = Field(name, text[pos:end], pos + 1)
        pos = end
        _check_field(field, spec, conv, allowed)
        pieces.append((literal, field))
    return Template(text, tuple(pieces))


def _check_field(field: Field, spec: str, conv: str | None, allowed) -> None:
    where = f"field {field.raw} at character {field.at}"
    if not field.name:
        raise TemplateError(f"{where}: an empty field names nothing; write {{name}} (a placeholder or an input "
                            "column), or {{ and }} for literal braces")
    if conv is not None:
        raise TemplateError(f"{where}: conversions (!{conv}) are not supported; write {{{field.name}}}")
    if spec or field.raw.endswith(":}"):
        raise TemplateError(f"{where}: format specs (:{spec}) are not supported; write {{{field.name}}}, or "
                            "{{ and }} for literal braces")
    if allowed is not None and field.name not in allowed:
        raise TemplateError(f"{where}: unknown name; this template takes {', '.join('{%s}' % a for a in allowed)}")


def template_fields(text: str) -> list[str]:
    """The field names of a template, or [] when it does not parse (the parse problem is reported elsewhere)."""
    try:
        return parse_template(text).fields
    except TemplateError:
        return []


__all__ = ["Field", "Template", "TemplateError", "parse_template", "template_fields"]
