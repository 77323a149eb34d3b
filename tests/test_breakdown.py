"""perf.breakdown (`batchgen bench --breakdown`): per-family timers over a real engine run on a tiny Gemma 3 —
exact call and operation counts, step kinds as the engine recorded them, the patched calls restored. No timing
assertions beyond "the parts fit in the whole"."""
from __future__ import annotations

import pytest

from perf.bench import format_table
from perf.breakdown import FAMILIES, kernel_breakdown
from tests.model_utils import save_tiny, tiny_hf_model

N_SEQ, PROMPT, OUT = 3, 21, 5


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("breakdown_gemma3")
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


def _run(gemma_dir, quantization):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(gemma_dir, dtype="float32", quantization=quantization, block_size=4, kv_cache_memory=8 << 20)
    prompts = [[1 + (7 * i + j) % 50 for j in range(PROMPT)] for i in range(N_SEQ)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=OUT)
    first = len(llm.step_stats)
    with kernel_breakdown() as bd:
        outs = llm.generate(prompts, params)
    return llm, llm.step_stats[first:], bd, outs


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_counts_follow_the_engine(gemma_dir, quantization):
    _, steps, bd, outs = _run(gemma_dir, quantization)
    assert [len(o.token_ids) for o in outs] == [OUT] * N_SEQ
    kinds = ["prefill" if s.num_prefill_tokens else "decode" for s in steps]
    assert bd.steps == {k: kinds.count(k) for k in set(kinds)}
    assert bd.steps == {"prefill": 1, "decode": OUT - 1}          # one step takes the three prompts whole
    layers = 4                                                    # tiny_hf_model("gemma3")
    for kind, n in bd.steps.items():
        # qkv, o, gate_up (GLU fused for int8), down per layer and step; the LM head once per step (all greedy)
        assert bd.calls[(kind, "linears")] == 4 * layers * n
        assert bd.calls[(kind, "LM head")] == n
        assert bd.calls[(kind, "attention")] == layers * n
        timed = sum(v for (k, f), v in bd.seconds.items() if k == kind)
        assert 0 < timed <= bd.step_seconds[kind] + 1e-9
        assert bd.other(kind) >= 0
    # every sampled row is one generated token: N_SEQ * OUT rows of hidden x vocab
    hidden, vocab = 64, tiny_hf_model("gemma3").config.vocab_size
    head_ops = sum(v for (k, f), v in bd.ops.items() if f == "LM head")
    assert head_ops == 2.0 * N_SEQ * OUT * hidden * vocab
    d = bd.to_dict()
    assert set(d) == set(bd.steps)
    assert all(set(v["families"]) <= set(FAMILIES) and "other" in v["families"] for v in d.values())
    lines = bd.format("tiny")
    assert lines[0].startswith("where tiny's step time went") and any(x.strip().startswith("linears") for x in lines)


def test_patches_are_restored(gemma_dir):
    import torch.nn.functional as F

    from engine import cpu_kernels
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model_runner import ModelRunner
    from engine.models.layers import CausalLM

    before = (F.linear, cpu_kernels.q8_linear, cpu_kernels.rms_norm, ModelRunner.execute, CausalLM.greedy_tokens,
              TorchAttentionBackend.forward)
    with pytest.raises(RuntimeError):
        with kernel_breakdown():
            assert F.linear is not before[0]
            raise RuntimeError("stop")
    assert (F.linear, cpu_kernels.q8_linear, cpu_kernels.rms_norm, ModelRunner.execute, CausalLM.greedy_tokens,
            TorchAttentionBackend.forward) == before


def test_bench_table_prints_the_breakdown(gemma_dir):
    _, _, bd, _ = _run(gemma_dir, "int8")
    result = {"workload": {"shape": "x", "n": 1, "groups": 1, "prefix_tokens": 1, "doc_tokens": 1,
                           "output_tokens": 1},
              "env": {"model": "m", "dtype": "float32", "threads": 2}, "ratios": {},
              "systems": [{"label": "batchgen-int8", "system": "batchgen-int8", "skipped": None,
                           "extra": {"breakdown": bd.to_dict()}, "wall_s": 1.0, "output_tokens_per_s": 1.0,
                           "total_tokens_per_s": 1.0, "ttft": None, "tpot": None, "hit_rate": None, "mfu": None,
                           "prefill_mfu": None, "decode_mbu": None, "match_rate": None}]}
    table = format_table(result)
    assert "where batchgen-int8's step time went" in table and "LM head" in table
