"""How close to the limit (issue 39): byte counts per format (weights and KV apart), the format -> peak / bytes
mapping, the int8 peak as the best of two kernels, and the bench's fractions and table line. Hand-made numbers,
no timing."""
from __future__ import annotations

import pytest

from costmodel import flops
from costmodel.roofline import INT8_KV_BYTES, INT8_WEIGHT_BYTES, Roofline, RunFormat
from tests.test_flops import tiny

WINDOWED = ("sliding_attention", "full_attention")
PER_TOKEN_LAYER = 2 * 1 * 4                               # K+V elements: 1 kv head, head_dim 4
WEIGHT_PARAMS = 2 * 576 + 800                             # tiny's two layers and its LM head


def test_decode_bytes_split_weights_and_kv():
    """Weights at their element size, K/V at the cache's; the old call (one size) is unchanged."""
    cfg = tiny(window=4, layers=WINDOWED)
    kv_elems = PER_TOKEN_LAYER * (4 + 10) + PER_TOKEN_LAYER * 2      # context 10: reads 4 + 10, writes 1 per layer
    assert flops.decode_step_bytes(cfg, [10], 2) == WEIGHT_PARAMS * 2 + kv_elems * 2
    assert flops.decode_step_bytes(cfg, [10], 2, None) == WEIGHT_PARAMS * 2 + kv_elems * 2
    assert flops.decode_step_bytes(cfg, [10], 1.25, 2) == WEIGHT_PARAMS * 1.25 + kv_elems * 2
    assert flops.decode_step_bytes(cfg, [10], 4, 1.125) == WEIGHT_PARAMS * 4 + kv_elems * 1.125
    assert flops.decode_step_kv_bytes(cfg, [10, 3], 2) == 2 * (PER_TOKEN_LAYER * (4 + 10 + 3 + 3)
                                                               + 2 * PER_TOKEN_LAYER * 2)
    assert flops.decode_step_bytes(cfg, [], 1.25, 2) == 0
    assert isinstance(flops.kv_read_bytes(cfg, 10, 2), int)                 # whole-byte sizes stay ints


def test_format_maps_to_its_peak_and_bytes():
    """int8 weights + bf16 KV: the int8 peak, 1.25 bytes per weight (int8 and its per-32 scales), 2 per KV element;
    a float format: its own dtype for all three; an int8 KV cache: 1.125 (int8 and a per-32 float32 scale)."""
    info = {"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "bfloat16"}}
    q8 = RunFormat.of(info)
    assert (q8.calibration_dtype, q8.weight_bytes_per_param, q8.kv_bytes) == ("int8", INT8_WEIGHT_BYTES, 2)
    assert q8.label == "int8/float32/kv-bfloat16" and INT8_WEIGHT_BYTES == 1.25
    bf = RunFormat.of({"quantization": "none", "dtype": "bfloat16", "config": {}})
    assert (bf.calibration_dtype, bf.weight_bytes_per_param, bf.kv_bytes, bf.label) == \
        ("bfloat16", 2, 2, "bfloat16/bfloat16/kv-bfloat16")
    f32 = RunFormat.of({"quantization": "none", "dtype": "float32", "config": {"kv_cache_dtype": "auto"}})
    assert (f32.calibration_dtype, f32.weight_bytes_per_param, f32.kv_bytes) == ("float32", 4, 4)
    q8kv = RunFormat.of({"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "int8"}})
    assert q8kv.kv_bytes == INT8_KV_BYTES == 1.125

    cfg = tiny(window=4, layers=WINDOWED)
    roof = Roofline.for_format(cfg, q8, cal=None)
    assert (roof.dtype_bytes, roof.kv_bytes) == (1.25, 2)
    assert roof.decode_bytes([10]) == WEIGHT_PARAMS * 1.25 + 2 * (PER_TOKEN_LAYER * (4 + 10) + PER_TOKEN_LAYER * 2)
    assert Roofline.of_format(cfg, 4, 1.125, None).decode_bytes([10]) == flops.decode_step_bytes(cfg, [10], 4, 1.125)
    assert Roofline(cfg, 2, None).kv_bytes == 2                           # the old constructor: KV as the weights
