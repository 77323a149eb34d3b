"""EngineConfig validation and attention backend selection: clear errors, never a traceback-only failure."""
import pytest

from engine import ConfigError, EngineConfig
from engine.attention import get_backend
from engine.attention.selector import flash_attn_available


@pytest.mark.parametrize("kwargs, needle", [
    ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
])
def test_impossible_settings_are_clear_errors(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**kwargs)


def test_torch_backend_everywhere():
    assert get_backend("torch", "cpu").name == "torch"
    assert get_backend("auto", "cpu").name == "torch"


def test_flash_attn_on_cpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        get_backend("flash_attn", "cpu")


@pytest.mark.skipif(flash_attn_available(), reason="flash-attn installed")
def test_flash_attn_missing_package_is_a_clear_error(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="flash-attn package"):
        get_backend("flash_attn", "cuda")


def test_unknown_engine_option_is_named(tmp_path):
    from engine import LLM
    with pytest.raises(ConfigError, match="max_num_seq\\b"):
        LLM(str(tmp_path), max_num_seq=4)


def test_kv_budget_beyond_machine_memory_is_a_clear_error(tmp_path):
    from engine import LLM
    from tests.model_utils import save_tiny, tiny_hf_model
    save_tiny(tiny_hf_model("llama"), tmp_path)
    with pytest.raises(ConfigError, match="exceeds the memory available"):
        LLM(str(tmp_path), kv_cache_memory=1 << 50)
