"""Our torch dequantization vs gguf.quants.dequantize (llama.cpp's reference): bit-exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

import engine.loader.dequant as dq
from engine.errors import ModelLoadError
from engine.loader.dequant import BLOCK_SIZES, dequantize

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# K-quants: gguf-py has no quantizer; random bytes with valid fp16 scales at these byte offsets.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype == np.float32
            and np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def test_block_sizes_match_gguf():
    for t, sizes in BLOCK_SIZES.items():
        assert GGML_QUANT_SIZES[Q(t)] == sizes, Q(t).name


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_random_equals_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((24, 512)) * rng.uniform(0.01, 3, size=(24, 1))).astype(np.float32)
    x[3, :64] = 0.0                                         # an all-zero block: scale 0
    raw = ref_quantize(x, qtype)
    ref = ref_dequantize(raw, qtype)
    ours = dequantize(raw, qtype, x.shape)
    assert ours.dtype == torch.float32
    assert _bitwise_equal(ours.numpy(), ref)


@pytest.mark.parametrize("qtype", list(K_SCALE_OFFSETS), ids=lambda q: q.name)
def test_k_quants_random_equals_reference(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    raw = _random_k_blocks(qtype, 16, 1024, rng)
    ref = ref_dequantize(raw, qtype)
    ours = dequantize(raw, qtype, (16, 1024))
    assert _bitwise_equal(ours.numpy(), ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_chunked_path_and_output_dtype(monkeypatch, qtype):
    monkeypatch.setattr(dq, "_CHUNK_BLOCKS", 7)             # force several uneven chunks
    rng = np.random.default_rng(7)
    if qtype == Q.Q8_0:
        raw = ref_quantize(rng.standard_normal((10, 256)).astype(np.float32), qtype)
    else:
        raw = _random_k_blocks(qtype, 10, 256 * 3, rng)
    ref = ref_dequantize(raw, qtype)
    shape = ref.shape
    assert _bitwise_equal(dequantize(raw, qtype, shape).numpy(), ref)
    bf16 = dequantize(raw.tobytes(), qtype, shape, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, torch.from_numpy(ref).to(torch.bfloat16))


def test_3d_shape_and_torch_input():
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    raw = ref_quantize(x, Q.Q8_0)
    ours = dequantize(torch.from_numpy(raw.copy()), Q.Q8_0, (2, 3, 64))
    assert ours.shape == (2, 3, 64) and _bitwise_equal(ours.numpy(), ref_dequantize(raw, Q.Q8_0))


def test_float_types_do_not_alias_input():
    x = np.arange(32, dtype=np.float32)
    out = dequantize(x, Q.F32, (32,))
    out += 1
    assert x[0] == 0.0


def test_unsupported_type_names_tensor_and_supported():
    with pytest.raises(ModelLoadError) as ei:
        dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,), name="blk.0.ffn_up.weight")
    msg = str(ei.value)
    assert "blk.0.ffn_up.weight" in msg and "IQ2_XXS" in msg
    for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"):
        assert t in msg


def test_wrong_byte_count_is_clear():
    with pytest.raises(ModelLoadError, match="expected 68 for shape"):
        dequantize(np.zeros(60, np.uint8), Q.Q8_0, (64,), name="x")
    with pytest.raises(ModelLoadError, match="block size 32"):
        dequantize(np.zeros(34, np.uint8), Q.Q8_0, (2, 16), name="x")


# ---- real tensors of the default model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_gguf():
    from engine.loader.gguf_loader import open_gguf
    from engine.loader.resolve import resolve_model
    return open_gguf(resolve_model("gemma-3-270m").path)


@pytest.mark.slow
def test_default_model_tensors_equal_reference(default_gguf):
    g = default_gguf
    seen = set()
    for name, info in g.tensors.items():
        if info.ggml_type in seen and not name.startswith("blk.0."):
            continue
        seen.add(info.ggml_type)
        raw = g.raw(info)
        rows = info.shape[0] if name != "token_embd.weight" else 8192     # a slice of the 262k-row table
        raw2d = raw.reshape(info.shape[0], -1)[:rows] if len(info.shape) == 2 else raw
        shape = (rows, *info.shape[1:]) if len(info.shape) == 2 else info.shape
        ref = ref_dequantize(raw2d, Q(info.ggml_type)).reshape(shape)
        ours = dequantize(raw2d, info.ggml_type, shape, name=name)
        assert _bitwise_equal(ours.numpy(), ref), name
    assert {Q(t).name for t in seen} >= {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
