"""One system's numbers in a bench run."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from costmodel.stats import percentiles


@dataclass
class SystemResult:
    system: str                       # batchgen | batchgen-nocache | hf-generate | hf-cb
    label: str                        # e.g. "hf-generate bs=8"
    wall_s: float | None = None
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from a prefix cache (batchgen, and peers that report it)
    output_tokens: int = 0
    ttft_s: list[float] | None = None
    tpot_s: list[float] | None = None
    flops: float | None = None        # model FLOPs this system computed (costmodel.flops)
    mfu: float | None = None          # flops / wall / calibrated peak
    prefill_mfu: float | None = None  # over the time spent in steps (batches) with prompt work
    decode_mbu: float | None = None   # decode-only steps: bytes moved / time / calibrated bandwidth
    # how close to the limit (batchgen systems, on the roofline of the format that ran; docs/guide/reports.md):
    prefill_peak_fraction: float | None = None    # prefill steps' FLOP/s / the format's matmul peak
    decode_bound_fraction: float | None = None    # decode-only steps' bytes/s / the read bandwidth
    decode1_bound_fraction: float | None = None   # the same over 1-row decode-only steps
    limits: dict | None = None        # their format, peaks and achieved rates (bench.systems.batchgen.step_limits)
    match_rate: float | None = None   # fraction of requests whose output ids equal batchgen-nocache's
    skipped: str | None = None
    extra: dict = field(default_factory=dict)
    outputs: list[list[int]] | None = field(default=None, repr=False)   # per planned prompt; not saved

    @property
    def output_tps(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s else None

    @property
    def total_tps(self) -> float | None:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else None

    @property
    def hit_rate(self) -> float | None:
        known = self.system.startswith("batchgen") or self.extra.get("cached_tokens_reported")
        if not self.prompt_tokens or not known:
            return None
        return self.cached_tokens / self.prompt_tokens

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("outputs")
        for name in ("ttft_s", "tpot_s"):
            vals = d.pop(name)
            d[name.replace("_s", "")] = percentiles(vals) if vals else None
        d.update(output_tokens_per_s=self.output_tps, total_tokens_per_s=self.total_tps, hit_rate=self.hit_rate)
        return d
