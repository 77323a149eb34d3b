"""Our models' logits equal transformers' on tiny random checkpoints of every supported architecture.

Tolerance: float32 on both sides; max |diff| <= 1e-4 * max(1, max |logit|).
"""
import pytest
import torch

from tests.model_utils import VOCAB, load_ours, run_chunks, save_tiny, tiny_hf_model

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "gemma3"]


def _close(ours, ref):
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff} > {tol}"


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    hf = tiny_hf_model(request.param)
    src = save_tiny(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, load_ours(src)


def _ref_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_full_sequence_logits_match_transformers(pair):
    _, hf, ours = pair
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    _close(run_chunks(ours, ids, [37]), _ref_logits(hf, ids))


@pytest.mark.parametrize("native", [None, False], ids=["c-kernel-decode", "torch-decode"])
def test_chunked_prefill_and_decode_match_full_forward(pair, native):
    """Prefill in uneven chunks over a cached prefix, then single-token decode steps: same logits."""
    _, hf, ours = pair
    ids = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    _close(run_chunks(ours, ids, [5, 13, 1, 17, 1, 1, 1, 1, 1], native=native), _ref_logits(hf, ids))


def test_fused_sdpa_prefill_matches_transformers(pair):
    """The fused prefill a GPU takes (one scaled_dot_product_attention call a chunk, its mask for causality and the
    sliding window), forced here on the CPU: uneven chunks over a cached prefix, then decode, same logits."""
    _, hf, ours = pair
    ids = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    _close(run_chunks(ours, ids, [5, 13, 1, 17, 1, 1, 1, 1, 1], native=False, prefill="sdpa"), _ref_logits(hf, ids))


def test_engine_step_computes_only_sampled_rows_with_transformers_logits(pair):
    """A mixed step as the model runner builds it (two prefill chunks, one that samples, one mid-prompt, plus
    a decode): with ``sample_rows`` the last layer computes only the sampled rows, and their logits equal
    transformers' full forward at those positions."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler_output import ScheduledRequest, SchedulerOutput

    _, hf, ours = pair
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (23, 30, 9)]
    runner = ModelRunner(ours, num_blocks=32, block_size=4, dtype=torch.float32, device=torch.device("cpu"),
                         backend=TorchAttentionBackend())
    # sampled rows (not greedy: a plain greedy step takes the argmax without computing logits)
    reqs = {str(i): Request(str(i), p, SamplingParams(temperature=0.5, seed=i, max_tokens=4))
            for i, p in enumerate(prompts)}
    tables = {"0": list(range(0, 8)), "1": list(range(8, 16)), "2": list(range(16, 24))}
    captured = {}
    orig = ours.compute_logits
    ours.compute_logits = lambda h: captured.setdefault("logits", orig(h))
    try:
        # step 1: prompt 2 completely except its last token; prompt 0's first 15 tokens (no sample)
        runner.execute(SchedulerOutput(scheduled=[
            ScheduledRequest("2", prompts[2][:8], 0, tables["2"], False, True),
            ScheduledRequest("0", prompts[0][:15], 0, tables["0"], False, True)]), reqs)
        assert "logits" not in captured
        # step 2: prompt 2's last token (a one-token chunk that samples), prompt 0's rest (samples), and
        # prompt 1's first 20 tokens (no sample)
        runner.execute(SchedulerOutput(scheduled=[
            ScheduledRequest("2", prompts[2][8:], 8, tables["2"], True, True),
            ScheduledRequest("0", prompts[0][15:], 15, tables["0"], True, True),
            ScheduledRequest("1", prompts[1][:20], 0, tables["1"], False, True)]), reqs)
    finally:
        ours.compute_logits = orig
    got = captured["logits"].float()
    assert got.shape[0] == 2
    _close(got[0], _ref_logits(hf, prompts[2])[-1])
    _close(got[1], _ref_logits(hf, prompts[0])[-1])


def test_pending_residual_add_gives_the_eager_adds_bits(pair, monkeypatch):
    """Each layer's MLP output is added to the residual stream in the next layer's input-norm pass (and the last
    one's in the final norm's): the same logits, bit for bit, as adding it at once and norming after."""
    import engine.models.layers as layers
    from engine.models.ops import TorchOps
    _, _, ours = pair
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(5)).tolist()
    fused = run_chunks(ours, ids, [11, 13, 1, 1, 1, 1, 1])

    def eager(ops, x, pending, norm):      # torch's add, then the ops' own norms: the base class's residual_norm
        return (x, norm(x)) if pending is None else TorchOps.residual_norm(ops, x, *pending, norm)
    monkeypatch.setattr(layers, "with_pending", eager)
    for mod in ("engine.models.llama", "engine.models.gemma3"):
        monkeypatch.setattr(f"{mod}.with_pending", eager)
    assert torch.equal(run_chunks(ours, ids, [11, 13, 1, 1, 1, 1, 1]), fused)
