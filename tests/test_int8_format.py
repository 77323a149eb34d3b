"""The int8 weight format (``engine.quant.int8``): fp16 scales and int16 group sums, packing round trips, rows
identical alone and in a batch (a VNNI build's fused few-row tiles against its stored sums), subnormal scales."""
import pytest
import torch

import engine.kernels.build as kbuild
import engine.kernels.qlinear as qlinear
import engine.quant.int8 as int8
from tests.test_cpu_kernels import _lib
from tests.test_int8 import Q8_BUILDS, _narrowed, _reference, libs  # noqa: F401  (libs: the builds' fixture)

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("wmax", [16, 127])
def test_rows_alone_equal_rows_in_a_batch(libs, build, wmax):
    """A row's output does not depend on its batch: alone, a VNNI build's tile sums the group's quants itself (the
    fused path, up to FUSED_MAX_ROWS rows) and reads the stored int16 sums in a batch of 13; the values (linear and
    argmax) are the same bits, in every build. The stored sums are the quants' (a corrupted one would show)."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 200, generator=g) + 0.5
    q, s = int8.quantize_rows(torch.randn(90, 200, generator=g) * 0.05)
    pw, sw, ws = int8.pack(_narrowed(q, wmax), s)
    batch = qlinear.q8_linear(x, pw, sw, ws, 90, wmax, lib=lib)
    alone = torch.cat([qlinear.q8_linear(x[i:i + 1], pw, sw, ws, 90, wmax, lib=lib) for i in range(13)])
    assert torch.equal(alone, batch)
    two = torch.cat([qlinear.q8_linear(x[i:i + 2], pw, sw, ws, 90, wmax, lib=lib) for i in range(0, 12, 2)])
    assert torch.equal(two, batch[:12])
    ib, vb = qlinear.q8_argmax(x, pw, sw, ws, 90, wmax, lib=lib)
    ia, va = qlinear.q8_argmax(x[:1], pw, sw, ws, 90, wmax, lib=lib)
    assert torch.equal(ia, ib[:1]) and torch.equal(va, vb[:1])


@pytest.mark.parametrize("build", list(Q8_BUILDS))
def test_subnormal_fp16_scales_read_exactly(libs, build):
    """Scales below fp16's normal range (tiny weights) are subnormal halves: every build widens them exactly (the
    float64 reference converts with torch), in the linear and in the embedding lookup."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g)
    q, s = int8.quantize_rows(torch.randn(40, 64, generator=g) * 2e-4)
    assert (s.float() < 6.1e-5).all() and (s > 0).all()                  # subnormal halves
    pw, sw, ws = int8.pack(q, s)
    y = qlinear.q8_linear(x, pw, sw, ws, 40, 127, lib=lib)
    ref, mag = _reference(x, pw, sw, ws, 40)
    assert ((y.double() - ref).abs() <= 1e-5 * mag + 1e-12).all()
    ids = torch.tensor([0, 7, 39])
    assert torch.equal(qlinear.q8_embed(ids, pw, sw, 64, torch.float32, lib=lib), int8.unpack(pw, sw, 40, 64)[ids])


def test_packed_format_bytes_and_sums():
    """1.125 bytes a weight stored (int8 quants, an fp16 scale and an int16 sum per 32), sums exact at the extremes
    (32 x 127 and 32 x -127 fit int16); a group beyond fp16 scales is refused with a clear error."""
    q = torch.full((32, 64), 127, dtype=torch.int8)
    q[1] = -127
    w, sw, ws = int8.pack(q, torch.full((32, 2), 0.01))
    assert (w.dtype, sw.dtype, ws.dtype) == (torch.int8, torch.float16, torch.int16)
    assert (w.numel() + 2 * sw.numel() + 2 * ws.numel()) / (32 * 64) == 1.125
    lin = int8.Int8Linear.from_quantized(q, torch.full((32, 2), 0.01), 64)
    assert {n: b.dtype for n, b in lin.named_buffers()} == {"qweight": torch.int8, "scales": torch.float16,
                                                            "sums": torch.int16}
    sums = ws.view(2, 2, 16).permute(0, 2, 1).reshape(32, 2)
    assert sums[0].tolist() == [32 * 127] * 2 and sums[1].tolist() == [-32 * 127] * 2
    with pytest.raises(ValueError, match="beyond fp16 scales"):
        int8.quantize_rows(torch.full((1, 32), 1e7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_dequantized(libs, dtype):
    w = torch.randn(100, 72)
    pw, sw, ws = int8.pack(*int8.quantize_rows(w))
    ids = torch.tensor([0, 99, 17, 17, 50])
    rows = qlinear.q8_embed(ids, pw, sw, 72, dtype)
    assert torch.equal(rows, int8.unpack(pw, sw, 100, 72)[ids].to(dtype))


def test_quantize_pack_roundtrip():
    w = torch.randn(70, 100)
    w[3, 32:64] = 0.0                                             # an all-zero group: scale 0, values 0
    q, s = int8.quantize_rows(w)
    assert q.shape == (70, 128) and s.shape == (70, 4) and q.abs().max() <= 127
    assert (q[:, 100:] == 0).all() and s[3, 1] == 0
    back = int8.unpack(*int8.pack(q, s)[:2], 70, 100)
    step = s.repeat_interleave(32, dim=1)[:, :100]
    assert ((back - w).abs() <= step / 2 + 1e-7).all()            # round to nearest: at most half a step
