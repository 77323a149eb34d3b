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
