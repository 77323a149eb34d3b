"""Shared fixtures. Coordinate by only adding.

* ``tiny_tokenizer`` / ``tiny_llama_dir``: a small byte-level BPE tokenizer and a tiny random Llama saved
  as an HF checkpoint directory (config.json + model.safetensors + tokenizer), no download.
* ``fake_llm_factory``: an engine stand-in with the typed door (engine.interface.Engine) and a
  block-level prefix cache, for fast pipeline tests.
* ``make_docs_dataset``: a small documents dataset (Parquet) under a few reference texts.
"""
from __future__ import annotations

import hashlib
import os
import random
import time
import types

import pytest
from hypothesis import settings

# The fuzz tests (hypothesis) draw the same examples every run, so CI cannot fail on a case no earlier run saw;
# `HYPOTHESIS_PROFILE=explore` draws new ones (run it to look for more, then pin what it finds as a named test).
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# engine.tuning: tests never pay the tuner's probe (the tables decide, as with BATCHGEN_TUNE=off anywhere), so
# tiny models and the default model alike resolve as before; tests/test_tuning.py turns it on per test with a
# throwaway cache dir and injected timings.
os.environ["BATCHGEN_TUNE"] = "off"

_WORDS = ("the customer asked about a refund for an order that arrived late and the agent explained the "
          "policy on returns shipping damaged items warranty invoices billing account password reset "
          "delivery tracking number store credit replacement product manual battery charger screen "
          "subscription renewal cancel plan upgrade support ticket priority response hours weekend").split()


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(30)) for _ in range(200)]
    return lines + ["Reference:\nDocument:\nSummary: You are a helpful assistant. 0123456789 .,;:!?-'\"()"] * 5


@pytest.fixture(autouse=True)
def _history_state_dir(tmp_path_factory, monkeypatch):
    """Run history (pipeline.run.history) of every test goes to a throwaway state dir, never ~/.local/state."""
    monkeypatch.setenv("BATCHGEN_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A small byte-level BPE tokenizer (vocab 512) with <s> as BOS (added by add_special_tokens)."""
    return _build_tiny_tokenizer()


class LiteTokenizer:
    """The tokenizer surface the pipeline uses, over a bare ``tokenizers.Tokenizer`` (no transformers
    import: subprocess tests start fast)."""

    bos_token, eos_token, chat_template = "<s>", "</s>", None

    def __init__(self, tok):
        self._tok = tok

    def encode(self, text, add_special_tokens=True):
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]}

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _build_tiny_tokenizer(lite=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    if not lite:
        from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if lite:
        return LiteTokenizer(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama (2 layers, hidden 64) + tokenizer saved as an HF checkpoint dir; returns its path."""
    import torch
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny_llama_ckpt")
    cfg = tf.LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer.save_pretrained(path)
    return str(path)


class FakeLLM:
    """The LLM door over a pretend model: prefix cache by block chains, no real compute.

    Each step runs up to ``max_num_seqs`` waiting requests (by priority) to completion. As in the real
    engine, a request's full blocks are registered when it is admitted, so a request admitted after it in the
    same step (lower priority) already hits them.
    """

    def __init__(self, tokenizer, block_size=16, max_num_seqs=8, max_model_len=4096, structured=None,
                 enable_prefix_caching=True, **_):
        self.tokenizer = tokenizer
        self.enable_prefix_caching = enable_prefix_caching
        # A request with ``structured_outputs``: ``structured(params, ids) -> text | (text, finish_reason)``
        # answers it (default ``example_output``: a valid instance of a JSON schema, the first choice, ...).
        self.structured = structured or example_output
        self.block_size = block_size
        self.config = types.SimpleNamespace(max_num_seqs=max_num_seqs, block_size=block_size)
        self.max_model_len = max_model_len
        self.cache: set[str] = set()
        self.waiting: list = []
        self.pins: dict[int, list[int]] = {}
        self.pin_calls = 0
        self.steps = 0
        self.added: list[str] = []
        self.model_config = None

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def info(self):
        from engine import EngineConfig
        from engine.interface import EngineInfo
        config = EngineConfig("fake", dtype="float32", device="cpu", max_model_len=self.max_model_len,
                              block_size=self.block_size, max_num_seqs=self.config.max_num_seqs, quantization="none",
                              kv_cache_dtype="float32", enable_prefix_caching=self.enable_prefix_caching)
        return EngineInfo(name="fake", identity="fake-identity", architecture="Fake", config=config, load_time_s=0.01)

    def _chain(self, ids):
        h, out = "", []
        for b in range(len(ids) // self.block_size):
            h = hashlib.sha256((h + repr(ids[b * self.block_size:(b + 1) * self.block_size])).encode()).hexdigest()
            out.append(h)
        return out

    def add_request(self, request_id, prompt, params, priority=0):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.waiting.append((priority, len(self.added), request_id, ids, params))
        self.added.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def num_unfinished_requests(self):
        return len(self.waiting)

    def pin_prefix(self, token_ids):
        self.pin_calls += 1
        self.pins[self.pin_calls] = list(token_ids)
        return self.pin_calls

    def unpin_prefix(self, pin_id):
        self.pins.pop(pin_id, None)

    def step(self):
        from engine.outputs import RequestMetrics, RequestOutput, StepStats
        start = time.monotonic()
        self.steps += 1
        self.waiting.sort(key=lambda r: (r[0], r[1]))
        batch, self.waiting = self.waiting[:self.config.max_num_seqs], self.waiting[self.config.max_num_seqs:]
        outs = []
        queries = hits = 0
        for _, _, rid, ids, params in batch:
            chain = self._chain(ids)
            hit = 0
            while hit < min(len(chain), (len(ids) - 1) // self.block_size) and chain[hit] in self.cache:
                hit += 1
            if self.enable_prefix_caching:
                self.cache.update(chain)
            queries, hits = queries + len(ids), hits + hit * self.block_size
            m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, prefill_start_time=0.1,
                               prefill_end_time=0.2, first_token_time=0.2, token_times=[0.2, 0.3], finish_time=0.3)
            if len(ids) > self.max_model_len:
                outs.append(RequestOutput(rid, None, ids, "", [], "error", 0, m,
                                          error=f"prompt of {len(ids)} tokens exceeds max_model_len"))
                continue
            n_out = min(params.max_tokens, 3)
            text, finish = f"summary-{sum(ids) % 9973}-{len(ids)}", "length"
            if params.structured_outputs is not None:
                reply = self.structured(params, ids)
                text, finish = reply if isinstance(reply, tuple) else (reply, "stop")
                m.num_forced_tokens, m.num_masks_applied, m.mask_time_s = 2, 1, 0.001
            outs.append(RequestOutput(rid, None, ids, text, list(range(3, 3 + n_out)), finish,
                                      hit * self.block_size, m))
        # as if every request's prompt and its decodes ran in this one step (consistent for pipeline.trace)
        emitted = sum(len(o.token_ids) for o in outs)
        decoded = sum(max(len(o.token_ids) - 1, 0) for o in outs)
        stats = StepStats(step=self.steps - 1, start_time=start, end_time=time.monotonic(),
                          num_prefill_tokens=queries - hits, num_decode_tokens=decoded, num_prefill_seqs=len(batch),
                          num_decode_seqs=0, num_running=0, num_waiting=len(self.waiting), kv_blocks_used=0,
                          kv_blocks_total=0, prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=0,
                          num_sampled=len(outs), num_emitted_tokens=emitted)
        return outs, stats


def example_output(params, ids=()) -> str:
    """What a constrained fake request answers: a valid instance of its JSON schema (required and optional
    properties, enums' first value, minimums, minItems), the first choice, or a fixed text for a regex/grammar."""
    import json
    so = params.structured_outputs
    if so.kind == "choice":
        return so.choice[0]
    if so.kind == "json_object":
        return '{"answer":"yes"}'
    if so.kind != "json":
        return "fake-structured"

    def instance(s, root):
        while "$ref" in s:
            node = root
            for part in s["$ref"][2:].split("/"):
                node = node[part]
            s = node
        if "enum" in s or "const" in s:
            return s.get("enum", [s.get("const")])[0]
        t = s.get("type", "object" if "properties" in s else "string")
        t = [x for x in t if x != "null"][0] if isinstance(t, list) else t
        if t == "object":
            return {k: instance(v, root) for k, v in (s.get("properties") or {}).items()}
        if t == "array":
            return [instance(s.get("items") or {}, root) for _ in range(max(s.get("minItems", 1), 1))]
        if t in ("integer", "number"):
            return s.get("minimum", 1)
        if t == "boolean":
            return True
        return "x" * max(s.get("minLength", 1), 1)
    return json.dumps(instance(so.schema, so.schema), separators=(",", ":"))


def changed_options(config) -> dict:
    """The engine options a config sets apart from ``EngineConfig``'s defaults (what the jobs wrote, in effect):
    the fake engine takes those and keeps its own small defaults for the rest."""
    import dataclasses

    from engine import EngineConfig
    default = EngineConfig(model=config.model)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name != "model" and getattr(config, f.name) != getattr(default, f.name)}


@pytest.fixture
def fake_llm_factory(tiny_tokenizer):
    """A factory ``(EngineConfig) -> FakeLLM`` (the runner's); the instances it made are in ``factory.made``."""
    made = []

    def factory(config):
        llm = FakeLLM(tiny_tokenizer, structured=factory.structured, **changed_options(config))
        made.append(llm)
        return llm
    factory.made = made
    factory.structured = None        # a test's ``structured(params, ids)`` for constrained requests (FakeLLM)
    return factory


REFERENCES = {
    "returns": "Returns policy. Items may be returned within 30 days of delivery for a full refund. "
               "Damaged items are replaced at no cost. Refunds go back to the original payment method "
               "within five business days. Store credit is offered when the receipt is missing.",
    "billing": "Billing guide. Invoices are issued on the first day of each month. A subscription renews "
               "automatically unless cancelled before the renewal date. Upgrades are charged pro rata. "
               "Failed payments are retried three times before the account is paused.",
    "devices": "Device handbook. The charger must be the one shipped in the box. A battery that does not "
               "hold charge after one year is covered by the warranty. Screen damage from drops is not "
               "covered. Reset the device by holding the power button for ten seconds.",
}


def make_docs(n=24, seed=0, shuffle=False):
    """Rows: id, category, reference (one of REFERENCES), document (20-60 words)."""
    rng = random.Random(seed)
    cats = list(REFERENCES)
    rows = []
    for i in range(n):
        cat = cats[i % len(cats)] if i % 5 else cats[0]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 60)))
        rows.append({"id": f"doc-{i:04d}", "category": cat, "reference": REFERENCES[cat],
                     "document": f"{words.capitalize()}. (ticket {i})"})
    if shuffle:
        random.Random(seed + 1).shuffle(rows)
    return rows


@pytest.fixture
def make_docs_dataset(tmp_path):
    """``make(name, n=24, shuffle=False, rows=None) -> path`` of a Parquet file of documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def make(name="docs.parquet", n=24, shuffle=False, rows=None, seed=0):
        path = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows if rows is not None else make_docs(n, seed, shuffle)), path)
        return path
    return make
