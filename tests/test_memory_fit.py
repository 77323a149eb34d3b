"""A format whose weights do not fit the memory available is never loaded: ``auto`` weights become int8 where those
fit, an explicit format is refused before a byte is read, and the KV pool is sized from what the weights leave.

The models are the bench's shipped configs (Llama-3.1-8B: 8.03B parameters); ``setup_engine`` resolves the format
without weights, with the tuner off (the tables decide, as in planning or ``BATCHGEN_TUNE=off``) and the memory
available faked."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.memory as memory
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.kernels import library
from engine.setup import setup_engine

MODELS = Path(__file__).parents[1] / "bench" / "models"
needs_kernels = pytest.mark.skipif(library.load() is None, reason="no C kernels")


@pytest.fixture
def memory_of(monkeypatch):
    monkeypatch.setenv("BATCHGEN_TUNE", "off")

    def fake(gib: float):
        monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(gib * 2**30))
    return fake


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig.from_options(str(MODELS / model), load_format="dummy", device="cpu", **kw)


@needs_kernels
def test_auto_float_weights_that_do_not_fit_become_int8(memory_of):
    """8B as float32 weights (~35 GiB) on a 22 GiB machine: the table's float32 becomes int8 weights (~9.6 GiB),
    float32 activations, and the reason says why; the KV pool is a quarter of what the weights leave."""
    memory_of(22)
    s = setup_engine(config("llama-3.1-8b-instruct", dtype="float32"))
    assert (s.config.quantization, s.config.dtype) == ("int8", "float32")
    reason = s.format.quantization.reason
    assert "float32" in reason and "80%" in reason and "22.0 GiB" in reason and "int8 weights" in reason
    weights = memory.model_bytes("int8", "float32", s.model_config)
    assert 9.0e9 < weights < 10.0e9
    per_block = memory.kv_block_bytes(s.model_config, s.config.block_size, torch.bfloat16
                                      if s.config.kv_cache_dtype == "bfloat16" else torch.float32)
    budget = int((22 * 2**30 - weights) * 0.25) // memory.BUDGET_STEP * memory.BUDGET_STEP
    assert s.num_kv_blocks == budget // per_block


def test_an_explicit_format_that_does_not_fit_is_refused_with_the_sizes(memory_of):
    memory_of(22)
    with pytest.raises(ConfigError) as e:
        setup_engine(config("llama-3.1-8b-instruct", dtype="float32", quantization="none"))
    msg = str(e.value)
    assert "llama-3.1-8b-instruct" in msg and "none/float32" in msg and "22.0 GiB" in msg
    assert "quantization: int8" in msg


def test_when_not_even_int8_fits_the_error_says_so(memory_of):
    memory_of(8)
    for kw in ({"quantization": "int8"}, {"dtype": "float32"}):
        with pytest.raises(ConfigError, match="smaller model or a machine with more memory"):
            setup_engine(config("llama-3.1-8b-instruct", **kw))


def test_a_format_that_fits_is_left_as_the_tables_chose_it(memory_of):
    memory_of(22)
    explicit = setup_engine(config("qwen2.5-0.5b-instruct", dtype="float32", quantization="none"))
    assert (explicit.config.quantization, explicit.config.dtype) == ("none", "float32")
    assert "do not fit" not in explicit.format.quantization.reason
    auto = setup_engine(config("qwen2.5-0.5b-instruct", dtype="float32"))
    assert auto.config.quantization == "none"          # the table keeps a float checkpoint's weights float


def test_the_kv_pool_is_a_quarter_of_what_the_weights_leave():
    """The pool is sized before the weights load: its quarter is taken of the memory available less the weights,
    rounded down to BUDGET_STEP; with no weights given, the rule is the old one."""
    import types
    mcfg = types.SimpleNamespace(num_hidden_layers=32, num_key_value_heads=8, head_dim=128)
    cfg = EngineConfig(max_num_seqs=256)
    per_block = memory.kv_block_bytes(mcfg, 16, torch.bfloat16)
    avail = 12 << 30
    orig = memory.available_memory_bytes
    try:
        memory.available_memory_bytes = lambda: avail
        with_weights = memory.num_kv_blocks(cfg, mcfg, torch.bfloat16, torch.device("cpu"), 16, 131072, 9 << 30)
        without = memory.num_kv_blocks(cfg, mcfg, torch.bfloat16, torch.device("cpu"), 16, 131072)
    finally:
        memory.available_memory_bytes = orig
    assert with_weights == (768 << 20) // per_block             # (12 - 9) GiB / 4
    assert without == (3 << 30) // per_block                    # 12 GiB / 4
