"""The C paged-decode kernel equals the pure-torch gather path, in its AVX-512 build and its portable build."""
import shutil

import pytest
import torch

from engine import cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import _decode

pytestmark = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler on PATH")


def _case(dtype, lens, hq, hkv, d, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // bs) for n in lens) + 5
    k = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    width = max(-(-n // bs) for n in lens) + 2                    # padded rows, like the runner's tables
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.full((len(lens), width), 10_000, dtype=torch.int32)   # padding would fault if read
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=None, query_start_loc=list(range(len(lens) + 1)), seq_lens=list(lens),
                             block_tables=tables, num_decode_seqs=len(lens), block_size=bs)
    return q, k, v, meta


SHAPES = [  # (hq, hkv, head_dim, block_size): fast path (G in 1/2/4/8, D % 32 == 0) and portable fallbacks
    (4, 1, 256, 16), (8, 2, 64, 16), (8, 8, 32, 4), (16, 2, 128, 32), (6, 2, 64, 16), (4, 1, 48, 8), (4, 4, 64, 1)]
LENS = [1, 2, 15, 16, 17, 100, 531]


@pytest.fixture(scope="module")
def libs():
    native = cpu_kernels.load()
    assert native is not None, cpu_kernels.unavailable_reason()
    portable = cpu_kernels.open_library(cpu_kernels.build(cpu_kernels._compiler(), flag_sets=(["-O2"],)))
    return {"native": native, "portable": portable}


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("window", [None, 7, 64])
def test_kernel_equals_torch_gather_path(libs, build, dtype, shape, window):
    hq, hkv, d, bs = shape
    q, k, v, meta = _case(dtype, LENS, hq, hkv, d, bs)
    scale = d ** -0.5
    ref = _decode(q, k, v, meta, window, scale, native=False).float()
    got = cpu_kernels.call(libs[build], q, k, v, meta.block_tables, torch.tensor(LENS, dtype=torch.int32),
                           window, scale).float()
    # float32: same math up to summation order. bf16: the torch path rounds q*scale and the probabilities to
    # bf16 before its matmuls; the kernel keeps float32 probabilities.
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_rows_are_independent_of_the_batch(libs):
    """A sequence's output does not depend on which other sequences share the call (or on thread count)."""
    q, k, v, meta = _case(torch.bfloat16, LENS, 4, 1, 256, 16, seed=3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    full = cpu_kernels.call(libs["native"], q, k, v, meta.block_tables, lens, 64, 0.0625)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in (0, 4, 6):
            one = cpu_kernels.call(libs["native"], q[i:i + 1], k, v, meta.block_tables[i:i + 1], lens[i:i + 1],
                                   64, 0.0625)
            assert torch.equal(one[0], full[i])
    finally:
        torch.set_num_threads(threads)


def test_unsupported_shapes_are_refused(libs):
    q, k, v, meta = _case(torch.float32, [5], 3, 2, 32, 4)          # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="unsupported shape"):
        cpu_kernels.call(libs["native"], q, k, v, meta.block_tables, torch.tensor([5], dtype=torch.int32), None, 1.0)


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    """A broken compiler leaves the engine on the torch path with a reason, never a crash."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    assert cpu_kernels.load() is None
    assert "build failed" in cpu_kernels.unavailable_reason()
    q, k, _, _ = _case(torch.float32, [5], 4, 1, 32, 4)
    assert not cpu_kernels.supports(q, k)


# ---- fused bf16 elementwise kernels and the prefill softmax: against the torch ops they replace ---------------

def _bf16_close(got, ref, ulps=2):
    """Within a couple of bf16 ulps of the reference (torch rounds after every op; the kernels once)."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape
    err = (got - ref).abs()
    assert (err <= ulps * 2.0 ** -7 * ref.abs() + 1e-6).float().mean().item() > 0.999, err.max()
    assert err.max().item() <= 4 * 2.0 ** -7 * ref.abs().max().item()


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_glu_kernel(act):
    x = torch.randn(37, 2 * 96, generator=torch.Generator().manual_seed(0)).mul(3).to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    fn = (lambda t: torch.nn.functional.gelu(t, approximate="tanh")) if act == "gelu_tanh" else torch.nn.functional.silu
    _bf16_close(cpu_kernels.glu(x, act), fn(gate) * up)


def test_rms_norm_kernel_on_strided_heads_with_and_without_rope():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 3 * 64 + 2 * 64, generator=g).to(torch.bfloat16)
    q = qkv[:, :192].view(9, 3, 64)                                  # strided rows, as inside the fused qkv output
    w = torch.randn(64, generator=g)
    ref = q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w
    _bf16_close(cpu_kernels.rms_norm(q, w, 1e-6), ref)
    pos = torch.arange(100, 109, dtype=torch.float32)
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))[None]
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    r = ref.to(torch.bfloat16).float()
    rot = torch.cat((-r[..., 32:], r[..., :32]), -1)
    _bf16_close(cpu_kernels.rms_norm(q, w, 1e-6, cos, sin), r * cos.float() + rot * sin.float())
    before = qkv.clone()
    cpu_kernels.rope_(q, cos, sin)                                   # in place, only q's columns
    xf = before[:, :192].view(9, 3, 64).float()
    _bf16_close(q, xf * cos.float() + torch.cat((-xf[..., 32:], xf[..., :32]), -1) * sin.float())
    assert torch.equal(qkv[:, 192:], before[:, 192:])


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("outer", [1, 2])
def test_masked_softmax_kernel(window, outer):
    t, g, S, q_start, k_start = 6, 3, 14, 20, 9                      # queries 20..25 over keys 9..22
    scores = torch.randn(outer, t, g, S, generator=torch.Generator().manual_seed(2)).mul(4).to(torch.bfloat16)
    qp = torch.arange(q_start, q_start + t)[:, None, None]
    kp = torch.arange(k_start, k_start + S)[None, None, :]
    hide = (kp > qp) | ((kp <= qp - window) if window else torch.zeros_like(kp > qp))
    ref = torch.softmax(scores.float().masked_fill(hide, float("-inf")), dim=-1)
    got = cpu_kernels.masked_softmax_(scores.clone(), t, g, q_start, k_start, window)
    assert torch.equal(got.float()[hide.expand_as(got)], torch.zeros(int(hide.expand_as(got).sum())))
    _bf16_close(got, ref, ulps=1)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_bf16_model_with_kernels_matches_the_torch_path(arch, tmp_path, monkeypatch):
    """Whole tiny model in bf16 (chunked prefill + decode): every kernel on vs the pure-torch path."""
    from tests.model_utils import load_ours, run_chunks, save_tiny, tiny_hf_model
    ours = load_ours(save_tiny(tiny_hf_model(arch), tmp_path), torch.bfloat16)
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    chunks = [7, 20, 1, 1, 10, 1]
    with_kernels = run_chunks(ours, ids, chunks).float()
    monkeypatch.setattr(cpu_kernels, "elementwise_ok", lambda x: False)
    torch_only = run_chunks(ours, ids, chunks, native=False).float()
    assert (with_kernels - torch_only).abs().max().item() <= 0.05 * torch_only.abs().max().item()
    assert (with_kernels.argmax(-1) == torch_only.argmax(-1)).float().mean().item() >= 0.9
