"""OpenVINO GenAI on one bench request; runs INSIDE the openvino peer venv (bench/peers/setup.sh openvino), so it
imports only openvino(_genai), numpy and the standard library, never batchgen.

    python openvino_runner.py REQUEST.json RESULT.json

With ``held`` in the request it stays loaded and runs one round per signal (held.py).

The request (bench/systems/peer.py writes it): ``model`` (an OpenVINO IR directory, its weights in the format
``dtype`` names: fp16 or int8), ``prompts``, ``groups`` (the shared-prefix group of each prompt), ``warmup``,
``max_tokens``, ``threads``, ``prefix_caching``, ``max_num_batched_tokens``, ``cache_size_gb``, ``probe`` (a dtype
probe: ``probe_s`` is its generate time), ``warm_workload`` (the prompts once untimed first). The result: per prompt
output token ids, ``load_s``, ``warmup_s``, ``generate_s``, per request TTFT/TPOT seen from the step loop (step
granularity). It does not report cached prompt tokens (``cached_tokens`` is null). Prompts and outputs are token
ids: the IR's tokenizer is never used (a dummy model's export has only a placeholder one).

NOTE: ContinuousBatchingPipeline looks a prefix up only when a request is added, so one ``generate()`` over all
prompts reuses nothing. With prefix caching on, the first prompt of each group goes first; the pipeline steps
until each of those has its first token (its prompt is in the cache), then the rest are added.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def make_pipeline(req: dict) -> ov_genai.ContinuousBatchingPipeline:
    sc = ov_genai.SchedulerConfig()
    sc.enable_prefix_caching = bool(req["prefix_caching"])
    sc.cache_size = int(req.get("cache_size_gb") or 4)                # GB of KV cache
    sc.max_num_batched_tokens = int(req.get("max_num_batched_tokens") or 1024)   # its default is 256 per step
    sc.dynamic_split_fuse = True
    props = {"INFERENCE_NUM_THREADS": int(req["threads"])} if req.get("threads") else {}
    return ov_genai.ContinuousBatchingPipeline(req["model"], sc, "CPU", props)


def generate(pipe, prompts: list[list[int]], groups: list[int], n: int, leaders_first: bool) -> dict:
    """Exactly ``n`` greedy tokens per prompt (EOS ignored), driven step by step; leaders first when asked."""
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = n
    cfg.min_new_tokens = n
    cfg.ignore_eos = True
    cfg.do_sample = False
    seen, leaders, rest = set(), [], []
    for i, g in enumerate(groups):
        (rest if g in seen else leaders).append(i)
        seen.add(g)
    if not leaders_first:
        leaders, rest = list(range(len(prompts))), []
    handles, added, first, done = {}, {}, {}, {}

    def add(i: int) -> None:
        added[i] = time.monotonic()
        handles[i] = pipe.add_request(i, ov.Tensor(np.array([prompts[i]], dtype=np.int64)), cfg)

    def step() -> None:
        pipe.step()
        now = time.monotonic()
        for i, h in handles.items():
            if i not in first and h.can_read():
                first[i] = now
            if i not in done and h.get_status() == ov_genai.GenerationStatus.FINISHED:
                done[i] = now
                first.setdefault(i, now)

    for i in leaders:
        add(i)
    while rest and pipe.has_non_finished_requests() and any(i not in first for i in leaders):
        step()
    for i in rest:
        add(i)
    while pipe.has_non_finished_requests():
        step()
    outputs = []
    for i in range(len(prompts)):
        h = handles[i]
        status = h.get_status()
        if status != ov_genai.GenerationStatus.FINISHED:
            raise RuntimeError(f"request {i} ended {status}")
        outputs.append([int(t) for t in h.read_all()[0].generated_ids])
    ttft = [first[i] - added[i] for i in range(len(prompts))]
    tpot = [(done[i] - first[i]) / (len(outputs[i]) - 1) for i in range(len(prompts)) if len(outputs[i]) > 1]
    return {"outputs": outputs, "ttft_s": ttft, "tpot_s": tpot}


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        req = json.load(f)
    t = time.monotonic()
    pipe = make_pipeline(req)
    load_s = time.monotonic() - t

    def warm_up() -> None:
        if req.get("warmup"):
            generate(pipe, req["warmup"], list(range(len(req["warmup"]))), 2, False)

    t = time.monotonic()
    warm_up()
    warmup_s = time.monotonic() - t
    prompts = req["prompts"]
    groups = req.get("groups") or list(range(len(prompts)))

    used = False            # whether the pipeline's prefix cache holds the workload's prompts

    def timed() -> dict:
        nonlocal used
        used = True
        t = time.monotonic()
        res = generate(pipe, prompts, groups, int(req["max_tokens"]), bool(req["prefix_caching"]))
        generate_s = time.monotonic() - t
        res.update(peer="openvino", version=ov_genai.__version__, load_s=load_s, warmup_s=warmup_s,
                   generate_s=generate_s, probe_s=generate_s if req.get("probe") else None, dtype=req.get("dtype"),
                   prompt_tokens=[len(p) for p in prompts], cached_tokens=None)
        return res

    def fresh_round() -> dict:
        # the pipeline has no way to empty its prefix cache: a new one, built and warmed up untimed, once it has run
        # the workload (the first pipeline is fresh)
        nonlocal pipe
        if req["prefix_caching"] and used:
            del pipe
            pipe = make_pipeline(req)
            warm_up()
        return timed()

    from held import answer
    answer(req, result_path, {"load_s": load_s, "warmup_s": warmup_s}, fresh_round)


if __name__ == "__main__":
    main(*sys.argv[1:3])
