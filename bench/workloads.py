"""The bench's workloads: named shapes (sizes, full and quick presets) and their prompts, deterministic token id
lists of varied English sentences. No torch here: the CLI lists ``BENCH_SHAPES`` from this module.

A prompt is ``[BOS] + prefix[group] + document[i]`` (see bench/__init__.py).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    shape: str
    n: int                    # documents (requests)
    groups: int               # distinct shared prefixes; document i belongs to group i % groups
    prefix_tokens: int        # BOS + system prompt + reference, per group (0: no shared prefix but BOS)
    doc_tokens: int           # document tokens per request
    output_tokens: int        # tokens generated per request (ignore_eos: exactly this many)

    def __post_init__(self) -> None:
        if self.n < 1 or self.groups < 1 or self.output_tokens < 1 or self.doc_tokens < 1:
            raise ValueError("n, groups, doc_tokens and output_tokens must be >= 1")
        if self.prefix_tokens < 0:
            raise ValueError("prefix_tokens must be >= 0")

    @property
    def prompt_tokens(self) -> int:
        """Tokens of each prompt (the prefix includes BOS; with no prefix, BOS alone leads)."""
        return max(self.prefix_tokens, 1) + self.doc_tokens


SHAPES = {
    # The target: N documents in G groups sharing a long system prompt + reference.
    "shared-prefix": dict(n=48, groups=4, prefix_tokens=1500, doc_tokens=400, output_tokens=64),
    # Long prompt, short output, nothing shared: prefill-bound.
    "long-prompt": dict(n=32, groups=32, prefix_tokens=0, doc_tokens=2000, output_tokens=16),
    # Short prompt, long output, nothing shared: decode-bound.
    "short-prompt": dict(n=32, groups=32, prefix_tokens=0, doc_tokens=64, output_tokens=256),
    # Few documents, long outputs that copy them ("rewrite the document"): memory-bound decode, where
    # speculation pays.
    "long-output": dict(n=4, groups=4, prefix_tokens=0, doc_tokens=300, output_tokens=256),
}
BENCH_SHAPES = tuple(SHAPES)     # the CLI's choices
QUICK = {
    "shared-prefix": dict(n=8, groups=2, prefix_tokens=96, doc_tokens=24, output_tokens=6),
    "long-prompt": dict(n=4, groups=4, prefix_tokens=0, doc_tokens=160, output_tokens=4),
    "short-prompt": dict(n=4, groups=4, prefix_tokens=0, doc_tokens=16, output_tokens=24),
    "long-output": dict(n=2, groups=2, prefix_tokens=0, doc_tokens=40, output_tokens=24),
}
# After the document, for shapes whose output should copy it.
INSTRUCTION = {"long-output": "\n\nRewrite the document above word for word, keeping every sentence:\n"}
# The structured systems (batchgen-structured, batchgen-default-structured): every request constrained to this JSON
# Schema. The summary's minLength keeps the JSON open for any output_tokens the shapes use (a 64-token output
# cannot close it), so with ignore_eos the constrained run emits exactly as many tokens as the unconstrained one;
# the enum, the bounded integer, the boolean and every key give the grammar forced tokens and masks to apply.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "shipping", "warranty", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "escalate": {"type": "boolean"},
        "summary": {"type": "string", "minLength": 4000},
    },
    "required": ["category", "priority", "escalate", "summary"],
    "additionalProperties": False,
}
DEFAULT_HF_BATCH_SIZES = (4, 8, 16)
QUICK_HF_BATCH_SIZES = (4,)


def make_workload(shape: str, quick: bool = False, **sizes) -> Workload:
    """The named shape's default sizes (``quick``: the smoke preset), overridden by non-None ``sizes``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; known: {', '.join(SHAPES)}")
    base = dict((QUICK if quick else SHAPES)[shape])
    base.update({k: v for k, v in sizes.items() if v is not None})
    return Workload(shape=shape, **base)


# ---- prompt text ---------------------------------------------------------------------------------------

_SUBJECTS = ("The customer", "Our support team", "The warehouse manager", "A regional director", "The billing system",
             "The technician", "Every new employee", "The auditor", "A loyal subscriber", "The delivery driver",
             "The product owner", "Their legal department", "The night shift", "A junior analyst")
_VERBS = ("reported", "reviewed", "questioned", "approved", "rejected", "summarized", "escalated", "documented",
          "measured", "explained", "disputed", "scheduled", "replaced", "forgot")
_OBJECTS = ("the late shipment", "an invoice from March", "the warranty claim", "a damaged screen",
            "the quarterly forecast", "the refund policy", "two missing parcels", "the renewal notice",
            "a broken charger", "the service agreement", "the password reset flow", "a duplicate payment",
            "the battery recall", "the store credit balance", "the cancellation request")
_TAILS = ("after a long call", "before the deadline", "without any receipt", "with three attachments",
          "in the weekly meeting", "for the second time", "despite the holiday", "according to clause 4.2",
          "on behalf of a colleague", "while the system was down", "at 9:45 on Tuesday", "by registered mail")


def _sentences(rng: random.Random, count: int) -> str:
    out = []
    for _ in range(count):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(_SUBJECTS).lower()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.2:
            s += f" (ref {rng.randint(1000, 99999)})"
        out.append(s + ".")
    return " ".join(out)


def text_tokens(tokenizer, num_tokens: int, seed: int, header: str = "") -> list[int]:
    """Exactly ``num_tokens`` token ids (no special tokens) of deterministic varied text after ``header``."""
    if num_tokens <= 0:
        return []
    rng = random.Random(seed)
    ids = tokenizer.encode(header, add_special_tokens=False) if header else []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + _sentences(rng, 16), add_special_tokens=False)
    return ids[:num_tokens]


class WordIds:
    """Token ids for a model with no tokenizer (``load_format: dummy`` on a bare config.json): each word of the
    text a fixed id from its hash, within the vocabulary and clear of the special ids at either end of it. The
    weights are made up, so what a token means does not matter; that the same text gives the same ids does."""
    FIRST = 1000                          # ids below are left alone (byte tokens, specials of some vocabularies)

    def __init__(self, vocab_size: int, bos_token_id: int | None):
        self.span = max(1, min(vocab_size - 1024, 120_000) - self.FIRST)   # the top of a vocabulary holds specials
        self.bos_token_id = bos_token_id
        self.pad_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.FIRST + int.from_bytes(hashlib.blake2s(w.encode(), digest_size=4).digest(), "little") % self.span
               for w in text.split()]
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids


def prompt_tokenizer(tokenizer):
    """``tokenizer``, or ``WordIds`` where the model has none (engine.tokenizer.TokenIdsOnly)."""
    if type(tokenizer).__name__ == "TokenIdsOnly":
        return WordIds(tokenizer.vocab_size, tokenizer.bos_token_id)
    return tokenizer


@dataclass(frozen=True)
class BenchPrompt:
    index: int                # position in arrival order (document i)
    group: int
    token_ids: tuple[int, ...]
    head_len: int = 0         # leading tokens the group shares (BOS + its prefix): the planner's head (plan_prediction)


def build_prompts(tokenizer, w: Workload, seed: int = 0) -> list[BenchPrompt]:
    """The workload's prompts in planned order (grouped by shared prefix, arrival order within a group)."""
    bos = tokenizer.bos_token_id
    lead = [bos] if bos is not None else []
    prefixes = []
    for g in range(w.groups):
        if w.prefix_tokens <= len(lead):
            prefixes.append(lead[:max(w.prefix_tokens, 1)] if lead else [])
            continue
        header = (f"You are reviewer number {g} of the operations group. Summarize the document below in two "
                  f"sentences, citing the reference where it applies.\nReference {g}:\n")
        prefixes.append(lead + text_tokens(tokenizer, w.prefix_tokens - len(lead), seed * 7919 + g, header))
    prompts = []
    tail = tokenizer.encode(INSTRUCTION[w.shape], add_special_tokens=False) if w.shape in INSTRUCTION else []
    for i in range(w.n):
        g = i % w.groups
        doc = text_tokens(tokenizer, w.doc_tokens, seed * 7919 + 100_003 + i, f"\nDocument {i}:\n")
        prompts.append(BenchPrompt(i, g, tuple(prefixes[g] + doc + tail), len(prefixes[g])))
    return sorted(prompts, key=lambda p: (p.group, p.index))


def warmup_prompts(tokenizer, n: int = 2, length: int = 48) -> list[list[int]]:
    return [text_tokens(tokenizer, length, 999_001 + i, "Warm-up. ") for i in range(n)]
