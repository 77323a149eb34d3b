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
from bench.plan_prediction import prediction_line
from bench.result import SystemResult
from bench.systems.batchgen import BATCHGEN_VARIANTS, run_batchgen
from bench.systems.llamacpp import run_llama_cpp
from bench.systems.peer import check_peer, run_peer
from bench.systems.registry import PEER_SYSTEMS, SYSTEMS
from bench.systems.transformers import hf_continuous_batching_available, load_hf_model, run_hf_cb, run_hf_generate
from bench.table import agreement, ratios
from bench.workloads import build_prompts, prompt_tokenizer, warmup_prompts
from costmodel.calibrate import get_calibration
from costmodel.roofline import Roofline, RunFormat
from engine.config import EngineConfig
from engine.dtype_policy import DTYPES
from engine.errors import ConfigError
from engine.loader import load_model_config, resolve_model
from engine.malloc import release_freed_memory
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


def _calibration(opts: BenchOptions, device: str, dtype: str | None = None):
    return get_calibration(device, dtype or opts.dtype, quick=opts.quick)


def _calibration_summary(cal) -> dict:
    """What the result's env keeps of a calibration."""
    return {"device": cal.device, "matmul_flops": cal.matmul_flops, "memory_bandwidth": cal.memory_bandwidth,
            "quick": cal.quick, "peak_kernel": cal.peak_kernel,
            "kernel_flops": {k: v["matmul_flops"] for k, v in cal.kernel_flops.items()}}


def check_systems(opts: BenchOptions) -> None:
    """Unknown systems, and peers that are not set up (PeerMissing), stop the run before anything runs."""
    unknown = sorted(set(opts.systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    for name in PEER_SYSTEMS:
        if name in opts.systems:
            check_peer(name, opts.model, opts.load_format)


def environment(opts: BenchOptions) -> dict:
    """What the run ran on (the result's ``env``), as it starts."""
    env = {"commit": _git_commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": opts.dtype, "model": opts.model, "loadavg_before": _loadavg(), "started": time.time()}
    try:   # NOTE: only its version here; bench/systems/transformers.py says why it is imported late
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def _note_contention(res: SystemResult, busy: SystemResult, contend: int) -> None:
    """The run beside busy loops, in ``res.extra``."""
    res.extra.update(contend=contend, contended_wall_s=busy.wall_s,
                     contention_ratio=contended_ratio(res.wall_s, busy.wall_s),
                     contended_same_tokens=busy.outputs == res.outputs)


class BenchRun:
    """One bench run's state: the results so far, and the prompts (and roofline) built once before any system."""

    def __init__(self, opts: BenchOptions, env: dict, on_progress=None):
        self.opts, self.env, self.on_progress = opts, env, on_progress
        self.results: list[SystemResult] = []
        self.prompts = self.tokenizer = self.roof = self.mcfg = None
        self.model_info = None
        self.calibrations: dict[str, object] = {}    # calibration dtype -> Calibration (None: none here)

    def fork(self, **env) -> "BenchRun":
        """Another run of the same workload (a round), its prompts, roofline and calibrations shared, no results
        yet; ``env`` added to its environment."""
        other = BenchRun(self.opts, {**self.env, **env, "started": time.time()}, self.on_progress)
        for k in ("prompts", "tokenizer", "roof", "mcfg", "model_info", "calibrations"):
            setattr(other, k, getattr(self, k))
        return other

    def finish(self) -> dict:
        self.env["loadavg_after"] = _loadavg()
        self.env["finished"] = time.time()
        return self.summary()

    def summary(self) -> dict:
        agreement(self.results)
        return {"workload": dataclasses.asdict(self.opts.workload), "env": self.env, "model_info": self.model_info,
                "systems": [r.to_dict() for r in self.results], "ratios": ratios(self.results)}

    def add(self, res: SystemResult) -> None:
        self.results.append(res)
        if self.on_progress is not None:
            self.on_progress(self.summary())

    def ensure_prompts(self):
        """The prompts (and roofline), built once from the model's tokenizer and config, before any system."""
        opts = self.opts
        if self.prompts is None:
            src = resolve_model(opts.model, opts.load_format)
            tok = self.tokenizer = prompt_tokenizer(load_tokenizer(src))
            mcfg = self.mcfg = load_model_config(src)
            self.prompts = build_prompts(tok, opts.workload, opts.seed)
            if opts.roofline:        # the bench dtype's: transformers runs in it (batchgen: roof_for)
                cal = self.calibration(opts.dtype)
                dtype_bytes = 4 if opts.dtype == "float32" else 2
                self.roof = Roofline(mcfg, dtype_bytes, cal)
                self.env["calibration"] = _calibration_summary(cal)
        return self.prompts

    def calibration(self, dtype: str):
        """This device's calibration at ``dtype`` (int8: the int8 peak), measured once if none is cached; None
        where there is none (int8 off the CPU). Each one used lands in ``env["calibrations"]``."""
        if dtype not in self.calibrations:
            try:
                cal = _calibration(self.opts, "cpu" if not torch.cuda.is_available() else "cuda", dtype)
            except ValueError:
                cal = None
            self.calibrations[dtype] = cal
            if cal is not None:
                self.env.setdefault("calibrations", {})[dtype] = _calibration_summary(cal)
        return self.calibrations[dtype]

    def roof_for(self, fmt: RunFormat) -> Roofline | None:
        """The roofline of the format a batchgen engine ran (its peak, weight and KV bytes); None: --no-roofline."""
        if not self.opts.roofline:
            return None
        self.ensure_prompts()
        return Roofline.for_format(self.mcfg, fmt, self.calibration(fmt.calibration_dtype))

    def batchgen_variants(self) -> None:
        for name in BATCHGEN_VARIANTS:
            if name in self.opts.systems:
                self.add(self._batchgen(name))

    def _batchgen(self, name: str) -> SystemResult:
        opts = self.opts
        say(opts, f"{name}: loading {opts.model}")
        llm = None
        try:
            self.ensure_prompts()
            res, llm = run_batchgen(opts, self.prompts, name, self.roof_for)
            self.model_info = self.model_info or llm.info.to_dict()
            if opts.contend:
                llm = None
                gc.collect()
                say(opts, f"{name}: again beside {opts.contend} busy loop(s)")
                with contention(opts.contend):
                    busy, llm = run_batchgen(opts, self.prompts, name, self.roof_for)
                _note_contention(res, busy, opts.contend)
        except ConfigError as e:        # a setting this model cannot take (an int8 KV cache off its head_dim)
            res = SystemResult(system=name, label=name, skipped=str(e))
        finally:
            llm = None
            gc.collect()
            release_freed_memory()       # the engine keeps its peak heap (engine/malloc.py); a peer runs next
        if not res.skipped:
            say(opts, f"{name}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
            if res.extra.get("predicted_engine_s"):
                say(opts, f"{name}: {prediction_line(res.extra['predicted_engine_s'], res.wall_s)}")
        return res

    def transformers(self) -> None:
        opts = self.opts
        hf_systems = [s for s in ("hf-generate", "hf-cb") if s in opts.systems]
        if not hf_systems:
            return
        say(opts, f"transformers: loading {opts.model}")
        t = time.monotonic()
        try:
            hf = load_hf_model(opts.model, DTYPES[opts.dtype])
        except (ImportError, ValueError, OSError) as e:   # e.g. GGUF loading needs `accelerate`
            for name in hf_systems:
                self.add(SystemResult(system=name, label=name, skipped=f"cannot load in transformers: {e}"))
            self.env["hf_load_s"] = time.monotonic() - t
            return
        self.env["hf_load_s"] = time.monotonic() - t
        self.ensure_prompts()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if "hf-generate" in hf_systems:
            self._hf_generate(hf, pad_id)
        if "hf-cb" in hf_systems:
            self.add(self._hf_cb(hf, pad_id))
        del hf
        gc.collect()

    def _hf_generate(self, hf, pad_id: int) -> None:
        for bs in self.opts.hf_batch_sizes:
            say(self.opts, f"hf-generate bs={bs}: running")
            res = run_hf_generate(hf, self.prompts, self.opts.workload.output_tokens, bs, pad_id, self.roof)
            say(self.opts, f"hf-generate bs={bs}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
            self.add(res)

    def _hf_cb(self, hf, pad_id: int) -> SystemResult:
        why = hf_continuous_batching_available(hf)
        if why:
            return SystemResult(system="hf-cb", label="hf-cb", skipped=why)
        say(self.opts, "hf-cb: running")
        try:
            res = run_hf_cb(hf, self.prompts, self.opts.workload.output_tokens, pad_id,
                            self.opts.max_num_batched_tokens or EngineConfig.max_num_batched_tokens, self.roof)
            say(self.opts, f"hf-cb: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
        except Exception as e:      # NOTE: a baseline that breaks is reported, not fatal
            res = SystemResult(system="hf-cb", label="hf-cb", skipped=f"failed: {type(e).__name__}: {e}")
        return res

    def llama_cpp(self) -> None:
        if "llama.cpp" not in self.opts.systems:
            return
        self.ensure_prompts()
        say(self.opts, "llama.cpp: running")
        res = run_llama_cpp(self.opts, self.prompts)
        if not res.skipped:
            say(self.opts, f"llama.cpp: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
        self.add(res)

    def peers(self) -> None:
        for name in PEER_SYSTEMS:
            if name in self.opts.systems:
                self.ensure_prompts()
                self.add(self._peer(name))

    def _peer(self, name: str) -> SystemResult:
        opts = self.opts
        res = run_peer(name, opts, self.prompts, warmup_prompts(self.tokenizer), torch.get_num_threads())
        if opts.contend and not res.skipped:      # the peer beside the same busy loops (its own process)
            say(opts, f"{name}: again beside {opts.contend} busy loop(s)")
            with contention(opts.contend):
                busy = run_peer(name, opts, self.prompts, warmup_prompts(self.tokenizer), torch.get_num_threads())
            if not busy.skipped:
                _note_contention(res, busy, opts.contend)
        if not res.skipped:
            say(opts, f"{name}: {res.wall_s:.1f} s (load {res.extra['load_s']:.1f} s), "
                      f"{res.output_tps:.1f} output tok/s")
        return res


def run_bench(opts: BenchOptions, on_progress=None) -> dict:
    """Run every selected system on the workload; return the result dict (what ``--json`` saves).

    ``on_progress(partial_result)`` is called after each system (e.g. to save partial JSON of a long run).
    """
    check_systems(opts)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    run = BenchRun(opts, environment(opts), on_progress)
    run.batchgen_variants()      # in this process first, then transformers, llama.cpp, and the peers
    run.transformers()
    run.llama_cpp()
    run.peers()
    return run.finish()
