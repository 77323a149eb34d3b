"""bf16_gemm on AMX tiles (csrc/bf16_gemm/amx_tiles.h), the prefill attention's two products over a bf16 cache:
float32 products as exact as the vector kernel's, every row and every 32-key chunk computed alike wherever it sits in
a call (a prompt's chunking never changes a query's bits), and on only where the CPU has AMX."""
import pytest
import torch

from engine.kernels import library
from engine.kernels.cpu_features import cpuinfo_flags
from engine.kernels.gemm import bf16_gemm, pack_pairs

lib = library.load()
needs_lib = pytest.mark.skipif(lib is None, reason="no kernel library (no C compiler)")


@pytest.fixture
def amx():
    if not lib.bf16_gemm_amx(1):
        pytest.skip("no AMX-BF16 here (the CPU, the kernel or the build): bf16_gemm runs its vector kernel")
    yield
    lib.bf16_gemm_amx(int(library.amx_wanted()))


@needs_lib
def test_amx_is_on_only_where_the_cpu_has_it():
    try:
        assert lib.bf16_gemm_amx(0) == 0
        on = lib.bf16_gemm_amx(1)
        if "amx_bf16" not in cpuinfo_flags() or not lib.bf16_gemm_fast():
            assert on == 0
        assert ("AMX tiles" in library.describe()) == bool(on and library.amx_wanted())
    finally:
        lib.bf16_gemm_amx(int(library.amx_wanted()))


@needs_lib
@pytest.mark.parametrize("m, k, n", [(1, 64, 1), (5, 64, 17), (16, 32, 32), (33, 64, 100), (300, 64, 190),
                                     (200, 382, 64), (17, 30, 47)])
def test_amx_products_are_float32_exact_and_row_invariant(amx, m, k, n):
    g = torch.Generator().manual_seed(m * 31 + k + n)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    bp = pack_pairs(b)
    got = bf16_gemm(a, bp)
    ref = a.double() @ b.double()
    bound = (a.double().abs() @ b.double().abs()) * 2 ** -22 * k     # float32 accumulation of exact products
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()
    rows = list(range(0, m, max(1, m // 7)))
    alone = torch.cat([bf16_gemm(a[i:i + 1], bp) for i in rows])     # a row alone: the bits it had in the call
    assert torch.equal(alone, got[rows])
    cols = bf16_gemm(a, pack_pairs(b[:, : max(1, n // 2)]))          # fewer columns: the same bits for those kept
    assert torch.equal(cols, got[:, : max(1, n // 2)])


@needs_lib
@pytest.mark.parametrize("lead", [32, 64])
def test_leading_zero_chunks_of_32_keys_change_nothing(amx, lead):
    """The prefill kernel starts a tile's keys at a multiple of 32 (PREFILL_BF16_ALIGN): whole chunks of masked keys
    (probability 0) before the visible ones leave every sum's bits as they are."""
    g = torch.Generator().manual_seed(lead)
    p = torch.rand(48, 200, generator=g).bfloat16()
    v = torch.randn(200, 64, generator=g).bfloat16()
    base = bf16_gemm(p, pack_pairs(v))
    padded = bf16_gemm(torch.cat([torch.zeros(48, lead, dtype=torch.bfloat16), p], 1),
                       pack_pairs(torch.cat([torch.randn(lead, 64, generator=g).bfloat16(), v])))
    assert torch.equal(padded, base)


# ---- the int8 linear's prompt rows on AMX-BF16 tiles (csrc/qlinear/amx_prompt.h) ----

needs_prompt_amx = pytest.mark.skipif(lib is None or not lib.q8_prompt_amx(),
                                      reason="no AMX-BF16 tiles here for the int8 prompt rows")


@needs_lib
def test_batchgen_amx_0_keeps_int8_prompt_rows_off_the_tiles(monkeypatch):
    from engine.kernels.qlinear import prompt_amx_ok
    assert prompt_amx_ok() == bool(lib.q8_prompt_amx())
    monkeypatch.setenv("BATCHGEN_AMX", "0")
    assert not prompt_amx_ok()


@needs_lib
def test_asking_for_amx_prompt_rows_without_the_tiles_says_so(monkeypatch, caplog):
    """``kernels: {int8_prompts: bf16}`` where the tiles are off: a warning, and every row on the int8 dot products."""
    from torch import nn

    from engine.models.select_ops import use_amx_prompts
    from engine.quant import int8
    model = nn.Module()
    model.model = nn.Module()
    q, s = int8.quantize_rows(torch.randn(64, 96) * 0.05)
    model.model.layers = nn.ModuleList([int8.Int8Linear.from_quantized(q, s, 96, None)])
    monkeypatch.setenv("BATCHGEN_AMX", "0")
    with caplog.at_level("WARNING", logger="batchgen.engine"):
        assert use_amx_prompts(model, False) is None
        assert not caplog.records
        assert use_amx_prompts(model, True) is None
    assert "int8_prompts: bf16 needs AMX-BF16 tiles" in caplog.text
    assert model.model.layers[0].step_rows is None


@needs_prompt_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (600, 96, 64): two passes of rows (over 512); (70, 17000, 32): K in 17 chunks; (600, 2200, 48): both; bf16 rows
# with K a multiple of 32 are read in place (a pass's last block past M packed): (47, 896, 160), (600, 4000, 32);
# unless their stride is a multiple of 4 KB (then packed): (600, 4096, 32);
# few rows of a long K in one chunk: (64, 2600, 96); K in chunks with one pass, each chunk dequantized as it comes:
# (70, 17000, 32); two or more 32-row blocks run K in sub-chunks of 8 k-steps, a row alone (one block) in one
# run: (47, 896, 160) 8 + 8 + 8 + 4, (100, 640, 96), (600, 2200, 48) within K chunks
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (33, 100, 70), (47, 896, 160), (100, 640, 96), (600, 96, 64),
                                     (70, 17000, 32), (600, 2200, 48), (600, 4096, 32), (600, 4000, 32),
                                     (64, 2600, 96)])
def test_int8_prompt_rows_on_amx_are_bf16_products_of_the_int8_values(dtype, m, k, n):
    """y = bf16(x) @ bf16(q * scale)^T with float32 sums: against that product in float64, within float32
    summation; each row's bits as computed alone; the fused GLU is the unfused product's act(gate) * up, bit for bit."""
    from engine.kernels.qlinear import q8_linear_amx
    from engine.quant import int8
    g = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=g) + 0.3).to(dtype)
    q, s = int8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    pw, sw, _ = int8.pack(q, s)
    wd = int8.unpack(pw, sw, n, -(-k // 32) * 32)[:, :k].float().bfloat16().double()   # bf16(q * scale)
    xb = x.bfloat16().double()
    ref = xb @ wd.t()
    got = q8_linear_amx(x, pw, sw, n)
    assert got.dtype == dtype
    bound = (xb.abs() @ wd.abs().t()) * 2 ** -22 * k + (ref.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()
    rows = list(range(0, m, max(1, m // 5)))
    assert torch.equal(torch.cat([q8_linear_amx(x[i:i + 1], pw, sw, n) for i in rows]), got[rows])
    if n % 32 == 0:
        from engine.kernels.elementwise import glu
        qi, si = int8.glu_interleave(q, s)
        gw, gsw, _ = int8.pack(qi, si)
        fused = q8_linear_amx(x, gw, gsw, n, "silu")
        gate_up = q8_linear_amx(x, pw, sw, n)
        assert torch.equal(fused, glu(gate_up, "silu"))      # the same bits as the unfused GLU
        assert torch.equal(q8_linear_amx(x, gw, gsw, n, "gelu_tanh"), glu(gate_up, "gelu_tanh"))


@needs_prompt_amx
@pytest.mark.parametrize("m, k, n", [(600, 96, 64), (600, 2200, 64), (1100, 640, 96)])
def test_passes_that_dequantize_their_own_panels_give_the_shared_panels_bits(m, k, n):
    """A call in passes of rows dequantizes every weight once into panels the passes share, or, where that set is
    large and few passes read it, each pass its own (AMX_PROMPT_SHARED_BYTES; a build with it at 0 takes the second
    way for every call of up to 4 passes): the same bits, plain and with the fused GLU, float32 and bf16 rows. (600,
    96, 64): 2 passes; (600, 2200, 64): K in chunks too; (1100, 640, 96): 3 passes."""
    from engine.kernels import binding
    from engine.kernels import build as kbuild
    from engine.kernels.qlinear import q8_linear_amx
    from engine.quant import int8
    own = binding.open_library(kbuild.build(kbuild.compiler(), flag_sets=(
        [*kbuild.FLAG_SETS[0], "-DAMX_PROMPT_SHARED_BYTES=0"],)))
    assert own.q8_prompt_amx()
    g = torch.Generator().manual_seed(m + k + n)
    q, s = int8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    pw, sw, _ = int8.pack(q, s)
    gw, gsw, _ = int8.pack(*int8.glu_interleave(q, s))
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, k, generator=g) + 0.3).to(dtype)
        assert torch.equal(q8_linear_amx(x, pw, sw, n, lib=own), q8_linear_amx(x, pw, sw, n))
        assert torch.equal(q8_linear_amx(x, gw, gsw, n, "silu", lib=own), q8_linear_amx(x, gw, gsw, n, "silu"))


@needs_prompt_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [None, "silu"])
def test_streamed_results_are_the_cached_stores_bits(dtype, act):
    """Where a plain result's pieces are whole 64-byte lines (y aligned, row bytes a multiple of 64) the kernel
    stores them non-temporally: the same bits as its ordinary stores, which an unaligned ``out`` takes, and as a row
    alone; a GLU's results (half lines a pair in bf16) the same either way."""
    from engine.kernels.qlinear import q8_linear_amx
    from engine.quant import int8
    g = torch.Generator().manual_seed(6)
    m, k, n = 100, 640, 192                                  # six 32-column pairs; a GLU's result 96 columns
    x = torch.randn(m, k, generator=g).to(dtype)
    q, s = int8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    pw, sw, _ = int8.pack(*(int8.glu_interleave(q, s) if act else (q, s)))
    cols = n // 2 if act else n
    aligned = torch.empty(m, cols, dtype=dtype)
    assert aligned.data_ptr() % 64 == 0
    shifted = torch.empty(m * cols + 1, dtype=dtype)[1:].view(m, cols)   # one element off: no whole lines
    q8_linear_amx(x, pw, sw, n, act, out=aligned)
    q8_linear_amx(x, pw, sw, n, act, out=shifted)
    assert torch.equal(aligned, shifted)
    assert torch.equal(aligned[:1], q8_linear_amx(x[:1], pw, sw, n, act))


@needs_prompt_amx
def test_a_mixed_step_writes_both_row_kinds_into_one_result():
    """split_rows hands each kernel its row range of the step's result (no copy joining the parts): the same bits as
    each kernel's rows computed alone, and ``out`` that is not dense rows of x's dtype is refused."""
    from engine.kernels.qlinear import q8_linear, q8_linear_amx
    from engine.quant import int8
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 96, generator=g)
    q, s = int8.quantize_rows(torch.randn(64, 96, generator=g) * 0.05)
    pw, sw, ws = int8.pack(q, s)
    y = int8.split_rows(x, 3, 64, lambda r, out: q8_linear(r, pw, sw, ws, 64, out=out),
                        lambda r, out: q8_linear_amx(r, pw, sw, 64, out=out))
    assert torch.equal(y[:3], q8_linear(x[:3], pw, sw, ws, 64))
    assert torch.equal(y[3:], q8_linear_amx(x[3:], pw, sw, 64))
    with pytest.raises(ValueError, match="dense"):
        q8_linear_amx(x, pw, sw, 64, out=torch.empty(40, 128)[:, :64])


@needs_prompt_amx
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_one_side_in_bf16_keeps_the_float32_activations_bits(act):
    """q8_linear_amx with out_dtype bf16 over float32 x is the float32 result rounded once (a GLU's gate and up kept
    float32); a bf16 x holding those rounded values gives the float32 x's bits."""
    from engine.kernels.qlinear import q8_linear_amx
    from engine.quant import int8
    g = torch.Generator().manual_seed(11)
    x = torch.randn(70, 96, generator=g)
    q, s = int8.glu_interleave(*int8.quantize_rows(torch.randn(64, 96, generator=g) * 0.05))
    pw, sw, _ = int8.pack(q, s)
    for a in (None, act):
        f32 = q8_linear_amx(x, pw, sw, 64, a)
        assert torch.equal(q8_linear_amx(x, pw, sw, 64, a, out_dtype=torch.bfloat16), f32.bfloat16())
    assert torch.equal(q8_linear_amx(x.bfloat16(), pw, sw, 64, out_dtype=torch.float32),
                       q8_linear_amx(x.bfloat16().float(), pw, sw, 64))


@needs_prompt_amx
@pytest.mark.parametrize("out_rows", [0, 3, 40, "mask"])
def test_the_mlp_passes_prompt_rows_glu_in_bf16_with_the_same_bits(out_rows, monkeypatch):
    """Int8GluLinear.glu_down (the prompt rows' GLU result handed to the down projection in bf16) is down(glu(x))
    bit for bit, output rows (int8 dot products) and prompt rows (AMX tiles) alike, the first rows or a mask's."""
    from engine.models.linear import StepRows
    from engine.quant import int8
    g = torch.Generator().manual_seed(7)
    q, s = int8.glu_interleave(*int8.quantize_rows(torch.randn(128, 96, generator=g) * 0.05))
    gu = int8.Int8GluLinear.from_quantized(q, s, 96, None)
    q, s = int8.quantize_rows(torch.randn(96, 64, generator=g) * 0.05)
    dn = int8.Int8Linear.from_quantized(q, s, 64, torch.randn(96, generator=g))
    rows = StepRows()
    rows.use(torch.arange(40) % 9 == 0 if out_rows == "mask" else out_rows)
    gu.step_rows = dn.step_rows = rows
    x = torch.randn(40, 96, generator=g)
    from engine.kernels import qlinear
    dtypes, amx = [], qlinear.q8_linear_amx
    monkeypatch.setattr(qlinear, "q8_linear_amx", lambda *a, **k: dtypes.append(k.get("out_dtype")) or amx(*a, **k))
    fused = gu.glu_down(x, "silu", dn)
    assert dtypes == ([] if out_rows == 40 else [torch.bfloat16, torch.float32])    # the bf16 hand-over ran
    assert torch.equal(fused, dn(gu.glu(x, "silu")))


# ---- decode attention's scores on AMX tiles (csrc/paged_decode/avx512_bf16.c), two members' rows per tile ----

# G = 7 and 6 (Qwen2.5-0.5B, 1.5B): two members a tile; G = 4 (Llama-3.2-1B, gemma-3-270m): four
@pytest.mark.parametrize("hq, hkv, d", [(14, 2, 64), (12, 2, 128), (8, 2, 64), (4, 1, 256)])
def test_stacked_members_decode_as_alone(amx, hq, hkv, d):
    """Sequences sharing prefix blocks are walked together, up to 16 // G members' query rows side by side in each
    score tile and softmax vector: every sequence's output is bit-identical to decoding it alone, with a smaller last
    stack, members whose lengths end inside or past the shared blocks, float32 queries over a bf16 cache."""
    import engine.kernels.attention as kernel_attention
    g = torch.Generator().manual_seed(hq + d)
    bs, shared = 16, 10
    lens = [200, 170, 161, 300, 185, 90, 177]      # six share 10 blocks; the 90-token one ends inside them
    k = torch.randn(120, bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(120, bs, hkv, d, generator=g).bfloat16()
    tables = torch.zeros(len(lens), 24, dtype=torch.int32)
    used = shared
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :min(shared, nb)] = torch.arange(min(shared, nb))
        tables[i, min(shared, nb):nb] = torch.arange(used, used + nb - min(shared, nb))
        used += nb - min(shared, nb)
    q = torch.randn(len(lens), hq, d, generator=g) * 0.3
    lens_t = torch.tensor(lens, dtype=torch.int32)
    full = kernel_attention.call(lib, q, k, v, tables, lens_t, None, d ** -0.5)
    for i in range(len(lens)):
        one = kernel_attention.call(lib, q[i:i + 1], k, v, tables[i:i + 1], lens_t[i:i + 1], None, d ** -0.5)
        assert torch.equal(one[0], full[i]), i
    from engine.attention.metadata import AttentionMetadata
    from engine.attention.torch_backend import _decode
    meta = AttentionMetadata(slot_mapping=None, query_start_loc=list(range(len(lens) + 1)), seq_lens=lens,
                             block_tables=tables, num_decode_seqs=len(lens), block_size=bs)
    ref = _decode(q, k, v, meta, None, d ** -0.5, native=False).float()      # the torch path: gather, two matmuls
    assert (full - ref).abs().max().item() <= 3e-2 * max(1.0, ref.abs().max().item())
