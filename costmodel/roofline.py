"""The roofline, in one place: FLOPs and bytes of engine work (``costmodel.flops``) against this device's calibrated
peaks (``costmodel.calibrate``), as MFU (achieved FLOP/s / matmul peak) and MBU (achieved bytes/s / bandwidth).

Used by ``batchgen report`` (per step of a recorded run: ``step_work``, ``stage_roofline``; pipeline/report reads
the trace and hands its columns here), by ``batchgen bench``
(per request of a system's run: ``Roofline``; a batchgen system's on the format its engine ran, ``RunFormat``:
that format's calibrated peak, weight and KV bytes) and, for time rather than utilization, by ``batchgen plan``
(``costmodel.predict`` prices steps with ``matmul_rate`` and the same ``costmodel.flops`` counts).

Per recorded step (each step is one forward pass):

    flops(step) = 2*layer_params*(prefill + decode tokens) + prefill attention + decode attention
                  + LM head on the sampled rows
    bytes(step) = weights once (LM head too if anything is sampled) + K/V each decode query reads
                  (window-limited) + K/V written for every new token + cached-prefix K/V the prefill reads

Decode queries are placed exactly: output token j >= 1 of a request was computed in the step whose time span
holds its token time, attending ``prompt + j`` keys. Prefill attention is exact per request and spread over
prefill steps by their prefill tokens. Steps holding prefill tokens form the prefill stage (MFU: FLOP/s over
calibrated matmul peak); steps with only decode tokens form the decode stage (MBU: bytes/s over calibrated
bandwidth). Warm-up steps (the first of each session) are left out of both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from costmodel import flops as F

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# engine.quant.int8's packed weights: per 32 weights, 32 int8 quants and one fp16 scale (llama.cpp's Q8_0), the bytes a
# step must read; the int16 group sums stored beside them (1.125 in all) are derivable, and a decode step of an
# AVX512-VNNI build does not read them
INT8_WEIGHT_BYTES = 1.0625
# engine.quant.int8_kv's KV rows: per 32 values, 32 int8 quants and one float32 scale
INT8_KV_BYTES = 1.125
KV_BYTES = {**DTYPE_BYTES, "int8": INT8_KV_BYTES}     # kv_cache_dtype -> bytes per cached element


@dataclass(frozen=True)
class RunFormat:
    """The format an engine ran (``EngineInfo``: quantization, dtype, kv_cache_dtype) and what the roofline takes
    from it: the calibration to divide by (int8 weights: the int8 peak; else the activation dtype's), the weights'
    bytes per parameter (int8: 1 byte plus its per-group scales) and the KV cache's bytes per element (its own
    dtype, which may differ from the weights')."""
    quantization: str                  # none | int8
    dtype: str                         # activations (and float weights)
    kv_cache_dtype: str
    bf16_held: bool = False            # float32 weights held as their bf16 values (2 bytes each)
    int8_prompts: str = "int8"         # int8 weights' prompt rows: "bf16" on AMX-BF16 tiles (engine.kernels.families)

    @classmethod
    def of(cls, info) -> "RunFormat":
        """From an ``EngineInfo`` or its dict (``kv_cache_dtype`` from its resolved config; default: dtype)."""
        d = info if isinstance(info, Mapping) else info.to_dict()
        dtype = d.get("dtype") or "bfloat16"
        kv = (d.get("config") or {}).get("kv_cache_dtype")
        kernels = (d.get("config") or {}).get("kernels") or {}
        return cls(d.get("quantization") or "none", dtype, kv if kv and kv != "auto" else dtype,
                   bool(d.get("bf16_held_weights")), kernels.get("int8_prompts") or "int8")

    @property
    def int8(self) -> bool:
        return self.quantization == "int8"

    @property
    def calibration_dtype(self) -> str:
        """The ``costmodel.calibrate`` dtype whose matmul peak this format's matmuls are held against: int8 weights'
        the int8 peak, unless their prompt rows (prefill, the compute-bound part) run bf16 on AMX tiles: bf16's."""
        if self.int8:
            return "bfloat16" if self.int8_prompts == "bf16" else "int8"
        return self.dtype

    @property
    def weight_bytes_per_param(self) -> float:
        if self.int8:
            return INT8_WEIGHT_BYTES
        return 2 if self.bf16_held else DTYPE_BYTES.get(self.dtype, 2)

    @property
    def kv_bytes(self) -> float:
        return KV_BYTES.get(self.kv_cache_dtype, self.weight_bytes_per_param)

    @property
    def label(self) -> str:
        """weights/activations/kv-KV, e.g. ``int8/float32/kv-bfloat16``, ``float32/float32/kv-float32``,
        ``bf16-held/float32/kv-float32``."""
        weights = "int8" if self.int8 else "bf16-held" if self.bf16_held else self.dtype
        return f"{weights}/{self.dtype}/kv-{self.kv_cache_dtype}"


def _peak(cal, key: str) -> float | None:
    if not cal:
        return None
    return cal.get(key) if isinstance(cal, dict) else getattr(cal, key, None)


def mfu(flops: float, secs: float, cal) -> float | None:
    """Achieved FLOP/s over the calibrated matmul peak (``cal``: a Calibration or its dict); None without one."""
    peak = _peak(cal, "matmul_flops")
    return flops / secs / peak if peak and secs > 0 else None


def matmul_rate(rows: int, matmul_flops: float, small_m_flops: float | None = None) -> float:
    """FLOP/s of a matmul with ``rows`` rows: the calibrated large-matmul rate from 512 rows up, the 16-row rate
    (``small_m_flops``) at 16 and below, log-interpolated between (small batches stream the weights per row)."""
    small = small_m_flops or matmul_flops
    if rows >= 512:
        return matmul_flops
    frac = max(0.0, float(np.log(max(rows, 1) / 16) / np.log(512 / 16)))
    return small + (matmul_flops - small) * frac


def mbu(nbytes: float, secs: float, cal) -> float | None:
    """Achieved bytes/s over the calibrated memory bandwidth; None without a calibration."""
    peak = _peak(cal, "memory_bandwidth")
    return nbytes / secs / peak if peak and secs > 0 else None


class Roofline:
    """FLOP / byte counts of this workload's pieces, and the calibrated peaks to divide them by.

    ``dtype_bytes``: the weights' bytes per parameter; ``kv_bytes``: the KV cache's per element (default: the
    weights'). ``Roofline.of_format`` / ``Roofline.for_format`` build one for the format an engine ran."""

    def __init__(self, mcfg, dtype_bytes: float, cal, kv_bytes: float | None = None):
        self.mcfg, self.dtype_bytes, self.cal = mcfg, dtype_bytes, cal
        self.kv_bytes = dtype_bytes if kv_bytes is None else kv_bytes

    @classmethod
    def of_format(cls, mcfg, weight_bytes_per_param: float, kv_bytes: float, cal) -> "Roofline":
        return cls(mcfg, weight_bytes_per_param, cal, kv_bytes)

    @classmethod
    def for_format(cls, mcfg, fmt: RunFormat, cal) -> "Roofline":
        """``cal``: the calibration at ``fmt.calibration_dtype`` (or None: no fractions, counts only)."""
        return cls.of_format(mcfg, fmt.weight_bytes_per_param, fmt.kv_bytes, cal)

    def request_flops(self, prompt_len: int, cached: int, output_tokens: int) -> float:
        f = F.prefill_flops(self.mcfg, prompt_len - cached, cached, num_sampled=1)
        return f + sum(self.decode_flops([prompt_len + k]) for k in range(1, output_tokens))

    def decode_flops(self, ctx_lens: list[int]) -> float:
        return F.decode_step_flops(self.mcfg, ctx_lens)

    def decode_bytes(self, ctx_lens: list[int]) -> float:
        return F.decode_step_bytes(self.mcfg, ctx_lens, self.dtype_bytes, self.kv_bytes)

    def mfu(self, fl: float, secs: float) -> float | None:
        return mfu(fl, secs, self.cal)

    def mbu(self, nbytes: float, secs: float) -> float | None:
        return mbu(nbytes, secs, self.cal)


# ---- a recorded run, as columns ---------------------------------------------------------------------------
# The trace's tables as column dicts (name -> list, one entry per step / per request), as pipeline.run.trace reads
# them; the caller (pipeline/report) picks the config, calibration, dtype and warm-up steps from the run's meta.
Columns = Mapping[str, Sequence]


def column_array(col, dtype=float) -> np.ndarray:
    return np.asarray([np.nan if x is None else x for x in col], dtype=dtype)


def step_work(steps: Columns, requests: Columns, config, dtype_bytes: float,
              kv_dtype_bytes: float | None = None) -> dict[str, np.ndarray]:
    """Per-step FLOPs and bytes (see the module docstring), plus decode contexts summed per step. ``dtype_bytes``
    per weight, ``kv_dtype_bytes`` per cached K/V element (default: ``dtype_bytes``)."""
    s, r = steps, requests
    n = len(s.get("step", []))
    pre, dec = column_array(s["num_prefill_tokens"]), column_array(s["num_decode_tokens"])
    sampled = column_array(s["num_sampled"])
    starts = column_array(s["start"])
    order = np.argsort(starts, kind="stable")
    sorted_starts = starts[order]
    windows = F.window_counts(config)
    kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    kv_tok_layer = F.kv_bytes_per_token_layer(config, kv_bytes)
    attn_per_key = 4 * config.num_attention_heads * config.head_dim

    dec_keys = np.zeros(n)
    pre_attn_total = pre_read_total = 0.0
    for prompt, cached, tts in zip(r["prompt_tokens"], r["cached_tokens"], r["token_times"]):
        pre_attn_total += F.attention_flops(config, prompt - cached, cached)
        pre_read_total += F.kv_read_bytes(config, cached, kv_bytes)
        if tts and len(tts) > 1 and n:
            t = np.asarray(tts[1:], float)
            ctx = prompt + np.arange(1, len(tts), dtype=float)
            idx = order[np.clip(np.searchsorted(sorted_starts, t, side="right") - 1, 0, n - 1)]
            np.add.at(dec_keys, idx, F.keys_read(windows, ctx))
    total_pre = pre.sum()
    pre_share = pre / total_pre if total_pre else np.zeros(n)
    weights = np.where(sampled > 0, F.weight_bytes(config, dtype_bytes),
                       F.weight_bytes(config, dtype_bytes, with_lm_head=False)).astype(float)
    weights[(pre + dec) == 0] = 0.0
    flops = (F.linear_flops(config, 1) * (pre + dec) + pre_attn_total * pre_share + attn_per_key * dec_keys
             + F.lm_head_flops(config, 1) * sampled)
    nbytes = (weights + kv_tok_layer * dec_keys + kv_tok_layer * config.num_hidden_layers * (pre + dec)
              + pre_read_total * pre_share)
    return {"flops": flops, "bytes": nbytes, "decode_keys": dec_keys}


def stage_roofline(steps: Columns, requests: Columns, config, dtype_bytes: float, cal, keep: np.ndarray,
                   kv_dtype_bytes: float | None = None) -> dict:
    """Prefill and decode stages: time, FLOPs, bytes, achieved FLOP/s and bytes/s, intensity, MFU, MBU, over the
    steps ``keep`` selects (steps holding prefill tokens: prefill; decode tokens only: decode). MFU/MBU are None
    without a calibration (``cal``: a Calibration or its dict)."""
    work = step_work(steps, requests, config, dtype_bytes, kv_dtype_bytes)
    dur = column_array(steps["duration_s"])
    pre, dec = column_array(steps["num_prefill_tokens"]), column_array(steps["num_decode_tokens"])
    stages = {"prefill": keep & (pre > 0), "decode": keep & (pre == 0) & (dec > 0)}
    out = {"stages": {}, "calibration": cal or None, "dtype_bytes": dtype_bytes,
           "per_step": {"flops": work["flops"], "bytes": work["bytes"], "duration": dur,
                        "stage": np.where(pre > 0, "prefill", np.where(dec > 0, "decode", "idle")), "keep": keep}}
    for name, m in stages.items():
        t, fl, by = float(dur[m].sum()), float(work["flops"][m].sum()), float(work["bytes"][m].sum())
        st = {"steps": int(m.sum()), "time_s": t, "flops": fl, "bytes": by,
              "tokens": float((pre + dec)[m].sum()), "flops_per_s": fl / t if t else None,
              "bytes_per_s": by / t if t else None, "intensity": fl / by if by else None,
              "mean_decode_seqs": float(column_array(steps["num_decode_seqs"])[m].mean()) if m.any() else None,
              "mean_prefill_tokens": float(pre[m].mean()) if m.any() else None, "mfu": None, "mbu": None}
        st["mfu"], st["mbu"] = mfu(fl, t, cal), mbu(by, t, cal)
        out["stages"][name] = st
    return out
