"""One summary of a latency (or any) distribution, shared by the report and the bench."""
from __future__ import annotations

import math

import numpy as np


def percentiles(values) -> dict[str, float | None]:
    """n, mean, p50, p90, p99 and max (linear interpolation, numpy's default) of the values that are not None
    or NaN; every number None when there are none."""
    v = np.asarray([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))], float)
    if v.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"n": int(v.size), "mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(v.max())}


def percentile(values, q: float) -> float | None:
    """One percentile of the values that are not None; None when there are none."""
    v = [x for x in values if x is not None]
    return float(np.percentile(np.asarray(v, float), q)) if v else None
