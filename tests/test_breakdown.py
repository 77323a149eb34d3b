"""bench.breakdown (`batchgen bench --breakdown`): per-family timers over a real engine run on a tiny Gemma 3 —
exact call and operation counts, step kinds as the engine recorded them, the patched calls restored. No timing
assertions beyond "the parts fit in the whole"."""
from __future__ import annotations

import pytest

from bench.breakdown import FAMILIES, kernel_breakdown
from bench.table import format_table
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
    steps = []
    with kernel_breakdown() as bd:
        outs = llm.generate(prompts, params, on_step=steps.append)
    return llm, steps, bd, outs


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

    import engine.kernels.elementwise as elementwise
    import engine.kernels.qlinear as qlinear
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model_runner import ModelRunner
    from engine.models.layers import CausalLM

    before = (F.linear, qlinear.q8_linear, elementwise.rms_norm, ModelRunner.execute, CausalLM.greedy_tokens,
              TorchAttentionBackend.forward)
    with pytest.raises(RuntimeError):
        with kernel_breakdown():
            assert F.linear is not before[0]
            raise RuntimeError("stop")
    assert (F.linear, qlinear.q8_linear, elementwise.rms_norm, ModelRunner.execute, CausalLM.greedy_tokens,
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
    assert "matmul bound" not in table                     # no float system to compare with
    _, _, fbd, _ = _run(gemma_dir, "none")
    result["systems"].insert(0, {**result["systems"][0], "label": "batchgen", "system": "batchgen",
                                 "extra": {"breakdown": fbd.to_dict()}})
    table = format_table(result)
    assert "int8's matmul bound" in table and "batchgen-int8 vs batchgen, all steps:" in table
    assert "batchgen-int8 vs batchgen, decode-only steps:" in table


def _bd(mm_s: float, ops: float, rest_s: float, kind: str = "prefill") -> dict:
    return {kind: {"steps": 3, "step_s": mm_s + rest_s, "families": {
        "linears": {"s": mm_s * 0.75, "calls": 9, "ops_per_s": ops / mm_s},
        "LM head": {"s": mm_s * 0.25, "calls": 3, "ops_per_s": ops / mm_s},
        "attention": {"s": rest_s, "calls": 9, "ops_per_s": None}}}}


def test_matmul_bound_arithmetic():
    """float: 8 s of matmuls + 2 s else; int8: 4 s (4e12 ops) + 2 s: 1.67x, 2x if nothing else took time; 1.8x
    needs the int8 matmuls in 10 / 1.8 - 2 = 3.56 s: 2.25x the float matmuls' speed, at 4e12 / 3.56 s."""
    from bench.breakdown import format_bound, matmul_bound
    b = matmul_bound(_bd(8.0, 2e12, 2.0), _bd(4.0, 4e12, 2.0), None, 1.8)
    need = 10 / 1.8 - 2
    assert b["ratio"] == pytest.approx(10 / 6) and b["matmul_only"] == pytest.approx(2.0)
    assert b["needed_speedup"] == pytest.approx(8 / need) and b["needed_rate"] == pytest.approx(4e12 / need)
    # the rest alone over budget: no matmul speed reaches the target
    assert matmul_bound(_bd(8.0, 2e12, 2.0), _bd(4.0, 4e12, 6.0), None, 1.8)["needed_speedup"] is None
    # decode only: the prefill kind is ignored
    assert matmul_bound(_bd(8.0, 2e12, 2.0), _bd(4.0, 4e12, 2.0), "decode", 2.0) is None
    lines = format_bound("q8", "bf16", _bd(8.0, 2e12, 2.0), _bd(4.0, 4e12, 6.0), ((None, 1.8),))
    assert lines == ["q8 vs bf16, all steps: 1.00x; matmuls alone 2.00x (the ratio if nothing else took time); "
                     "1.8x is out of reach even with int8 matmuls taking no time"]
