"""Measure this device's practical limits once (matmul FLOP/s at the engine dtype, memory bandwidth) and cache them.

The roofline in ``batchgen report`` divides achieved FLOP/s and bytes/s by these numbers (MFU / MBU).
Cached as JSON at ``<cache_dir>/calibration-<device>-<dtype>.json``; ``cache_dir`` defaults to
``$BATCHGEN_CACHE_DIR`` or ``~/.cache/batchgen``. ``<device>`` names the hardware and, on CPU, the thread
count (``cpu-2t``, ``cuda-nvidia-h200``), since both change the numbers.

    cal = load_calibration("cpu", "bfloat16") or calibrate("cpu", "bfloat16")
    cal.matmul_flops, cal.memory_bandwidth        # FLOP/s, bytes/s

The matmul peak is the best of the kernels measured at that dtype (``kernel_flops``, ``peak_kernel``): torch's
matmul for the float dtypes; for int8 both our int8 linear (``q8_linear``: csrc/qlinear/, float32 activations
quantized on the fly, as ``quantization: int8`` runs) and torch's int8 GEMM (``torch._int_mm``: oneDNN on the
CPU), so that ``matmul_flops`` is this machine's int8 peak, not only our kernel's.

The bfloat16 calibration also times our AMX prompt-row kernel (``q8_linear_amx``: bf16 tiles over dequantized int8
weights, float32 activations, as an int8 engine's prompt rows run on AMX) where it runs, recorded in
``kernel_flops`` beside torch's but left out of the peak (``SIDE_KERNELS``): ``costmodel.predict`` prices those rows
at its rate, not at oneDNN's (they differ: docs/perf/xeon-amx.md, 2026-12-06).
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from engine.cache_root import cache_root
from engine.dtype_policy import DTYPES

# (M, K, N): prompt-chunk-shaped matmuls of a small model (gemma-3-270m: hidden 640, MLP 2048).
MATMUL_SHAPES = ((512, 640, 2048), (2048, 640, 2048), (2048, 2048, 640), (2048, 1024, 1024))
QUICK_MATMUL_SHAPES = ((512, 640, 2048),)
SMALL_M_SHAPE = (16, 640, 2048)   # a decode-sized batch: M of 16
MATMUL_KERNEL, Q8_KERNEL, INT_MM_KERNEL = "torch.matmul", "q8_linear", "torch._int_mm"
AMX_PROMPT_KERNEL = "q8_linear_amx"
SIDE_KERNELS = frozenset({AMX_PROMPT_KERNEL})   # timed and recorded, not this dtype's peak: an int8 engine's kernel


@dataclass(frozen=True)
class Calibration:
    device: str                    # cache key, e.g. "cpu-2t", "cuda-nvidia-h200"
    device_name: str               # human-readable
    dtype: str
    matmul_flops: float            # FLOP/s: best shape, best repeat
    memory_bandwidth: float        # bytes/s read from a buffer well beyond cache
    copy_bandwidth: float          # bytes/s (read + write) of a large copy
    small_m_flops: float           # FLOP/s at M=16 (decode-sized batches)
    matmul_by_shape: dict = field(default_factory=dict)   # "MxKxN" -> FLOP/s (the best kernel's)
    # kernel -> {"matmul_flops", "small_m_flops", "by_shape"}: each kernel measured (int8: q8_linear and
    # torch._int_mm); empty when a cached calibration does not record them
    kernel_flops: dict = field(default_factory=dict)
    peak_kernel: str = ""          # the kernel whose rate is matmul_flops ("": not recorded)
    kernel_build: str = ""         # the build of our kernel library whose kernels were timed ("": none of ours)
    num_threads: int = 0
    torch_version: str = ""
    measured_at: float = 0.0       # unix time
    quick: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """From ``to_dict``'s dict; ValueError naming the field when a value has the wrong type (a damaged cache)."""
        if not isinstance(d, dict):
            raise ValueError(f"a calibration is a JSON object, not {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        for name, check in FIELD_CHECKS.items():
            if name in kept and not check(kept[name]):
                raise ValueError(f"calibration field {name}: {kept[name]!r} is not valid")
        return cls(**kept)

    @property
    def ridge_point(self) -> float:
        """FLOP/byte where the roofline turns from bandwidth-bound to compute-bound."""
        return self.matmul_flops / self.memory_bandwidth


def _rate(v, positive: bool = False) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
            and (v > 0 if positive else v >= 0))


def _kernel_rates(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(r, dict) and _rate(r.get("matmul_flops"))
                                       and _rate(r.get("small_m_flops", 0) or 0) for k, r in v.items())


FIELD_CHECKS = {
    **{name: (lambda v: isinstance(v, str)) for name in ("device", "device_name", "dtype", "peak_kernel",
                                                         "torch_version", "kernel_build")},
    "matmul_flops": partial(_rate, positive=True), "memory_bandwidth": partial(_rate, positive=True),
    "copy_bandwidth": _rate, "small_m_flops": _rate, "measured_at": _rate,
    "matmul_by_shape": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _rate(r) for k, r in v.items()),
    "kernel_flops": _kernel_rates,
    "num_threads": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "quick": lambda v: isinstance(v, bool),
}


def default_cache_dir() -> Path:
    return cache_root()


def device_key(device: str | torch.device) -> tuple[str, str]:
    """(cache key, human-readable name) of a device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), name
    threads = torch.get_num_threads()
    return f"{dev.type}-{threads}t", f"{dev.type} ({threads} threads)"


def cache_path(device: str | torch.device, dtype: str, cache_dir: str | Path | None = None) -> Path:
    key, _ = device_key(device)
    return Path(cache_dir or default_cache_dir()) / f"calibration-{key}-{dtype}.json"


def load_calibration(device: str | torch.device, dtype: str,
                     cache_dir: str | Path | None = None) -> Calibration | None:
    """The cached calibration of this device and dtype, or None when there is none (or it is unreadable)."""
    try:
        return Calibration.from_dict(json.loads(cache_path(device, dtype, cache_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save_calibration(cal: Calibration, cache_dir: str | Path | None = None) -> Path:
    path = Path(cache_dir or default_cache_dir()) / f"calibration-{cal.device}-{cal.dtype}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    tmp.replace(path)
    return path


def calibrate(device: str | torch.device = "cpu", dtype: str = "bfloat16", quick: bool = False,
              cache_dir: str | Path | None = None, save: bool = True) -> Calibration:
    """Measure matmul FLOP/s at ``dtype`` and memory bandwidth on ``device``; cache the result.

    ``quick`` measures one matrix shape and a smaller buffer (well under a second on CPU): for tests. Every kernel
    of the dtype (``_kernels``) is measured; per shape, at M=16 and overall the best one counts.
    """
    dev = torch.device(device)
    if dtype not in (*DTYPES, "int8"):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or int8, got {dtype!r}")
    if dtype == "int8" and dev.type != "cpu":
        raise ValueError("int8 (engine.quant.int8) runs on the CPU only")
    reps = 3 if quick else 7
    shapes = QUICK_MATMUL_SHAPES if quick else MATMUL_SHAPES
    kernels = {name: r for name, measure in _kernels(dtype).items()
               if (r := _measure_kernel(dev, measure, shapes, reps)) is not None}
    peaks = {name: k for name, k in kernels.items() if name not in SIDE_KERNELS}
    if not peaks:
        raise RuntimeError(f"no matmul kernel ran at {dtype} on {dev}")
    peak_kernel = max(peaks, key=lambda name: peaks[name]["matmul_flops"])
    by_shape: dict[str, float] = {}
    for k in peaks.values():
        for shape, v in k["by_shape"].items():
            by_shape[shape] = max(v, by_shape.get(shape, 0.0))
    small_m = max((k["small_m_flops"] for k in peaks.values() if k["small_m_flops"] is not None), default=None)
    # NOTE: well beyond the last-level cache, which would read faster than DRAM (docs/perf/code-notes-perf.md).
    buf_bytes = (192 << 20) if quick else ((2 << 30) if dev.type == "cuda" else (1 << 30))
    read_bw, copy_bw = _bandwidth(dev, buf_bytes, reps)
    key, name = device_key(dev)
    cal = Calibration(device=key, device_name=name, dtype=dtype, matmul_flops=kernels[peak_kernel]["matmul_flops"],
                      memory_bandwidth=read_bw, copy_bandwidth=copy_bw, small_m_flops=small_m,
                      matmul_by_shape=by_shape, kernel_flops=kernels, peak_kernel=peak_kernel,
                      num_threads=torch.get_num_threads(), torch_version=torch.__version__, measured_at=time.time(),
                      quick=quick, kernel_build=_kernel_build() if SIDE_KERNELS & kernels.keys() else "")
    if save:
        save_calibration(cal, cache_dir)
    return cal


def _kernels(dtype: str) -> dict:
    """kernel name -> measure(dev, m, k, n, reps) -> FLOP/s (None: the kernel does not take this shape here)."""
    if dtype == "int8":
        return {Q8_KERNEL: _int8_flops, INT_MM_KERNEL: _int_mm_flops}
    kernels = {MATMUL_KERNEL: partial(_matmul_flops, dtype=DTYPES[dtype])}
    if dtype == "bfloat16":
        kernels[AMX_PROMPT_KERNEL] = _amx_prompt_flops
    return kernels


def _measure_kernel(dev: torch.device, measure, shapes, reps: int) -> dict | None:
    """One kernel over the shapes and at M=16: {"matmul_flops", "small_m_flops", "by_shape"}; None when it ran on
    no shape."""
    by_shape = {}
    for m, k, n in shapes:
        if (v := measure(dev, m=m, k=k, n=n, reps=reps)) is not None:
            by_shape[f"{m}x{k}x{n}"] = v
    if not by_shape:
        return None
    m, k, n = SMALL_M_SHAPE
    small_m = measure(dev, m=m, k=k, n=n, reps=reps * 4)
    return {"matmul_flops": max(by_shape.values()), "small_m_flops": small_m, "by_shape": by_shape}


def get_calibration(device: str | torch.device, dtype: str, cache_dir: str | Path | None = None,
                    quick: bool = False) -> Calibration:
    """The cached calibration, measuring (and caching) it first if there is none — or if the cached one is a quick
    one and a full one is asked for: a quick int8 calibration times one small matrix (370 GOP/s on a Zen 4 whose
    full peak is 795), and fractions of it read over 100 % (docs/perf/zen4-epyc.md, 2026-12-04) — or if it timed our
    own kernels (``SIDE_KERNELS``) in another build of the kernel library than the one that runs now."""
    cal = load_calibration(device, dtype, cache_dir)
    if cal is None or (cal.quick and not quick):
        cal = calibrate(device, dtype, quick=quick, cache_dir=cache_dir)
    elif dtype == "bfloat16" and AMX_PROMPT_KERNEL not in cal.kernel_flops and _amx_prompts(torch.device(device)):
        cal = calibrate(device, dtype, quick=cal.quick, cache_dir=cache_dir)   # cached before it was timed
    elif SIDE_KERNELS & cal.kernel_flops.keys() and cal.kernel_build != _kernel_build():
        # our kernels changed since they were timed (a faster kernel priced at its old rate sends the plan over:
        # docs/perf/xeon-amx.md): time them again
        cal = calibrate(device, dtype, quick=cal.quick, cache_dir=cache_dir)
    return cal


# ---- measurements -------------------------------------------------------------------------------------
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(dev: torch.device, fn, reps: int) -> float:
    """Best (minimum) seconds of ``fn`` over ``reps`` runs, after two warm-up runs.

    NOTE: the minimum, not the median: other tenants share this machine's cores (and AMX unit), and a
    calibration is the device's capability, so interference should not lower it.
    """
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def _int8_flops(dev: torch.device, m: int, k: int, n: int, reps: int) -> float:
    import engine.kernels.qlinear as qlinear
    import engine.quant.int8 as int8
    w, sw, ws = int8.pack(*int8.quantize_rows(torch.randn(n, k)))
    x = torch.randn(m, k)
    secs = _timed(dev, lambda: qlinear.q8_linear(x, w, sw, ws, n), reps)
    return 2.0 * m * k * n / secs


def _kernel_build() -> str:
    """Which build of our kernel library runs here (``engine.kernels.library.build_id``)."""
    import engine.kernels.library as library
    return library.build_id()


def _amx_prompts(dev: torch.device) -> bool:
    """True where an int8 engine's prompt rows can run on AMX-BF16 tiles here (``qlinear.prompt_amx_ok``)."""
    if dev.type != "cpu":
        return False
    import engine.kernels.qlinear as qlinear
    return qlinear.prompt_amx_ok()


@torch.inference_mode()
def _amx_prompt_flops(dev: torch.device, m: int, k: int, n: int, reps: int) -> float | None:
    """``q8_linear_amx`` on float32 rows into a kept output (the engine's prompt rows); None where it cannot run."""
    if not _amx_prompts(dev):
        return None
    import engine.kernels.qlinear as qlinear
    import engine.quant.int8 as int8
    w, sw, _ = int8.pack(*int8.quantize_rows(torch.randn(n, k)))
    x, y = torch.randn(m, k), torch.empty(m, n)
    secs = _timed(dev, lambda: qlinear.q8_linear_amx(x, w, sw, n, out=y), reps)
    return 2.0 * m * k * n / secs


@torch.inference_mode()
def _int_mm_flops(dev: torch.device, m: int, k: int, n: int, reps: int) -> float | None:
    """torch's int8 GEMM (int8 x int8 -> int32; oneDNN on the CPU), the weight laid out as a linear's ([N, K],
    transposed); None where this torch has no ``_int_mm`` or it does not take the shape (CUDA: M > 16, K and N
    multiples of 8; the CPU takes any since torch 2.3)."""
    if not hasattr(torch, "_int_mm") or (dev.type == "cuda" and (m <= 16 or k % 8 or n % 8)):
        return None
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)     # [M, K]
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)     # [N, K]
    out = torch.empty(m, n, dtype=torch.int32, device=dev)
    try:
        secs = _timed(dev, lambda: torch._int_mm(a, w.t(), out=out), reps)
    except (RuntimeError, NotImplementedError):
        return None
    return 2.0 * m * k * n / secs


@torch.inference_mode()
def _matmul_flops(dev: torch.device, dtype: torch.dtype, m: int, k: int, n: int, reps: int) -> float:
    a = torch.randn(m, k, device=dev).to(dtype)     # [M, K]
    b = torch.randn(k, n, device=dev).to(dtype)     # [K, N]
    out = torch.empty(m, n, device=dev, dtype=dtype)
    secs = _timed(dev, lambda: torch.matmul(a, b, out=out), reps)
    return 2.0 * m * k * n / secs


@torch.inference_mode()
def _bandwidth(dev: torch.device, nbytes: int, reps: int) -> tuple[float, float]:
    """(read bytes/s of a sum over the buffer, read+write bytes/s of a copy)."""
    x = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    read_s = _timed(dev, lambda: x.sum(), reps)
    copy_s = _timed(dev, lambda: y.copy_(x), reps)
    return nbytes / read_s, 2 * nbytes / copy_s
