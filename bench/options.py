"""One bench run's settings (``BenchOptions``), built from the command line's values by ``options_from``."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.systems.registry import BENCH_SYSTEMS
from bench.workloads import DEFAULT_HF_BATCH_SIZES, QUICK_HF_BATCH_SIZES, Workload, make_workload
from engine.config import DEFAULT_MODEL
from engine.dtype_policy import choose_dtype

# Models at real sizes without their weights: bench/models/<name>/config.json, run with load_format dummy
# (engine/loader/dummy.py); `--model NAME` takes a name from here.
BENCH_MODELS = Path(__file__).resolve().parent / "models"


def bench_models() -> tuple[str, ...]:
    return tuple(sorted(p.parent.name for p in BENCH_MODELS.glob("*/config.json")))


def bench_model(model: str) -> tuple[str, str]:
    """(what the engine loads, load_format): a name of ``bench_models()``, or a directory with a config.json and no
    weights, is that config with made-up weights; anything else (an alias, an HF directory, a .gguf file) loads as
    it is."""
    if model in bench_models():
        return str(BENCH_MODELS / model), "dummy"
    p = Path(model)
    if (p / "config.json").is_file() and not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        return model, "dummy"
    return model, "auto"


@dataclass(frozen=True)
class BenchOptions:
    workload: Workload
    model: str = DEFAULT_MODEL
    load_format: str = "auto"         # dummy: a bench/models config with made-up weights (bench_model)
    dtype: str = "bfloat16"
    threads: int | None = None
    systems: tuple[str, ...] = BENCH_SYSTEMS
    hf_batch_sizes: tuple[int, ...] = DEFAULT_HF_BATCH_SIZES
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    roofline: bool = True             # load (or measure) a calibration for MFU/MBU
    breakdown: bool = False           # time batchgen's kernel families per step kind (bench.breakdown)
    contend: int = 0                  # also run each batchgen system and peer beside this many busy loops
    quick: bool = False
    seed: int = 0
    log: bool = True                  # progress lines on stderr

    def engine_args(self) -> dict:
        args = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "kv_cache_memory": self.kv_cache_memory, "num_threads": self.threads,
                "load_format": self.load_format if self.load_format != "auto" else None}
        return {k: v for k, v in args.items() if v is not None}


def say(opts: BenchOptions, msg: str) -> None:
    if opts.log:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def options_from(shape: str, quick: bool, n=None, groups=None, prefix_tokens=None, doc_tokens=None,
                 output_tokens=None, hf_batch_sizes=None, **kw) -> BenchOptions:
    """BenchOptions from command-line values (None = the shape's / preset's default); shared with the CLI."""
    w = make_workload(shape, quick, n=n, groups=groups, prefix_tokens=prefix_tokens, doc_tokens=doc_tokens,
                      output_tokens=output_tokens)
    if hf_batch_sizes is None:
        hf_batch_sizes = QUICK_HF_BATCH_SIZES if quick else DEFAULT_HF_BATCH_SIZES
    if "model" in kw and "load_format" not in kw:
        kw["model"], kw["load_format"] = bench_model(kw["model"])
    if kw.get("dtype", "auto") == "auto":      # what the engine would choose on this CPU, for every system
        kw["dtype"] = choose_dtype("auto", "cpu").dtype
    return BenchOptions(workload=w, quick=quick, hf_batch_sizes=tuple(hf_batch_sizes), **kw)
