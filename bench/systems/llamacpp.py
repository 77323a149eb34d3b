"""The llama.cpp peer: llama-cpp-python on the same GGUF (``pip install -e '.[peer]'``), when installed."""
from __future__ import annotations

import time

import torch

from bench.options import BenchOptions, say
from bench.result import SystemResult
from bench.workloads import BenchPrompt
from engine.loader import resolve_model


def run_llama_cpp(opts: BenchOptions, prompts: list[BenchPrompt]) -> SystemResult:
    """llama.cpp through llama-cpp-python: its best configuration measured on this workload (module docstring)."""
    try:   # NOTE: an optional dependency (the peer extra): without it the system is reported skipped
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        return SystemResult(system="llama.cpp", label="llama.cpp",
                            skipped="llama-cpp-python not installed (pip install -e '.[peer]')")
    # which build runs (its instruction sets): a peer built for another CPU kind is not the same peer
    say(opts, f"llama.cpp {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}")
    src = resolve_model(opts.model)
    if src.kind != "gguf":
        return SystemResult(system="llama.cpp", label="llama.cpp", skipped="the model is not a GGUF file")
    T = opts.workload.output_tokens
    n_ctx = max(len(p.token_ids) for p in prompts) + T + 16
    threads = opts.threads or torch.get_num_threads()
    llm = Llama(model_path=str(src.path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                flash_attn=True, swa_full=True, verbose=False)
    ordered = sorted(prompts, key=lambda p: (p.group, p.index))
    outputs: dict[int, list[int]] = {}
    ttft, tpot = [], []

    def one(p: BenchPrompt, limit: int) -> list[int]:
        out, t0, t_first = [], time.monotonic(), None
        # greedy (top_k=1), no penalties; reset=True keeps the longest common prefix of the previous prompt
        for tok in llm.generate(list(p.token_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            t_first = t_first or time.monotonic()
            out.append(int(tok))
            if len(out) >= limit:
                break
        if limit == T:
            ttft.append(t_first - t0)
            if len(out) > 1:
                tpot.append((time.monotonic() - t_first) / (len(out) - 1))
        return out

    one(BenchPrompt(-1, -1, tuple(prompts[0].token_ids[:16])), 2)          # warm-up, like the others
    t0 = time.monotonic()
    for p in ordered:
        outputs[p.index] = one(p, T)
    wall = time.monotonic() - t0
    outs = [outputs[p.index] for p in prompts]
    llm.close()
    return SystemResult(system="llama.cpp", label="llama.cpp", wall_s=wall, num_requests=len(outs),
                        prompt_tokens=sum(len(p.token_ids) for p in prompts), cached_tokens=0,
                        output_tokens=sum(len(o) for o in outs), ttft_s=ttft, tpot_s=tpot, outputs=outs,
                        extra={"note": "llama-cpp-python, n_batch=512, flash_attn, swa_full, group order"})
