"""What ``batchgen plan`` would predict for a bench workload's batchgen run, beside what the run took.

The bench hands the engine token-id prompts, bypassing the pipeline's planner; here they are planned the way the
pipeline plans a job (``planner.make_plan`` over each group's shared head: predicted cached tokens at block
granularity) and priced with the engine's own ``plan_pricer(llm.info, llm.model_config)``, every request
generating the workload's output tokens (the bench sets ``ignore_eos``, so that is exactly what runs).
"""
from __future__ import annotations

import numpy as np

from bench.workloads import BenchPrompt
from costmodel.predict import Prediction, plan_pricer
from pipeline.plan.planner import Plan, make_plan


def bench_plan(prompts: list[BenchPrompt], block_size: int, prefix_caching: bool = True) -> Plan:
    """The planner's plan of ``prompts``, position by position in the order batchgen submits them (the list's:
    ``priorities=range(n)``), each request with the hit the planner predicts for it. ``build_prompts`` lists the
    groups in the planner's order where their sizes or first tokens decide it; should the planner order them
    otherwise, a first request's hit on another group's blocks is kept where the planner put it (the total is
    the same). Without prefix caching the engine computes every prompt token: nothing is predicted cached."""
    groups = np.asarray([p.group for p in prompts], dtype=np.int64)
    lens = np.asarray([len(p.token_ids) for p in prompts], dtype=np.int64)
    heads: dict[int, tuple[int, ...]] = {}
    for p in prompts:
        heads.setdefault(p.group, p.token_ids[:p.head_len])
    ids = sorted(heads)                          # the planner's groups are 0..G-1
    dense = np.searchsorted(ids, groups)
    planned = make_plan([heads[g] for g in ids], dense, lens, block_size)
    at = np.empty(len(prompts), dtype=np.int64)  # each request's plan position
    at[planned.order] = np.arange(len(prompts))
    cached = planned.cached[at] if prefix_caching else np.zeros(len(prompts), dtype=np.int64)
    provider = planned.provider[at]
    provider = np.where(provider < 0, -1, planned.order[np.maximum(provider, 0)]) if prefix_caching \
        else np.full(len(prompts), -1, dtype=np.int64)
    return Plan(order=np.arange(len(prompts)), cached=cached, provider=provider, prompt_len=lens, group=dense,
                group_order=list(dict.fromkeys(dense.tolist())), block_size=block_size)


def plan_prediction(llm, prompts: list[BenchPrompt], output_tokens: int) -> Prediction | None:
    """The engine's price of ``bench_plan`` for ``llm`` (its block size and prefix caching), or None where the
    engine has no pricer (its model's shape unknown)."""
    cfg = llm.info.config
    price = plan_pricer(llm.info, llm.model_config)
    if price is None:
        return None
    plan = bench_plan(prompts, cfg.block_size, cfg.enable_prefix_caching)
    return price(plan, np.full(plan.num_requests, output_tokens, dtype=np.int64))


def percent_over(predicted_s: float, achieved_s: float) -> float:
    """How much longer (positive) or shorter (negative) the run took than predicted, in percent of the
    prediction."""
    return 100.0 * (achieved_s / predicted_s - 1.0)


def prediction_line(predicted_s: float, achieved_s: float) -> str:
    return (f"plan predicted {predicted_s:.2f} s, achieved {achieved_s:.2f} s "
            f"({percent_over(predicted_s, achieved_s):+.0f} %)")
