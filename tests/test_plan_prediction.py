"""bench.plan_prediction: a batchgen bench run carries what ``batchgen plan`` predicts for the same work (the
planner's hits at block granularity, priced by the engine's own ``plan_pricer``), beside the seconds it took; the
size sweep's table shows both. No timing assertions: speeds here are noise."""
from __future__ import annotations

import numpy as np
import pytest

from bench.options import options_from
from bench.plan_prediction import bench_plan, percent_over, prediction_line
from bench.run import run_bench
from bench.sweep import SweepShape, format_sweep, median_result, sweep_row
from bench.table import format_table
from bench.workloads import build_prompts, make_workload
from costmodel.predict import plan_pricer
from engine.cache_root import cache_root
from engine.llm import LLM
from pipeline.plan.planner import make_plan
from tests.model_utils import save_tiny, tiny_hf_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_prediction_tiny")
    save_tiny(tiny_hf_model("llama"), path)
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh cache (a quick calibration, no tuning decisions of other models), sharing this machine's built
    kernel library: building it again takes most of a minute on 2 cores."""
    kernels = cache_root() / "kernels"
    path = tmp_path_factory.mktemp("plan_prediction_cache")
    if kernels.is_dir():
        (path / "kernels").symlink_to(kernels, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("BATCHGEN_CACHE_DIR", str(path))
    yield
    mp.undo()


def test_bench_plan_is_the_planners_hits_in_submission_order():
    w = make_workload("shared-prefix", quick=True, n=7, groups=3, prefix_tokens=40, doc_tokens=12)
    prompts = build_prompts(tiny_tokenizer(), w)
    plan = bench_plan(prompts, 16)
    assert plan.order.tolist() == list(range(7))
    assert plan.prompt_len.tolist() == [len(p.token_ids) for p in prompts]
    # each group's first request computes its head, the rest hit its two full blocks (40 tokens: 2 x 16); the
    # tiny tokenizer spells the header letter by letter, so later groups' first requests hit the shared first block
    first = {p.group: i for i, p in reversed(list(enumerate(prompts)))}
    assert plan.cached.tolist() == [(0 if i == 0 else 16) if first[p.group] == i else 32
                                    for i, p in enumerate(prompts)]
    # the same hits, request by request, as the pipeline's planner gives them in its own order
    heads = [next(p.token_ids[:p.head_len] for p in prompts if p.group == g) for g in range(3)]
    direct = make_plan(heads, [p.group for p in prompts], [len(p.token_ids) for p in prompts], 16)
    by_request = np.empty(7, dtype=np.int64)
    by_request[direct.order] = direct.cached
    assert plan.cached.tolist() == by_request.tolist()
    assert all(plan.provider[i] == (first[p.group] if plan.cached[i] == 32 else 0)
               for i, p in enumerate(prompts) if plan.cached[i])
    off = bench_plan(prompts, 16, prefix_caching=False)
    assert off.cached_tokens == 0 and (off.provider == -1).all() and off.prompt_tokens == plan.prompt_tokens


def test_percent_and_line():
    assert percent_over(4.0, 5.0) == pytest.approx(25.0)
    assert percent_over(5.0, 4.0) == pytest.approx(-20.0)
    assert prediction_line(4.0, 5.0) == "plan predicted 4.00 s, achieved 5.00 s (+25 %)"
    assert prediction_line(2.0, 1.5) == "plan predicted 2.00 s, achieved 1.50 s (-25 %)"


def test_a_bench_run_carries_the_plans_prediction(tiny_dir, cache_dir):
    opts = options_from("shared-prefix", quick=True, model=tiny_dir, dtype="float32", log=False,
                        systems=("batchgen", "batchgen-nocache"))
    result = run_bench(opts)
    got = {s["system"]: s["extra"] for s in result["systems"]}
    prompts = build_prompts(tiny_tokenizer(), opts.workload, opts.seed)
    T = opts.workload.output_tokens
    for name, caching in (("batchgen", True), ("batchgen-nocache", False)):
        extra = got[name]
        assert "prediction_error" not in extra, extra.get("prediction_error")
        assert extra["predicted_engine_s"] > 0
        assert extra["prediction"]["output_tokens"] == opts.workload.n * T
        llm = LLM(tiny_dir, dtype="float32", enable_prefix_caching=caching)
        plan = bench_plan(prompts, llm.info.config.block_size, caching)
        again = plan_pricer(llm.info, llm.model_config)(plan, np.full(plan.num_requests, T))
        assert extra["predicted_engine_s"] == again.engine_s
    # the cache-off run computes every prompt token: priced longer
    assert got["batchgen-nocache"]["predicted_engine_s"] > got["batchgen"]["predicted_engine_s"]
    table = format_table(result)
    for s in result["systems"]:
        assert f"{s['label']}: {prediction_line(s['extra']['predicted_engine_s'], s['wall_s'])}" in table


def _result(predicted, wall=5.0, skipped=None):
    sys = {"system": "batchgen-default", "label": "batchgen-default", "wall_s": wall, "skipped": skipped,
           "extra": {"predicted_engine_s": predicted, "prediction": {"basis": "roofline"}} if predicted else {}}
    peer = {"system": "vllm", "label": "vllm", "wall_s": 10.0, "skipped": None, "extra": {"dtype": "float32"}}
    return {"systems": [sys, peer]}


def test_sweep_row_and_table_show_plan_against_achieved():
    shape = SweepShape("long-prompt", "long-prompt", dict(n=4, groups=4, prefix_tokens=0, doc_tokens=20,
                                                          output_tokens=2), ("batchgen-default", "vllm"))
    sizes = dict(shape.sizes)
    rows = [sweep_row(shape, sizes, _result(4.0), 1.0), sweep_row(shape, sizes, _result(None), 1.0),
            sweep_row(shape, sizes, _result(4.0, None, "no int8 here"), 1.0)]
    assert rows[0]["systems"]["batchgen-default"]["predicted_engine_s"] == 4.0
    assert rows[0]["systems"]["batchgen-default"]["prediction_basis"] == "roofline"
    assert rows[0]["systems"]["vllm"]["predicted_engine_s"] is None
    table = format_sweep("tiny", "a CPU", rows).splitlines()
    assert table[2].endswith("| vllm / ours | plan / achieved |")
    assert table[4].endswith("| 2.00× | 4.00 s / 5.00 s (+25 %) |")
    assert table[5].endswith("| 2.00× | – |")                  # no prediction: nothing to compare
    assert table[6].endswith("| – | – |")                      # ours skipped


def test_repeated_rounds_count_each_systems_median():
    """Three rounds of a short shape: each system's median round (its whole entry: its own dtype), every round's
    seconds kept and shown as the spread; a round a system skipped does not count; the ratio is median over median."""
    def round_(ours, vllm, vllm_dtype="float32", skipped=None):
        return {"systems": [{"system": "batchgen-default", "label": "batchgen-default", "wall_s": ours,
                             "skipped": None, "extra": {}},
                            {"system": "vllm", "label": "vllm", "wall_s": vllm, "skipped": skipped,
                             "extra": {"dtype": vllm_dtype}}]}
    merged = median_result([round_(9.3, 12.5), round_(7.1, 10.5, "bfloat16"), round_(8.4, None, skipped="died"),
                            round_(8.0, 11.1)])
    ours, vllm = merged["systems"]
    assert (ours["wall_s"], ours["runs_s"]) == (8.0, [7.1, 8.0, 8.4, 9.3])          # lower of the middle two
    assert (vllm["wall_s"], vllm["runs_s"], vllm["extra"]["dtype"]) == (11.1, [10.5, 11.1, 12.5], "float32")
    assert median_result([round_(9.3, 12.5)]) == round_(9.3, 12.5)                  # one round: as it was
    shape = SweepShape("decode 1 row", "short-prompt", dict(n=1, groups=1, prefix_tokens=0, doc_tokens=64,
                                                            output_tokens=128), ("batchgen-default", "vllm"),
                       scale_n=False, repeats=4)
    row = sweep_row(shape, dict(shape.sizes), merged, 1.0)
    assert row["ratios"] == {"vllm": round(11.1 / 8.0, 3)}
    line = format_sweep("tiny", "a CPU", [row]).splitlines()[4]
    assert "| 8.0 s (4 runs 7.1-9.3) | 11.1 s (float32; 3 runs 10.5-12.5) |" in line
