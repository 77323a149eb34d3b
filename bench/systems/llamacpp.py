"""The llama.cpp peer: llama-cpp-python in batchgen's venv (``pip install -e '.[peer]'``), when installed.

A GGUF model runs as it is. A ``load_format: dummy`` model runs on the same made-up weights written as GGUF
(``bench.dummy_gguf``, once, under the peers dir: ``models/<name>-dummy-<type>.gguf``) in each of
``DUMMY_TYPES``: each is probed on the workload's first prompts and the fastest runs the workload, chosen and kept
as the venv peers' dtypes are (``bench.systems.peer.choose_fastest``), per workload shape (Q8_0 decodes faster,
F16 prefills faster); the row says which ran.

llama.cpp runs inside the bench's process, so before a GGUF is timed a child process decodes two tokens with it
(``decode_problem``): a build that crashes there (ggml's AMX-INT8 Q8_0 path segfaulted at the first decode on an AMX
Xeon, docs/perf/xeon-amx.md) makes that type a failed probe, or the peer a skipped row, instead of ending the bench.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.options import BenchOptions, say
from bench.result import SystemResult
from bench.workloads import BenchPrompt
from engine.loader import resolve_model

# Q8_0 and llama.cpp's fastest float type here: F16 (its matmuls take F16 weights natively with F16C, and decode
# reads half of F32's bytes; BF16 has no native path without AVX512-BF16). The dummy values are bf16, so F16
# holds them exactly.
DUMMY_TYPES = ("q8_0", "f16")
NOTE = "llama-cpp-python, n_batch=512, flash_attn, swa_full, group order"


# the child's decode: the GGUF at argv[1] with argv[2] threads, two greedy tokens after four ids every vocab holds
_CHECK_CODE = ("import sys, llama_cpp\n"
               "llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=32, n_threads=int(sys.argv[2]), "
               "n_threads_batch=int(sys.argv[2]), flash_attn=True, swa_full=True, verbose=False)\n"
               "g = llm.generate([1, 2, 3, 4], top_k=1, temp=0.0)\n"
               "next(g), next(g)\n")


class _Stopped(Exception):
    pass


def decode_problem(path: Path, threads: int, timeout: float = 600.0) -> str | None:
    """Why llama.cpp cannot decode the GGUF at ``path`` here, found in a child process (a signal there is a failed
    peer, not the end of the bench), or None."""
    try:
        r = subprocess.run([sys.executable, "-c", _CHECK_CODE, str(path), str(threads)], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a two-token decode did not finish in {timeout:.0f} s"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = f"signal {-r.returncode}"
        return f"crashed ({name}) in a two-token decode of {path.name}"
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit status {r.returncode}"
    return f"failed a two-token decode of {path.name}: {last}"


def _skipped(why: str) -> SystemResult:
    return SystemResult(system="llama.cpp", label="llama.cpp", skipped=why)


def dummy_gguf_path(model: str, type_: str) -> Path:
    from bench.systems.peer import peers_dir
    return peers_dir() / "models" / f"{Path(model).name}-dummy-{type_}.gguf"


def _load(path: Path, prompts: list[BenchPrompt], output_tokens: int, threads: int):
    from llama_cpp import Llama

    n_ctx = max(len(p.token_ids) for p in prompts) + output_tokens + 16
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 flash_attn=True, swa_full=True, verbose=False)


def _generate(llm, prompts: list[BenchPrompt], T: int, deadline: float | None = None) -> dict:
    """Exactly ``T`` greedy tokens per prompt, in group order (one Llama keeps the KV of the longest common prefix
    with the previous prompt); raises _Stopped past ``deadline`` (monotonic)."""
    outputs: dict[int, list[int]] = {}
    ttft, tpot = [], []
    t0 = time.monotonic()
    for p in sorted(prompts, key=lambda p: (p.group, p.index)):
        out, start, first = [], time.monotonic(), None
        # greedy (top_k=1), no penalties; reset=True keeps the longest common prefix of the previous prompt
        for tok in llm.generate(list(p.token_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            first = first or time.monotonic()
            out.append(int(tok))
            if deadline is not None and time.monotonic() > deadline:
                raise _Stopped
            if len(out) >= T:
                break
        ttft.append(first - start)
        if len(out) > 1:
            tpot.append((time.monotonic() - first) / (len(out) - 1))
        outputs[p.index] = out
    return {"outputs": [outputs[p.index] for p in prompts], "wall": time.monotonic() - t0, "ttft": ttft,
            "tpot": tpot}


def _warm_up(llm, prompts: list[BenchPrompt]) -> None:
    _generate(llm, [BenchPrompt(-1, -1, tuple(prompts[0].token_ids[:16]))], 2)


def _choose_type(opts: BenchOptions, prompts: list[BenchPrompt], threads: int) -> tuple[str | None, dict]:
    """The fastest of DUMMY_TYPES for this dummy model on this CPU, each file written first (once)."""
    from bench.dummy_gguf import write_gguf
    from bench.systems import peer

    key = peer.choice_key("llama.cpp", f"{Path(opts.model).name}-dummy", opts, per_shape=True)
    T = peer.probe_tokens(opts, per_shape=True)
    unwritten: dict[str, str] = {}
    if peer.kept_choice(key, DUMMY_TYPES) is None:         # all are probed: write them before any probe is timed
        for t in DUMMY_TYPES:
            say(opts, f"llama.cpp: the dummy weights as {dummy_gguf_path(opts.model, t)} (written once)")
            try:
                write_gguf(opts.model, dummy_gguf_path(opts.model, t), t)
            except OSError as e:                           # a full disk: this type fails, the bench goes on
                unwritten[t] = f"could not write its GGUF: {e}"
    short = [BenchPrompt(p.index, p.group, tuple(p.token_ids[:peer.PROBE_PROMPT_TOKENS]))
             for p in prompts[:peer.PROBE_PROMPTS]]

    def probe(type_: str, limit: float | None) -> tuple[float | None, str]:
        if type_ in unwritten:
            return None, unwritten[type_]
        why = decode_problem(dummy_gguf_path(opts.model, type_), threads)
        if why:
            return None, why
        start = time.monotonic()
        try:
            llm = _load(dummy_gguf_path(opts.model, type_), short, T, threads)
        except (ValueError, RuntimeError) as e:
            return None, f"failed to load: {e}"
        try:
            _warm_up(llm, short)
            return _generate(llm, short, T, start + limit if limit else None)["wall"], ""
        except _Stopped:
            return None, f"stopped after {limit:.1f} s"
        finally:
            llm.close()

    return peer.choose_fastest(key, DUMMY_TYPES, probe, opts, opts.model)


def run_llama_cpp(opts: BenchOptions, prompts: list[BenchPrompt]) -> SystemResult:
    """llama.cpp through llama-cpp-python: its best configuration measured on this workload (module docstring)."""
    try:   # NOTE: an optional dependency (the peer extra): without it the system is reported skipped
        import llama_cpp
    except ImportError:
        return _skipped("llama-cpp-python not installed (pip install -e '.[peer]')")
    # which build runs (its instruction sets): a peer built for another CPU kind is not the same peer
    say(opts, f"llama.cpp {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}")
    threads = opts.threads or torch.get_num_threads()
    type_, probes = None, {}
    if opts.load_format == "dummy":
        type_, probes = _choose_type(opts, prompts, threads)
        if type_ is None:
            return _skipped("every type failed: " + "; ".join(f"{t}: {w}" for t, w in probes.items()))
        from bench.dummy_gguf import write_gguf
        try:
            path = write_gguf(opts.model, dummy_gguf_path(opts.model, type_), type_)
        except OSError as e:
            return _skipped(f"could not write its {type_} GGUF: {e}")
    else:
        src = resolve_model(opts.model)
        if src.kind != "gguf":
            return _skipped("the model is not a GGUF file")
        path = Path(src.path)
    # a type probed in this run has decoded in a child already; a kept choice or a GGUF source has not, on this build
    probed_now = "kept" not in probes and isinstance(probes.get(type_), float)
    why = None if probed_now else decode_problem(path, threads)
    if why:
        return _skipped(f"llama.cpp {why}")
    t = time.monotonic()
    llm = _load(path, prompts, opts.workload.output_tokens, threads)
    load_s = time.monotonic() - t
    try:
        t = time.monotonic()
        _warm_up(llm, prompts)
        warmup_s = time.monotonic() - t
        run = _generate(llm, prompts, opts.workload.output_tokens)
    finally:
        llm.close()
    outs = run["outputs"]
    res = SystemResult(system="llama.cpp", label="llama.cpp" + (f" {type_}" if type_ else ""), wall_s=run["wall"],
                       num_requests=len(outs), prompt_tokens=sum(len(p.token_ids) for p in prompts),
                       cached_tokens=0, output_tokens=sum(len(o) for o in outs), ttft_s=run["ttft"],
                       tpot_s=run["tpot"], outputs=outs,
                       extra={"note": NOTE, "load_s": round(load_s, 2), "warmup_s": round(warmup_s, 2),
                              "version": llama_cpp.__version__})
    if type_:
        res.extra.update(dtype=type_, dtype_probes=probes, model_file=str(path))
    return res
