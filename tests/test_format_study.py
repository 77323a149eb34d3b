"""bench.format_study: its simulated formats are the kernel's arithmetic (activation quants equal csrc/qlinear/'s,
today's format equals the int8 engine's logits), and the study measures every format."""
import pytest
import torch

import engine.kernels.library as library
import engine.kernels.qlinear as qlinear
from bench import format_study as fs
from bench.quality import sequence_logits
from engine import LLM
from engine.quant.int8 import Int8Linear, quantize_rows
from tests.model_utils import save_tiny, tiny_hf_model

needs_kernels = pytest.mark.skipif(library.load() is None, reason="no C kernels")


@needs_kernels
@pytest.mark.parametrize("k", [64, 112, 640])
def test_group_activations_are_the_kernels(k):
    """Per token and group of 32 the simulation dequantizes the kernel's own quants, to the bit (a partial last
    group included: its min and max over its real values)."""
    x = torch.randn(7, k) * torch.linspace(0.1, 8, k)
    x[2, 5] = 90.0                                          # an outlier channel
    q, sa, mn, kp = qlinear._q8_activations(library.load(), x)
    g = kp // 32
    deq = (q.view(7, g, 32).float() * sa.view(7, g, 1) + mn.view(7, g, 1)).view(7, kp)[:, :k]
    assert torch.equal(fs.simulate_activations(x, "group"), deq)


def test_token_activations_one_scale_per_row():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))    # not the global generator: order-free
    x[0, 3] = 50.0
    y = fs.simulate_activations(x, "token")
    for r in range(5):
        step = float((x[r].max() - x[r].min()) / 255)
        assert len(torch.unique(y[r])) <= 256
        assert float((y[r] - x[r]).abs().max()) <= step / 2 + 1e-5
    # the outlier row's small values lose almost everything; per group of 32 they do not
    assert float((y[0, 32:] - x[0, 32:]).abs().max()) > 10 * float(
        (fs.simulate_activations(x, "group")[0, 32:] - x[0, 32:]).abs().max())


def test_per_row_and_per_group_weights():
    w = torch.randn(40, 96)
    w[:, 7] *= 30                                           # one column far larger: per-row scales suffer
    row, grp = fs.quantize_per_row(w), fs.quantize_per_group(w)
    assert all(len(torch.unique(r)) <= 255 for r in row)
    assert float((row - w).abs().max()) <= float(w.abs().max() / 127 / 2) + 1e-5
    assert float((grp[:, 32:] - w[:, 32:]).abs().max()) < float((row[:, 32:] - w[:, 32:]).abs().max()) / 5
    q, s = quantize_rows(w)
    assert torch.equal(grp, (q.float().view(40, 3, 32) * s[..., None]).view(40, 96))


@needs_kernels
def test_simulated_linear_matches_the_int8_kernel():
    lin = torch.nn.Linear(112, 64, bias=False)
    q, s = quantize_rows(lin.weight.detach())
    mod = Int8Linear.from_quantized(q, s, 112)
    study = type("S", (), {"fmt": fs.FORMATS[0]})()
    sim = fs.SimulatedLinear(study, lin, fs.int8_weights(mod))
    x = torch.randn(9, 112)
    ref = mod(x)
    assert torch.allclose(sim(x), ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-formats")
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


@needs_kernels
def test_today_format_is_the_int8_engine(tiny_gemma):
    """Layer by layer the simulated today's format (GLU rows de-interleaved, the int8 embedding table and tied head)
    is the int8 engine's arithmetic: its first layer's linears, given the engine's own inputs, agree to float
    rounding (fed the simulation's inputs instead, a rounding difference upstream can flip one 8-bit activation
    quant: on one AMX Xeon it did at o_proj). Through the whole model such flips move later layers, so there the
    simulation only has to sit far closer to the int8 engine's logits than float32 does."""
    study = fs.Study(tiny_gemma)
    q8 = LLM(tiny_gemma, dtype="float32", quantization="int8", kv_cache_dtype="float32", kv_cache_memory=8 << 20)
    seq = list(range(3, 40))
    seen = {}

    def keep(tag):
        def hook(m, i, o):                                  # returns None: the module's output stays its own
            seen.setdefault(tag, (i[0].detach().clone(), o.detach().clone()))
        return hook
    for tag, model in (("sim", study.sim.model), ("q8", q8.model)):
        layer = model.model.layers[0]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj"):
            layer.get_submodule(name).register_forward_hook(keep(f"{tag} {name}"))
    study.fmt = fs.FORMATS[0]
    sim = sequence_logits(study.sim.model, seq, [len(seq)], 16)
    ref = sequence_logits(q8.model, seq, [len(seq)], 16)
    first = study.sim.model.model.layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj"):
        x, b = seen[f"q8 {name}"]
        with torch.no_grad():
            a = first.get_submodule(name)(x)
        assert torch.allclose(a, b, atol=1e-5 * float(b.abs().max()), rtol=0), name
    x, b = seen["q8 self_attn.qkv_proj"]                   # the first linear's input is the same in both models
    assert torch.allclose(seen["sim self_attn.qkv_proj"][0], x, atol=1e-6 * float(x.abs().max()), rtol=0)
    study.fmt = None
    fp32 = sequence_logits(study.ref.model, seq, [len(seq)], 16)
    assert float((sim - ref).abs().mean()) < float((fp32 - ref).abs().mean()) / 2
    study.fmt = fs.FORMATS[4]                              # per-row weights, per-token activations: further off
    other = sequence_logits(study.sim.model, seq, [len(seq)], 16)
    assert float((other - ref).abs().mean()) > 2 * float((sim - ref).abs().mean())


def test_measure_every_format(tiny_gemma):
    res = fs.measure(tiny_gemma, positions=60, log=lambda *_: None)
    assert list(res) == [f[0] for f in fs.FORMATS]
    for r in res.values():
        assert 0 <= r["top1"] <= 1 and r["kl"] >= 0 and r["positions"] >= 60
