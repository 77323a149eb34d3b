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


def test_options_by_name_and_a_whole_config_build_the_same_engine(tmp_path):
    """LLM(model, **options) and LLM(config=EngineConfig(...)) are one door: the same resolved config."""
    from engine import LLM
    from tests.model_utils import save_tiny, tiny_hf_model
    save_tiny(tiny_hf_model("llama"), tmp_path)
    options = dict(dtype="float32", max_num_batched_tokens=512, speculative_config="off", kv_cache_memory=1 << 20)
    by_name = LLM(str(tmp_path), **options)
    whole = LLM(config=EngineConfig.from_options(str(tmp_path), **options))
    assert by_name.config == whole.config and whole.config.speculative_config is None
    with pytest.raises(ConfigError, match="no further options, got max_num_seqs"):
        LLM(config=EngineConfig(str(tmp_path)), max_num_seqs=4)
    with pytest.raises(ConfigError, match="unknown engine option.*\\bblocksize\\b"):
        EngineConfig.from_options(str(tmp_path), blocksize=16)


def test_a_config_is_hashable_and_equal_meanings_are_equal():
    """speculative_config and kernels take the user's forms and are kept frozen: equal meanings, equal configs (one
    hash), and ``to_dict`` (the manifest's form) is what ``from_options`` takes back."""
    from engine.config import Kernels, SpecConfig
    spec = {"num_speculative_tokens": 6, "gating": "always"}
    a = EngineConfig.from_options("m", speculative_config=spec, kernels={"attention": "torch", "elementwise": "c"})
    b = EngineConfig("m", speculative_config=SpecConfig(**spec), kernels=Kernels({"elementwise": "c",
                                                                                  "attention": "torch"}))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.kernels == {"elementwise": "c", "attention": "torch"} and a.kernels["attention"] == "torch"
    assert EngineConfig(speculative_config="auto") == EngineConfig() and EngineConfig(speculative_config="off") == \
        EngineConfig(speculative_config=None)
    assert EngineConfig().to_dict()["speculative_config"] == "auto" and EngineConfig(kernels={}).kernels is None
    assert EngineConfig.from_options(**a.to_dict()) == a
    assert a.to_dict()["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 6,
                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 5, "gating": "always"}
    with pytest.raises(ConfigError, match="kernels must be a mapping"):
        EngineConfig(kernels="c")
    with pytest.raises(ConfigError, match="num_speculative_tokens must be in 1..16"):
        EngineConfig(speculative_config={"num_speculative_tokens": 40})


def test_kv_budget_beyond_machine_memory_is_a_clear_error(tmp_path):
    from engine import LLM
    from tests.model_utils import save_tiny, tiny_hf_model
    save_tiny(tiny_hf_model("llama"), tmp_path)
    with pytest.raises(ConfigError, match="exceeds the memory available"):
        LLM(str(tmp_path), kv_cache_memory=1 << 50)


def test_config_is_resolved_once_and_shared(tmp_path):
    """LLM resolves every auto/None once; the scheduler, the info and the manifest see that one config."""
    from engine import LLM
    from engine.dtype_policy import choose_dtype
    from engine.interface import Engine, EngineInfo
    from tests.model_utils import save_tiny, tiny_hf_model
    save_tiny(tiny_hf_model("llama"), tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory=1 << 20)
    cfg = llm.config
    assert cfg.dtype == choose_dtype("auto", "cpu").dtype and cfg.device == "cpu"
    assert cfg.max_model_len == llm.model_config.max_position_embeddings and cfg.block_size == 16
    assert llm.scheduler.config is cfg
    info = llm.info
    assert isinstance(info, EngineInfo) and isinstance(llm, Engine)
    assert info.config is cfg and "auto" not in (cfg.dtype, cfg.device, cfg.quantization, cfg.kv_cache_dtype)
    flat = info.to_dict()                              # the manifest's model section: the config's values, flat too
    assert flat["config"] == cfg.to_dict() and (flat["dtype"], flat["block_size"]) == (cfg.dtype, 16)
    m = llm.model_config
    per_block = 2 * m.num_hidden_layers * 16 * m.num_key_value_heads * m.head_dim       # K and V, every layer
    assert info.num_kv_blocks == (1 << 20) // (per_block * (4 if cfg.dtype == "float32" else 2))


def test_fake_engine_satisfies_the_door(fake_llm_factory):
    from engine.interface import Engine
    assert isinstance(fake_llm_factory(EngineConfig("m")), Engine)


def test_cpu_kv_pool_stable_under_memavailable_drift(monkeypatch):
    """The default CPU pool is a quarter of MemAvailable rounded down to 256 MiB: a few MB of drift between
    validate, plan and submit gives the same pool; a machine with under 1 GiB free still gets its quarter."""
    import types

    import torch

    from engine import memory
    mcfg = types.SimpleNamespace(num_hidden_layers=18, num_key_value_heads=1, head_dim=256)
    cfg = EngineConfig(max_num_seqs=128)
    sizes = []
    for avail in (15_700 << 20, (15_700 << 20) + (4 << 20), (15_700 << 20) - (4 << 20)):
        monkeypatch.setattr(memory, "available_memory_bytes", lambda a=avail: a)
        sizes.append(memory.num_kv_blocks(cfg, mcfg, torch.bfloat16, torch.device("cpu"), 16, 32768))
    per_block = memory.kv_block_bytes(mcfg, 16, torch.bfloat16)
    budget = (15_700 << 20) // 4 // memory.BUDGET_STEP * memory.BUDGET_STEP
    assert sizes[0] == sizes[1] == sizes[2] == budget // per_block
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 600 << 20)
    assert memory.num_kv_blocks(cfg, mcfg, torch.bfloat16, torch.device("cpu"), 16, 32768) == (150 << 20) // per_block


def test_cuda_kv_pool_leaves_room_for_the_weights(monkeypatch):
    """On CUDA the pool is sized before the weights load: gpu_memory_utilization of the free memory less the
    weights' bytes in the activation dtype (an 8B bf16 model on a card with 20 GB free gets ~1 GB of KV, not 17)."""
    import json
    from pathlib import Path

    import torch

    from engine import memory
    from engine.models.config import ModelConfig
    raw = json.loads((Path(__file__).parents[1] / "bench/models/llama-3.1-8b-instruct/config.json").read_text())
    mcfg = ModelConfig.from_hf(raw, source="config.json")
    weights = memory._weight_bytes(mcfg, torch.bfloat16)
    assert 16.0e9 < weights < 16.1e9                     # 8.03B parameters, untied head
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 << 30, 141 << 30))
    cfg = EngineConfig(max_num_seqs=256)
    blocks = memory.num_kv_blocks(cfg, mcfg, torch.bfloat16, torch.device("cuda"), 16, 131072)
    per_block = memory.kv_block_bytes(mcfg, 16, torch.bfloat16)
    assert blocks == (int((20 << 30) * 0.85) - weights) // per_block
