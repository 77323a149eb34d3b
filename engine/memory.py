"""What a model takes in memory and how big the KV pool is: the memory probe and the sizing rules, in one place.

Weights: about ``MODEL_BYTES_PER_PARAM`` of a format a parameter (``model_bytes``); on a CPU a format whose model
would take more than ``WEIGHTS_SHARE`` of the memory available does not run (``engine.tuning.format_decision``
chooses a smaller one for ``auto``, refuses an explicit one). KV pool, CPU: a quarter of the memory available at start
(``/proc/meminfo`` MemAvailable) less the weights (the pool is sized before they load), rounded down to a
multiple of ``BUDGET_STEP`` (so MemAvailable's moment-to-moment drift does not change the pool between validate,
plan and submit), at most 4 GiB, unless
``kv_cache_memory`` names bytes (refused when above 90 % of what is available). CUDA: ``gpu_memory_utilization``
of the free device memory, less the weights (the pool is sized before they load). Never more blocks than
``max_num_seqs`` full-length sequences need.
"""
from __future__ import annotations

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_MAX_BYTES, DEFAULT_CPU_KV_FRACTION, EngineConfig
from engine.errors import ConfigError

BUDGET_STEP = 256 << 20
# resident bytes a parameter of a format's model takes: the weights as held (a packed head on top), int8's fp16
# scale and int16 sum per group of 32
MODEL_BYTES_PER_PARAM = {"int8": 1.2, "bfloat16": 2.2, "float16": 2.2, "float32": 4.4}
# a model whose weights take more than this share of the memory available leaves too little for its KV pool, its
# activations and the process (Llama-3.1-8B in float32: 35 GB; on a 24 GB machine the load would be killed)
WEIGHTS_SHARE = 0.8


def available_memory_bytes() -> int | None:
    """MemAvailable of this machine, or None where /proc/meminfo is not readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_block_bytes(model_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    m = model_config
    if dtype == torch.int8:                       # int8 quants + a float32 scale per 32 (engine.quant.int8_kv)
        from engine.quant.int8_kv import block_bytes
        return 2 * m.num_hidden_layers * block_bytes(block_size, m.num_key_value_heads, m.head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * m.num_hidden_layers * block_size * m.num_key_value_heads * m.head_dim * elem


def model_bytes(quantization: str, dtype: str, model_config) -> int:
    """About what a model of ``model_config`` holds in memory with ``quantization`` (none | int8) and activation
    ``dtype`` (a CPU's weights: int8 ones whatever the activations; float ones in the activation dtype)."""
    from engine.loader.dummy import param_count
    key = "int8" if quantization == "int8" else dtype
    return int(MODEL_BYTES_PER_PARAM[key] * param_count(model_config))


def _weight_bytes(model_config, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in ``dtype`` (on CUDA the weights are held in the activation dtype)."""
    from engine.loader.dummy import param_count
    return torch.empty((), dtype=dtype).element_size() * param_count(model_config)


def num_kv_blocks(cfg: EngineConfig, model_config, dtype: torch.dtype, device: torch.device, block_size: int,
                  max_model_len: int, weight_bytes: int = 0) -> int:
    """The KV pool size in blocks for these (resolved) settings; ConfigError when it cannot hold one block.
    ``weight_bytes``: what the model's weights will take (``model_bytes``; CPU), off the memory available."""
    if cfg.num_gpu_blocks_override:
        return cfg.num_gpu_blocks_override
    per_block = kv_block_bytes(model_config, block_size, dtype)
    if cfg.kv_cache_memory:
        budget = cfg.kv_cache_memory
        if device.type == "cpu":
            avail = available_memory_bytes()
            if avail is not None and budget > avail * 0.9:
                raise ConfigError(f"kv_cache_memory of {budget / 2**30:.1f} GiB exceeds the memory available "
                                  f"on this machine ({avail / 2**30:.1f} GiB); lower kv_cache_memory")
    elif device.type == "cuda":
        # NOTE: the pool is sized before the weights load, so their bytes come off the share of free memory
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.gpu_memory_utilization) - _weight_bytes(model_config, dtype)
    else:
        avail = available_memory_bytes() or 4 * DEFAULT_CPU_KV_CACHE_MAX_BYTES + weight_bytes
        share = int(max(avail - weight_bytes, 0) * DEFAULT_CPU_KV_FRACTION)
        budget = min(DEFAULT_CPU_KV_CACHE_MAX_BYTES, max(share // BUDGET_STEP * BUDGET_STEP, min(share, BUDGET_STEP)))
    cap = cfg.max_num_seqs * -(-max_model_len // block_size) + 1   # no point in more than max_num_seqs full seqs
    blocks = min(budget // per_block, cap)
    if blocks < 1:
        raise ConfigError("the KV cache budget is smaller than one block; raise kv_cache_memory")
    return blocks


__all__ = ["MODEL_BYTES_PER_PARAM", "WEIGHTS_SHARE", "available_memory_bytes", "model_bytes", "kv_block_bytes",
           "num_kv_blocks"]
