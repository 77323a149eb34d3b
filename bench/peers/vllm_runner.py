"""vLLM's CPU backend on one bench request; runs INSIDE the vllm peer venv (bench/peers/setup.sh vllm), so it
imports only vllm and the standard library, never batchgen.

    python vllm_runner.py REQUEST.json RESULT.json

With ``held`` in the request it stays loaded and runs one round per signal (held.py).

The request (bench/systems/peer.py writes it): ``model`` (an HF directory), ``dtype`` (bfloat16 when absent),
``prompts`` and ``warmup`` (lists of token id lists), ``max_tokens``, ``prefix_caching``, ``max_model_len``,
``probe`` (only time the prompts: the dtype probe), ``warm_workload`` (run the prompts once untimed first: vLLM's
first run at the workload's shapes takes up to 2x its later ones). The environment (threads bound, Intel OpenMP
preloaded, KV space) is set by the caller, since vLLM reads it at import. The result: per prompt output token ids
and cached prompt tokens (``RequestOutput.num_cached_tokens``), ``load_s`` (the LLM built: weights, compile, KV
allocation), ``warmup_s``, ``generate_s`` (all prompts in one ``generate`` call; ``probe_s`` too when probing),
``warm_workload_s``, ``dtype``, and ``platform``: vLLM's platform class (``ZenCpuPlatform`` when zentorch is in use,
``CpuPlatform`` otherwise).
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        req = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    dtype = req.get("dtype") or "bfloat16"
    t = time.monotonic()
    # a checkpoint without a tokenizer (bench/dummy_checkpoint.py): prompts are token ids, as they are anyway
    no_tokenizer = not any(os.path.isfile(os.path.join(req["model"], f))
                           for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    llm = LLM(model=req["model"], dtype=dtype, enable_prefix_caching=bool(req["prefix_caching"]),
              max_model_len=int(req.get("max_model_len") or 4096), seed=0, skip_tokenizer_init=no_tokenizer)
    load_s = time.monotonic() - t

    def run(prompts: list[list[int]], n: int):
        # greedy, exactly n tokens each (EOS ignored): the same work as the other systems
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)

    t = time.monotonic()
    if req.get("warmup"):
        run(req["warmup"], 2)
    warmup_s = time.monotonic() - t
    mark = os.environ.get("BATCHGEN_PEER_MARK")     # when generation starts and ends (bench/peers/profile.sh)

    def timed() -> dict:
        t = time.monotonic()
        if mark:
            with open(mark, "a") as f:
                f.write(f"start {time.time()}\n")
        outs = run(req["prompts"], int(req["max_tokens"]))
        generate_s = time.monotonic() - t
        if mark:
            with open(mark, "a") as f:
                f.write(f"end {time.time()}\n")
        return {
            "peer": "vllm", "version": vllm.__version__, "load_s": load_s, "warmup_s": warmup_s,
            "generate_s": generate_s, "probe_s": generate_s if req.get("probe") else None, "dtype": dtype,
            "platform": type(current_platform).__name__,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
        }

    def fresh_round() -> dict:          # each held round from an empty prefix cache, as a first run
        llm.reset_prefix_cache()
        return timed()

    from held import answer
    answer(req, result_path, {"load_s": load_s, "warmup_s": warmup_s}, fresh_round)


if __name__ == "__main__":      # NOTE: the guard matters: vLLM starts its engine core in child processes
    main(*sys.argv[1:3])
