"""Int8 weights (``quantization: int8``): the kernel in every build against an exact reference, the packing,
GGUF Q8_0 tensors kept as stored, and whole tiny models against float32 (the quality bar)."""
import pytest
import torch
import torch.nn.functional as F

import engine.kernels.build as kbuild
import engine.kernels.elementwise as elementwise
import engine.kernels.library as library
import engine.kernels.qlinear as qlinear
import engine.quant.int8 as int8
from engine import LLM, ConfigError, EngineConfig, SamplingParams
from engine.quant.policy import choose_quantization
from tests.model_utils import VOCAB, run_chunks, save_tiny, tiny_hf_model
from tests.test_cpu_kernels import BUILDS, _lib, _x86_with, build_libs

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")

# The int8 path of each build: VNNI needs AVX512-VNNI; an AVX-512 build without it uses the AVX2 code.
Q8_BUILDS = {
    "native": (None, None, True),
    "avx2": (BUILDS["avx2"][0], "avx2", BUILDS["avx2"][2]),
    "avx512-no-vnni": (["-O3", "-march=native", "-mno-avx512vnni", "-fopenmp"], "avx2",
                       _x86_with("avx512f") and _x86_with("avx512bw")),
    "portable": (["-O2"], "portable", True),
}


@pytest.fixture(scope="module")
def libs():
    return build_libs(Q8_BUILDS, isa=library.q8_isa)


def _reference(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, ws: torch.Tensor, n: int):
    """The kernel's math in float64 from the same quantized operands (the packed quants, their fp16 scales and
    group sums; the sums must be the quants'): (y, bound on float32 summation error)."""
    m, k = x.shape
    kp = int8.padded(k, 32)
    g = kp // 32
    xf = F.pad(x.float(), (0, kp - k)).view(m, g, 32)
    valid = (torch.arange(kp) < k).view(g, 32)
    lo = torch.where(valid, xf, torch.inf).amin(-1)
    hi = torch.where(valid, xf, -torch.inf).amax(-1)
    lo, hi = torch.where(valid.any(-1), lo, 0.0), torch.where(valid.any(-1), hi, 0.0)
    sa = (hi - lo) / 255.0
    inv = torch.where(sa > 0, 1.0 / sa, torch.zeros_like(sa))
    q = torch.round((xf - lo[..., None]) * inv[..., None]).clamp(0, 255) * valid
    wq = int8.unpack(w, torch.ones_like(sw), n, kp).double().view(n, g, 32)      # the int8 values
    scale = sw.view(-1, g, 16).permute(0, 2, 1).reshape(-1, g)[:n].double()
    sums = ws.view(-1, g, 16).permute(0, 2, 1).reshape(-1, g)[:n].double()
    assert torch.equal(sums, wq.sum(-1))
    corr = scale * sums
    dots = torch.einsum("mgk,ngk->mng", q.double(), wq)                          # exact integers
    terms = dots * scale[None] * sa.double()[:, None, :] + lo.double()[:, None, :] * corr[None]
    return terms.sum(-1), terms.abs().sum(-1)


SHAPES = [(1, 64, 48), (3, 100, 70), (4, 640, 32), (7, 96, 33), (48, 640, 1536), (130, 2048, 64)]


def _narrowed(q: torch.Tensor, wmax: int) -> torch.Tensor:
    """int8 values rescaled into +-wmax (like the default GGUF's Q5_0 tensors, +-16)."""
    return q if wmax == 127 else (q.float() * wmax / 127).round().to(torch.int8)


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("wmax", [16, 64, 127])
def test_int8_linear_every_build(libs, build, dtype, m, k, n, wmax):
    """Error bound per shape: |y - exact| <= 1e-5 * sum|terms| (float32 accumulation), plus output rounding
    (bf16: 2^-8 relative). Against the float product the only difference is the quantization itself.
    wmax 16, 64 and 127: the avx2 build's three paths (int16 sums over four steps within +-16, direct within
    +-64, the sign trick beyond)."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = (torch.randn(m, k, generator=g) + 0.3).to(dtype)          # skewed, like GeGLU outputs
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = int8.quantize_rows(w)
    pw, sw, ws = int8.pack(_narrowed(q, wmax), s * 127 / wmax)
    y = qlinear.q8_linear(x, pw, sw, ws, n, wmax, lib=lib)
    assert y.shape == (m, n) and y.dtype == dtype
    ref, mag = _reference(x, pw, sw, ws, n)
    out_round = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
    err = (y.double() - ref).abs()
    assert (err <= 1e-5 * mag + out_round * ref.abs() + 1e-7).all(), err.max().item()
    full = x.float() @ int8.unpack(pw, sw, n, k).t()              # the weights as stored: activation error only
    assert (y.float() - full).abs().max() <= 0.02 * full.abs().max()


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("wmax", [16, 64, 127])
def test_int8_linear_exact_at_the_extremes(libs, build, wmax):
    """Activation quants at 0 and 255 against weights at +-wmax: the avx2 build's vpmaddubsw sums pairs of products
    in int16 (at most 32767). Within +-16 it adds four steps' pair sums in int16 (up to 4 * 2 * 255 * 16 = 32640);
    within +-64 it multiplies the quants directly (pair sums up to 2 * 255 * 64 = 32640); beyond, 255 x 127 pairs
    would saturate, so it multiplies the centred quants |q - 128| by sign(q - 128) * w. Every build must stay
    exact: the float64 reference of the same quants."""
    lib = _lib(libs, build)
    m, k, n = 6, 128, 40
    x = torch.ones(m, k)
    x[:, ::32] = 0.0                                    # one low value per group: the rest quantize to 255
    x[1] = -x[1]                                        # ... or to 0
    x[2, 1::2] = 0.0                                    # alternating 0 / 255 pairs
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(0))
    q = torch.full((n, k), wmax, dtype=torch.int8)
    q[1::2] = -wmax
    q[2, ::3] = -wmax
    q[4, :] = 1
    s = torch.full((n, k // 32), 0.01)
    pw, sw, ws = int8.pack(q, s)
    y = qlinear.q8_linear(x, pw, sw, ws, n, wmax, lib=lib)
    ref, mag = _reference(x, pw, sw, ws, n)
    assert ((y.double() - ref).abs() <= 1e-5 * mag + 1e-7).all()
    exact_rows = [0, 1, 2, 4, 5]                        # values 0 and +-1 quantize without error
    assert torch.allclose(y[exact_rows], (x @ int8.unpack(pw, sw, n, k).t())[exact_rows], rtol=1e-4, atol=1e-4)
    idx, val = qlinear.q8_argmax(x, pw, sw, ws, n, wmax, lib=lib)
    assert torch.equal(val, y.max(-1).values)


def test_int8_linear_measures_its_weight_bound():
    q, s = int8.quantize_rows(torch.randn(40, 64))
    lin = int8.Int8Linear.from_quantized(_narrowed(q, 16), s, 64)
    assert lin.wmax == 16
    lin.set_packed(*int8.pack(q, s))
    assert lin.wmax == 127


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 37])
def test_int8_short_sums_match_the_direct_path(libs, build, m):
    """Weights within +-16 give bit-identical results whichever bound the caller passes (16: the avx2 build's int16
    sums over four k4 steps, two rows per pass; 64: its direct path; 127: the sign trick's centred quants fold
    128 * scale into the minimum, so that one is only close): the same int32 sums, the same float epilogue."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 640, generator=g) + 0.3
    q, s = int8.quantize_rows(torch.randn(96, 640, generator=g))
    pw, sw, ws = int8.pack(_narrowed(q, 16), s)
    assert torch.equal(qlinear.q8_linear(x, pw, sw, ws, 96, 16, lib=lib),
                       qlinear.q8_linear(x, pw, sw, ws, 96, 64, lib=lib))
    i16, v16 = qlinear.q8_argmax(x, pw, sw, ws, 96, 16, lib=lib)
    i64, v64 = qlinear.q8_argmax(x, pw, sw, ws, 96, 64, lib=lib)
    assert torch.equal(i16, i64) and torch.equal(v16, v64)


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("wmax", [16, 64, 127])
def test_int8_builds_agree_with_portable(libs, build, wmax):
    """The same integer dot products in every build; only float32 summation differs (the avx2 build's wide path
    also folds 128 * scale into the minimum), within 1e-5 of the sum of the terms' magnitudes."""
    lib, ref = _lib(libs, build), libs["portable"]
    g = torch.Generator().manual_seed(wmax)
    x = torch.randn(37, 640, generator=g)
    q, s = int8.quantize_rows(torch.randn(96, 640, generator=g))
    pw, sw, ws = int8.pack(_narrowed(q, wmax), s)
    a = qlinear.q8_linear(x, pw, sw, ws, 96, wmax, lib=lib)
    b = qlinear.q8_linear(x, pw, sw, ws, 96, wmax, lib=ref)
    _, mag = _reference(x, pw, sw, ws, 96)
    assert ((a.double() - b.double()).abs() <= 1e-5 * mag + 1e-6).all()


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("m, n", [(1, 70), (5, 1000), (48, 4100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wmax", [16, 127])
def test_int8_argmax_equals_argmax_of_the_linear(libs, build, m, n, dtype, wmax):
    """The greedy LM head (q8_argmax): each row's largest value and its first index, exactly q8_linear's
    values (float32), with planted ties across the threads' column ranges and a row of equal values."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, 96, generator=g).to(dtype)
    w = torch.randn(n, 96, generator=g) * 0.05
    w[n - 3] = w[n // 3]                                            # the same column twice: a tie
    x[0] = 0                                                        # all-equal logits: index 0
    q, s = int8.quantize_rows(w)
    pw, sw, ws = int8.pack(_narrowed(q, wmax), s)
    y = qlinear.q8_linear(x.float(), pw, sw, ws, n, wmax, lib=lib)
    idx, val = qlinear.q8_argmax(x.float(), pw, sw, ws, n, wmax, lib=lib)
    best = y.max(dim=-1)
    assert torch.equal(idx, best.indices) and torch.equal(val, best.values)
    assert idx[0] == 0


def _quant_act(lib, x: torch.Tensor):
    """The activation quantizer alone: (quants widened to int32 [M, Kp], scales [M, G], minima [M, G])."""
    m, k = x.shape
    kp = int8.padded(k, 32)
    q = torch.empty(m * kp, dtype=torch.uint8)
    sa, mn = torch.empty(m * kp // 32), torch.empty(m * kp // 32)
    fn = lib.q8_quant_act_bf16 if x.dtype == torch.bfloat16 else lib.q8_quant_act_f32
    fn(x.data_ptr(), m, k, x.stride(0), kp, q.data_ptr(), sa.data_ptr(), mn.data_ptr(), 2)
    return q.int().view(m, kp), sa.view(m, -1), mn.view(m, -1)


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quants_identical_in_every_build(libs, build, dtype):
    """The vector quantizers (whole groups of 32) give exactly the portable loop's quants, scales and minima,
    including a partial last group (K = 100), constant groups (scale 0) and exact .5 roundings."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 100, generator=g) * 3 + 0.5
    x[1, :32] = 1.25                                        # a constant group
    x[2, :32] = torch.arange(32) * (1 / 255) * 255 / 31     # values landing on .5 steps
    x[3, 32:64] = torch.tensor([0.0, 255.0] * 16)           # the full range, integer quants
    x = x.to(dtype)
    got, ref = _quant_act(_lib(libs, build), x), _quant_act(libs["portable"], x)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert int(got[0].max()) == 255 and int(got[0].min()) == 0


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wmax", [16, 127])
def test_one_call_linear_equals_quantize_then_gemm(libs, build, dtype, wmax):
    """q8_linear_* (quantizes into its own scratch, then multiplies) gives exactly the two-call path's output: the
    same quants (partial last group, K = 100; rows strided inside a wider tensor) and the same products."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(11)
    wide = (torch.randn(13, 130, generator=g) * 2 + 0.4).to(dtype)
    x = wide[:, 10:110]                                      # [13, 100], row stride 130
    q, s = int8.quantize_rows(torch.randn(70, 100, generator=g) * 0.05)
    pw, sw, ws = int8.pack(_narrowed(q, wmax), s * 127 / wmax)
    got = qlinear.q8_linear(x, pw, sw, ws, 70, wmax, lib=lib)
    qa, sa, mn, kp = qlinear._q8_activations(lib, x)
    two = torch.empty(13, 70, dtype=dtype)
    getattr(lib, f"q8_gemm_{library.SUFFIX[dtype]}")(qa.data_ptr(), sa.data_ptr(), mn.data_ptr(), 13, kp,
                                                          pw.data_ptr(), sw.data_ptr(), ws.data_ptr(),
                                                          pw.numel() // kp, 70, wmax, two.data_ptr(), 70, 2)
    assert torch.equal(got, two)


@pytest.mark.parametrize("build", list(Q8_BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("m, k, inter, wmax", [(1, 64, 16, 127), (7, 100, 48, 16), (48, 640, 2048, 16),
                                               (300, 96, 112, 127)])
def test_fused_glu_equals_linear_then_glu(libs, build, dtype, act, m, k, inter, wmax):
    """gate_up with its rows interleaved in blocks of 16 (Int8GluLinear) and the GLU in the matmul's store gives
    exactly the unfused path's bits: q8_linear on the plain rows, then the build's own GLU kernel on its output
    (bf16: gate and up rounded to bf16 before the activation, as the unfused output is stored)."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(m, k, generator=g) * 2 + 0.3).to(dtype)
    q, s = int8.quantize_rows(torch.randn(2 * inter, k, generator=g) * 0.05)
    q, s = _narrowed(q, wmax), s * 127 / wmax
    gate_up = qlinear.q8_linear(x, *int8.pack(q, s), 2 * inter, wmax, lib=lib)
    want = torch.empty(m, inter, dtype=dtype)
    glu_fn = getattr(lib, f"{elementwise._GLU[act]}_{library.SUFFIX[dtype]}")
    glu_fn(gate_up.data_ptr(), m, inter, want.data_ptr(), 2)
    got = qlinear.q8_linear_glu(x, *int8.pack(*int8.glu_interleave(q, s)), 2 * inter, act, wmax, lib=lib)
    assert torch.equal(got, want)


def test_int8_glu_linear_keeps_gate_up_order():
    """Int8GluLinear's plain ``linear`` (the unfused fallback) returns gate | up like an Int8Linear of the same
    rows; ``glu`` is the GLU of that."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 40, generator=g) * 0.1
    x = torch.randn(5, 40, generator=g)
    q, s = int8.quantize_rows(w)
    plain = int8.Int8Linear.from_quantized(q, s, 40)
    inter = int8.Int8GluLinear.from_quantized(*int8.glu_interleave(q, s), 40)
    assert torch.equal(inter.linear(x), plain.linear(x))
    assert torch.equal(inter.glu(x, "silu"), elementwise.glu(plain.linear(x), "silu"))


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_gated_mlp_takes_the_fused_glu_only_where_it_fits(act, monkeypatch):
    """A gated MLP whose gate_up is an Int8GluLinear (2I a multiple of 32, no bias) runs the fused kernel and gives
    exactly what the same weights give as a plain Int8Linear (unfused GLU); 2I = 48 stays plain."""
    from torch import nn

    from engine.models.layers import GatedMLP
    from engine.models.ops import CpuKernelOps
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 40, generator=g)
    mlp = GatedMLP(40, 32, act)
    q, s = int8.quantize_rows(torch.randn(64, 40, generator=g) * 0.1)
    mlp.down_proj = int8.Int8Linear.from_quantized(*int8.quantize_rows(torch.randn(40, 32, generator=g) * 0.1), 32)
    mlp.gate_up_proj = int8.Int8Linear.from_quantized(q, s, 40)
    mlp.ops = CpuKernelOps(int8_glu=False)                   # what engine.models.select_ops chooses for each
    plain = mlp(x)
    mlp.gate_up_proj = int8.Int8GluLinear.from_quantized(*int8.glu_interleave(q, s), 40)
    mlp.ops = CpuKernelOps(int8_glu=True)
    calls = []
    fused = qlinear.q8_linear_glu
    monkeypatch.setattr(qlinear, "q8_linear_glu", lambda *a, **k: calls.append(a[5]) or fused(*a, **k))
    assert torch.equal(mlp(x), plain)
    assert calls == [{"silu": "silu"}.get(act, "gelu_tanh")]          # one fused call, with the MLP's activation
    assert int8._is_gate_up("model.layers.0.mlp.gate_up_proj", nn.Linear(40, 64, bias=False))
    assert not int8._is_gate_up("model.layers.0.mlp.gate_up_proj", nn.Linear(40, 48, bias=False))
    assert not int8._is_gate_up("model.layers.0.mlp.gate_up_proj", nn.Linear(40, 64, bias=True))
    assert not int8._is_gate_up("model.layers.0.self_attn.qkv_proj", nn.Linear(40, 64, bias=False))


def test_gguf_int8_tensors_kept_exactly():
    """The default GGUF's Q8_0 tensors (token_embd, some attn_v) and Q5_0 tensors (q/k/gate/up) load as int8
    without a float round trip: quants x scales equal the dequantized values exactly. For Q8_0 that is also what
    requantizing gives; for Q5_0 requantizing (max|w| / 127) would move the values."""
    from engine.loader import load_model_config, resolve_model
    from engine.loader.dequant import GGMLType
    from engine.loader.gguf_loader import gguf_int8_weights, open_gguf

    src = resolve_model("gemma-3-270m")
    g = open_gguf(src.path)
    direct = gguf_int8_weights(src.path, load_model_config(src))
    assert "model.embed_tokens.weight" in direct and "model.layers.0.self_attn.v_proj.weight" in direct
    q, s = direct["model.layers.0.self_attn.v_proj.weight"]
    assert g.tensors["blk.0.attn_v.weight"].ggml_type == GGMLType.Q8_0
    assert q.dtype == torch.int8 and q.shape == (256, 640) and s.shape == (256, 20)
    q2, s2 = int8.quantize_rows(g.tensor("blk.0.attn_v.weight"))
    assert torch.equal(q, q2) and torch.equal(s.to(torch.float16), s2)

    assert g.tensors["blk.0.attn_q.weight"].ggml_type == GGMLType.Q5_0
    q, s = direct["model.layers.0.self_attn.q_proj.weight"]
    ref = g.tensor("blk.0.attn_q.weight").float()
    assert q.dtype == torch.int8 and q.abs().max() <= 16 and q.shape == (1024, 640)
    assert torch.equal((q.view(1024, 20, 32).float() * s[..., None]).view(1024, 640), ref)
    q2, s2 = int8.quantize_rows(ref)
    assert not torch.equal((q2.view(1024, 20, 32).float() * s2[..., None]).view(1024, 640), ref)
    kinds = {g.tensors[n].ggml_type for n in g.tensors}
    assert GGMLType.Q4_K in kinds and not any(n.endswith("attn_output.weight") for n in direct)


def test_q4_0_blocks_exact():
    """Q4_0 (d * (q - 8)) maps to int8 exactly too: built by hand, compared with the dequantizer."""
    from engine.loader.dequant import GGMLType, dequantize, int8_blocks

    gen = torch.Generator().manual_seed(0)
    rows, k = 3, 64
    d = (torch.rand(rows * k // 32, generator=gen) + 0.1).to(torch.float16)
    nib = torch.randint(0, 256, (rows * k // 32, 16), dtype=torch.uint8, generator=gen)
    raw = torch.cat([d.view(torch.uint8).view(-1, 2), nib], dim=1).reshape(-1)
    q, s = int8_blocks(GGMLType.Q4_0, raw, (rows, k))
    assert q.min() >= -8 and q.max() <= 7
    ref = dequantize(raw, GGMLType.Q4_0, (rows, k)).float()
    assert torch.equal((q.view(rows, 2, 32).float() * s[..., None]).view(rows, k), ref)


def test_choose_quantization():
    assert choose_quantization("none", "cpu", "avx512_vnni", True).name == "none"
    assert choose_quantization("int8", "cpu", "avx2").name == "int8"
    # int8 by name: the KV cache auto picks is auto's where int8 + bf16 KV was measured, else the activation dtype
    assert choose_quantization("int8", "cpu", "avx512_vnni", True).kv_cache_dtype == "bfloat16"
    assert choose_quantization("int8", "cpu", "avx2", False, kernel_isa="avx2").kv_cache_dtype == "bfloat16"
    for isa, bf16_attn, kisa in (("avx512_vnni", False, "avx512"), ("avx2", False, "avx512"),
                                 ("portable", False, None)):
        assert choose_quantization("int8", "cpu", isa, bf16_attn, kernel_isa=kisa).kv_cache_dtype is None
    # auto: int8 + a bf16 KV cache only where measured faster and within the bar (VNNI + bf16 attention kernel, no AMX)
    auto = choose_quantization("auto", "cpu", "avx512_vnni", True)
    assert auto.name == "int8" and auto.kv_cache_dtype == "bfloat16" and "measured faster" in auto.reason
    for isa, bf16_attn in (("avx512_vnni", False), ("avx2", True), ("avx2", False), ("portable", False),
                           (None, False)):
        assert choose_quantization("auto", "cpu", isa, bf16_attn).name == "none"
    # AVX2-only builds: int8, float32 activations, a bf16 KV cache; AVX-512 without VNNI (avx2 int8 path against an
    # AVX-512 float32 matmul) was not measured, so it keeps float weights
    avx2 = choose_quantization("auto", "cpu", "avx2", False, kernel_isa="avx2")
    assert avx2.name == "int8" and avx2.kv_cache_dtype == "bfloat16" and "AVX2-only" in avx2.reason
    assert choose_quantization("auto", "cpu", "avx2", False, kernel_isa="avx512").name == "none"
    assert choose_quantization("auto", "cpu", "avx2", False, dtype="bfloat16", kernel_isa="avx2").name == "none"
    assert choose_quantization("auto", "cpu", "avx512_vnni", True, dtype="bfloat16").name == "none"
    assert choose_quantization("auto", "cuda", None).name == "none"
    # a float checkpoint without a measurement: auto keeps float weights (the tuner measures int8 for it)
    assert choose_quantization("auto", "cpu", "avx512_vnni", True, quantized_source=False).name == "none"
    assert choose_quantization("int8", "cpu", "avx512_vnni", True, quantized_source=False).name == "int8"
    with pytest.raises(ConfigError, match="CPU only"):
        choose_quantization("int8", "cuda", None)
    with pytest.raises(ConfigError, match="kernels"):
        choose_quantization("int8", "cpu", None)
    with pytest.raises(ConfigError, match="quantization must be"):
        EngineConfig(quantization="int4")


# ---- whole tiny models ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny(tiny_hf_model(request.param), path)
    return path


def _agreement(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    lr, lo = F.log_softmax(ref.float(), -1), F.log_softmax(other.float(), -1)
    top1 = (lr.argmax(-1) == lo.argmax(-1)).float().mean().item()
    return top1, (lr.exp() * (lr - lo)).sum(-1).mean().item()


def test_tiny_model_close_to_float32(tiny_dir, monkeypatch, tmp_path):
    """Whole tiny models (every linear, the embedding and the LM head in int8), teacher-forced over 2,000+
    positions, against float32. Random weights give near-uniform next-token distributions (KL ~1e-6 for bf16)
    and Gaussian weights are int8's worst case, so this checks the wiring with absolute bounds; the quality bar
    (relative to bf16) is held on the real model: test_default_model_quality_bar."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (520,), generator=g).tolist() for _ in range(4)]
    fp32 = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=8 << 20)
    q8 = LLM(str(tiny_dir), quantization="int8", kv_cache_memory=8 << 20)
    assert q8.info.config.quantization == "int8" and q8.info.config.dtype == "float32"     # auto dtype under int8
    assert q8.info.weight_bytes < 0.5 * fp32.info.weight_bytes
    ref = torch.cat([run_chunks(fp32.model, s, [300, 220], block_size=16) for s in seqs])
    out = torch.cat([run_chunks(q8.model, s, [300, 220], block_size=16) for s in seqs])
    top1, kl = _agreement(ref, out)
    assert ref.shape[0] >= 2000 and top1 >= 0.94 and kl <= 1e-4, (top1, kl)


@pytest.mark.slow
def test_default_model_quality_bar():
    """The bar on gemma-3-270m over 2,000+ positions of the sample documents: int8's top-1 agreement with float32
    >= bf16's and its mean KL(fp32 || int8) <= 2x bf16's (bench.quality; printed by ``batchgen bench --quality``)."""
    from bench import quality
    res = quality.measure("gemma-3-270m", positions=2000, variants=quality.VARIANTS[:3], log=print)
    assert all(r["positions"] >= 2000 for r in res.values())
    assert quality.meets_bar(res), res


def test_tiny_model_generates_and_caches(tiny_dir, monkeypatch, tmp_path):
    """int8 runs through the whole engine; the second load maps the cached int8 weights and gives the same
    tokens; greedy tokens are identical batched and alone."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 40, 41, 42, 7], [1, 3, 3, 3, 100, 200], [1, 250, 251, 252, 9, 9, 9, 9, 9]]
    first = LLM(str(tiny_dir), dtype="float32", quantization="int8", block_size=4, kv_cache_memory=8 << 20)
    assert first.weights_from == "converted"
    batched = [o.token_ids for o in first.generate(prompts, sp)]
    alone = [first.generate([p], sp)[0].token_ids for p in prompts]
    assert batched == alone and all(len(t) == 12 for t in batched)
    second = LLM(str(tiny_dir), dtype="float32", quantization="int8", block_size=4, kv_cache_memory=8 << 20)
    assert second.weights_from == "cached"
    assert [o.token_ids for o in second.generate(prompts, sp)] == batched


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_greedy_tokens_are_the_argmax_of_the_logits(tiny_dir, monkeypatch, tmp_path, quantization):
    """Plain greedy steps take ``greedy_tokens`` (an int8 head never writes logits); it picks what the sampler
    picks from ``compute_logits``, and greedy generation through it equals generation through the sampler."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_dir), dtype="float32", quantization=quantization, block_size=4, kv_cache_memory=8 << 20)
    h = torch.randn(37, llm.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(llm.model.greedy_tokens(h), llm.model.compute_logits(h).argmax(-1))
    prompts = [[1, 5, 9, 40, 41, 42, 7], [1, 3, 3, 3, 100, 200]]
    fast = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                                       ignore_eos=True))]
    monkeypatch.setattr("engine.model_runner._plain_greedy", lambda req: False)
    slow = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                                       ignore_eos=True))]
    assert fast == slow


def test_auto_quantization_on_this_cpu(tiny_dir):
    """quantization: auto (the default) resolves from this machine's kernel build and the weights' source: a GGUF
    file (the default model) gets int8 with float32 activations and a bf16 KV cache where that was measured faster
    within the bar; without a measurement a float checkpoint keeps float weights. The reason says which."""
    from engine.quant.policy import kernel_bf16_attention, kernel_isa, kernel_q8_isa
    from engine.setup import setup_engine
    assert EngineConfig().quantization == "auto"
    vnni, avx2 = kernel_q8_isa() == "avx512_vnni" and kernel_bf16_attention(), kernel_q8_isa() == kernel_isa() == "avx2"
    s = setup_engine(EngineConfig("gemma-3-270m", kv_cache_memory=8 << 20))
    table_int8 = vnni or avx2
    assert s.config.quantization == ("int8" if table_int8 else "none")
    assert s.quant_choice.reason.startswith("auto")
    if table_int8:      # both: float32 activations, a bf16 KV cache (engine.quant.policy's measurements)
        assert s.config.dtype == "float32" and s.config.kv_cache_dtype == "bfloat16"
    explicit = setup_engine(EngineConfig("gemma-3-270m", kv_cache_dtype="float32", kv_cache_memory=8 << 20))
    assert explicit.config.kv_cache_dtype == "float32"                 # an explicit cache dtype wins
    hf = setup_engine(EngineConfig(str(tiny_dir), quantization="auto", kv_cache_memory=8 << 20))
    assert hf.config.quantization == "none" and "float checkpoint" in hf.quant_choice.reason
    # quantization: int8 asked for by name gets the same KV cache as auto's int8 where that was measured
    named = setup_engine(EngineConfig(str(tiny_dir), quantization="int8", kv_cache_memory=8 << 20))
    assert named.config.quantization == "int8" and named.config.dtype == "float32"
    assert named.config.kv_cache_dtype == ("bfloat16" if vnni or avx2 else "float32")


def test_int8_calibration_for_predictions():
    """`batchgen calibrate --dtype int8` measures our int8 linear; int8 engines' predictions use it."""
    from costmodel.calibrate import calibrate
    cal = calibrate("cpu", "int8", quick=True, save=False)
    assert cal.dtype == "int8" and cal.matmul_flops > 0 and cal.small_m_flops > 0
    with pytest.raises(ValueError, match="int8"):
        calibrate("cpu", "int4", quick=True, save=False)
