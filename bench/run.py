"""The bench's orchestrator: every selected system on one workload, in a fixed order (batchgen variants,
transformers, llama.cpp in this process; then the peers vLLM and OpenVINO, each a subprocess in its own venv);
the result dict is what ``--json`` saves."""
from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import time
from pathlib import Path

import torch

from bench.contend import contended_ratio, contention
from bench.options import BenchOptions, say
from bench.result import SystemResult
from bench.systems.batchgen import BATCHGEN_VARIANTS, run_batchgen
from bench.systems.llamacpp import run_llama_cpp
from bench.systems.peer import check_peer, run_peer
from bench.systems.registry import PEER_SYSTEMS, SYSTEMS
from bench.systems.transformers import hf_continuous_batching_available, load_hf_model, run_hf_cb, run_hf_generate
from bench.table import agreement, ratios
from bench.workloads import build_prompts, warmup_prompts
from costmodel.calibrate import get_calibration
from costmodel.roofline import Roofline
from engine.config import EngineConfig
from engine.dtype_policy import DTYPES
from engine.errors import ConfigError
from engine.loader import load_model_config, resolve_model
from engine.tokenizer import load_tokenizer


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _calibration(opts: BenchOptions, device: str):
    return get_calibration(device, opts.dtype, quick=opts.quick)


def run_bench(opts: BenchOptions, on_progress=None) -> dict:
    """Run every selected system on the workload; return the result dict (what ``--json`` saves).

    ``on_progress(partial_result)`` is called after each system (e.g. to save partial JSON of a long run).
    """
    unknown = sorted(set(opts.systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    for name in PEER_SYSTEMS:       # a peer that is not set up stops the run before anything runs (PeerMissing)
        if name in opts.systems:
            check_peer(name, opts.model)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    w = opts.workload
    env = {"commit": _git_commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": opts.dtype, "model": opts.model, "loadavg_before": _loadavg(), "started": time.time()}
    try:   # NOTE: only its version here; bench/systems/transformers.py says why it is imported late
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    results: list[SystemResult] = []
    prompts = tokenizer = roof = None
    model_info = None

    def summary() -> dict:
        agreement(results)
        return {"workload": dataclasses.asdict(w), "env": env, "model_info": model_info,
                "systems": [r.to_dict() for r in results], "ratios": ratios(results)}

    def add(res: SystemResult) -> None:
        results.append(res)
        if on_progress is not None:
            on_progress(summary())

    def ensure_prompts():
        """The prompts (and roofline), built once from the model's tokenizer and config, before any system."""
        nonlocal prompts, tokenizer, roof
        if prompts is None:
            src = resolve_model(opts.model)
            tok = tokenizer = load_tokenizer(src)
            mcfg = load_model_config(src)
            prompts = build_prompts(tok, w, opts.seed)
            if opts.roofline:
                cal = _calibration(opts, "cpu" if not torch.cuda.is_available() else "cuda")
                dtype_bytes = 4 if opts.dtype == "float32" else 2
                roof = Roofline(mcfg, dtype_bytes, cal)
                env["calibration"] = {"device": cal.device, "matmul_flops": cal.matmul_flops,
                                      "memory_bandwidth": cal.memory_bandwidth, "quick": cal.quick}
        return prompts

    for name in BATCHGEN_VARIANTS:
        if name not in opts.systems:
            continue
        say(opts, f"{name}: loading {opts.model}")
        llm = None
        try:
            ensure_prompts()
            res, llm = run_batchgen(opts, prompts, name, roof)
            model_info = model_info or llm.info.to_dict()
            if opts.contend:
                del llm
                gc.collect()
                say(opts, f"{name}: again beside {opts.contend} busy loop(s)")
                with contention(opts.contend):
                    busy, llm = run_batchgen(opts, prompts, name, roof)
                res.extra.update(contend=opts.contend, contended_wall_s=busy.wall_s,
                                 contention_ratio=contended_ratio(res.wall_s, busy.wall_s),
                                 contended_same_tokens=busy.outputs == res.outputs)
        except ConfigError as e:        # a setting this model cannot take (an int8 KV cache off its head_dim)
            res = SystemResult(system=name, label=name, skipped=str(e))
        finally:
            del llm
            gc.collect()
        if not res.skipped:
            say(opts, f"{name}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
        add(res)

    hf_systems = [s for s in ("hf-generate", "hf-cb") if s in opts.systems]
    if hf_systems:
        say(opts, f"transformers: loading {opts.model}")
        t = time.monotonic()
        hf_dtype = DTYPES[opts.dtype]
        try:
            hf = load_hf_model(opts.model, hf_dtype)
        except (ImportError, ValueError, OSError) as e:   # e.g. GGUF loading needs `accelerate`
            for name in hf_systems:
                add(SystemResult(system=name, label=name, skipped=f"cannot load in transformers: {e}"))
            hf_systems = []
        env["hf_load_s"] = time.monotonic() - t
    if hf_systems:
        ensure_prompts()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if "hf-generate" in hf_systems:
            for bs in opts.hf_batch_sizes:
                say(opts, f"hf-generate bs={bs}: running")
                res = run_hf_generate(hf, prompts, w.output_tokens, bs, pad_id, roof)
                say(opts, f"hf-generate bs={bs}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
                add(res)
        if "hf-cb" in hf_systems:
            why = hf_continuous_batching_available(hf)
            if why:
                add(SystemResult(system="hf-cb", label="hf-cb", skipped=why))
            else:
                say(opts, "hf-cb: running")
                try:
                    res = run_hf_cb(hf, prompts, w.output_tokens, pad_id, opts.max_num_batched_tokens
                                    or EngineConfig.max_num_batched_tokens, roof)
                    say(opts, f"hf-cb: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
                except Exception as e:      # NOTE: a baseline that breaks is reported, not fatal
                    res = SystemResult(system="hf-cb", label="hf-cb", skipped=f"failed: {type(e).__name__}: {e}")
                add(res)
        del hf
        gc.collect()

    if "llama.cpp" in opts.systems:
        ensure_prompts()
        say(opts, "llama.cpp: running")
        res = run_llama_cpp(opts, prompts)
        if not res.skipped:
            say(opts, f"llama.cpp: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
        add(res)

    for name in PEER_SYSTEMS:
        if name in opts.systems:
            ensure_prompts()
            res = run_peer(name, opts, prompts, warmup_prompts(tokenizer), torch.get_num_threads())
            if opts.contend and not res.skipped:      # the peer beside the same busy loops (its own process)
                say(opts, f"{name}: again beside {opts.contend} busy loop(s)")
                with contention(opts.contend):
                    busy = run_peer(name, opts, prompts, warmup_prompts(tokenizer), torch.get_num_threads())
                if not busy.skipped:
                    res.extra.update(contend=opts.contend, contended_wall_s=busy.wall_s,
                                     contention_ratio=contended_ratio(res.wall_s, busy.wall_s),
                                     contended_same_tokens=busy.outputs == res.outputs)
            if not res.skipped:
                say(opts, f"{name}: {res.wall_s:.1f} s (load {res.extra['load_s']:.1f} s), "
                          f"{res.output_tps:.1f} output tok/s")
            add(res)

    env["loadavg_after"] = _loadavg()
    env["finished"] = time.time()
    return summary()
