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
