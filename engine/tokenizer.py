"""Tokenizers for a ``ModelSource``: a transformers fast tokenizer (encode/decode, special tokens,
``apply_chat_template`` when the model has a template).

* HF checkpoint directory: ``AutoTokenizer.from_pretrained(dir)``, local files only.
* GGUF file: the vocabulary in the GGUF metadata, converted once with transformers' GGUF tokenizer
  conversion (slow for a 262k vocabulary: ~15 s) and cached as a ``tokenizer.json`` under
  ``~/.cache/batchgen/tokenizers/<model identity>/`` (``$BATCHGEN_CACHE_DIR`` overrides ``~/.cache/batchgen``).
  Later loads read only that directory (``tokenizer.json`` straight into the Rust tokenizer).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.cache_root import tokenizers_dir
from engine.errors import ModelLoadError
from engine.loader.resolve import ModelSource, model_identity

# Bump when the conversion changes, so stale caches are rebuilt rather than trusted.
_CACHE_VERSION = "1"
_MARKER = "batchgen_tokenizer.txt"


# Gemma's turn format, for Gemma GGUF files that ship no template (the default model's does not).
# The system message is folded into the first user turn, as Gemma's own template does.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (first if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def load_tokenizer(source: ModelSource, identity: str | None = None):
    """The tokenizer of ``source`` (a ``PreTrainedTokenizerFast``-compatible object). ``identity``: the source's
    ``model_identity`` when the caller has it already (it keys the GGUF tokenizer cache)."""
    if source.kind in ("hf", "dummy") and not any((Path(source.path) / f).is_file() for f in TOKENIZER_FILES):
        return TokenIdsOnly.for_dir(Path(source.path))
    if source.kind in ("hf", "dummy"):
        tok = _load_hf_dir(Path(source.path))
    elif source.kind == "gguf":
        tok = load_gguf_tokenizer(Path(source.path), identity or model_identity(source))
    else:
        raise ModelLoadError(f"{source.path}: unknown model source kind {source.kind!r}")
    if not getattr(tok, "chat_template", None) and "<start_of_turn>" in tok.get_vocab():
        tok.chat_template = GEMMA_CHAT_TEMPLATE
    return tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class TokenIdsOnly:
    """The tokenizer of a checkpoint directory that has none (only ``config.json``: a ``load_format: dummy``
    model, as vLLM's ``skip_tokenizer_init``): prompts must be token ids, and outputs have token ids but no text."""
    chat_template = None
    unk_token_id = None

    def __init__(self, path: Path, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None):
        self.path, self.vocab_size = path, vocab_size
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    @classmethod
    def for_dir(cls, path: Path) -> "TokenIdsOnly":
        from engine.models.config import ModelConfig

        cfg = ModelConfig.from_hf_dir(path)
        return cls(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids[0] if cfg.eos_token_ids else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ModelLoadError(f"{self.path}: the model has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                             "give prompts as token ids, or add the tokenizer's files to the directory")

    def __call__(self, texts, add_special_tokens: bool = True, **_) -> dict:
        """Text in batches (a job's documents, ``batchgen plan`` included) refused as ``encode`` refuses it: the
        same message, not a TypeError from deep in the pipeline."""
        return self.encode("", add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return ""

    def convert_tokens_to_ids(self, token: str):
        return None

    def get_vocab(self) -> dict:
        return {}

    def __len__(self) -> int:
        return self.vocab_size


def _load_hf_dir(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer (expected tokenizer.json or "
                             f"tokenizer.model with tokenizer_config.json): {e}") from None


def load_gguf_tokenizer(path: Path, identity: str | None = None, use_cache: bool = True):
    """Tokenizer of a GGUF file, from the cache when present (and valid), else converted and cached."""
    if identity is None:
        identity = model_identity(ModelSource(kind="gguf", path=path, name=path.stem))
    cache_dir = tokenizers_dir() / identity
    if use_cache and _cache_valid(cache_dir):
        try:
            return _load_cached(cache_dir)
        except Exception:                        # NOTE: a damaged cache is rebuilt, never fatal
            shutil.rmtree(cache_dir, ignore_errors=True)
    tok = convert_gguf_tokenizer(path)
    if use_cache:
        _save_cache(tok, cache_dir)
    return tok


def convert_gguf_tokenizer(path: Path):
    """Build the tokenizer from GGUF metadata with transformers' converter (slow; no cache)."""
    from transformers import AutoTokenizer
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
    if not getattr(tok, "chat_template", None):
        from engine.loader.gguf_loader import open_gguf
        template = open_gguf(path).get("tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok


def _cache_valid(cache_dir: Path) -> bool:
    marker = cache_dir / _MARKER
    return ((cache_dir / "tokenizer.json").is_file() and marker.is_file()
            and marker.read_text().strip() == _CACHE_VERSION)


_CONFIG_SKIP = {"tokenizer_class", "auto_map", "backend", "is_local", "local_files_only", "name_or_path"}


def _load_cached(cache_dir: Path):
    # NOTE: built straight from tokenizer.json. from_pretrained would also json-parse the 33 MB file in
    # Python (~1 s), and the model-specific class (GemmaTokenizer) would rebuild the BPE from vocab + merges.
    import json

    from transformers import PreTrainedTokenizerFast
    config = json.loads((cache_dir / "tokenizer_config.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in _CONFIG_SKIP}
    template = cache_dir / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(cache_dir / "tokenizer.json"), **kwargs)


def _compact_merges(tokenizer_json: Path) -> None:
    """Rewrite BPE merges as "a b" strings (tokenizers' other accepted spelling): ~25 % faster to load
    for a 500k-merge vocabulary. Skipped when any merge part contains a space (ambiguous then)."""
    import json
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    merges = (data.get("model") or {}).get("merges")
    if not merges or not isinstance(merges[0], list) or any(" " in a or " " in b for a, b in merges):
        return
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _save_cache(tok, cache_dir: Path) -> None:
    """Write atomically: a temp dir renamed into place, so concurrent loaders never see half a cache."""
    tmp: Path | None = None
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=cache_dir.name + ".", dir=cache_dir.parent))
        tok.save_pretrained(str(tmp))
        _compact_merges(tmp / "tokenizer.json")
        tmp.chmod(0o755)
        (tmp / _MARKER).write_text(_CACHE_VERSION + "\n")
        if cache_dir.exists() and not _cache_valid(cache_dir):
            shutil.rmtree(cache_dir, ignore_errors=True)     # stale version or damaged
        try:
            os.replace(tmp, cache_dir)
            tmp = None
        except OSError:
            pass                                             # another process won the race: keep theirs
    except OSError:
        pass                                                 # NOTE: an unwritable cache only costs speed
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["TokenIdsOnly", "load_tokenizer", "load_gguf_tokenizer", "convert_gguf_tokenizer"]
