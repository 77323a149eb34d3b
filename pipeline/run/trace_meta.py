"""A run directory's run.json read back field by field: a damaged or hand-edited field is dropped with a warning
naming the file and the field, never read as a value of the wrong type (``batchgen report`` and a resumed run's
trace both read it)."""
from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger("batchgen.pipeline")

SESSION_NUMBERS = ("load_s", "setup_s", "warmup_s", "steady_s", "wall_s", "num_requests", "num_steps")
_DICTS = ("model_info", "prediction", "phases", "distributed")


def checked_meta(raw, path: Path) -> dict:
    """``raw`` (run.json as parsed JSON, or None) with every unusable field dropped and warned about."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        _warn(path, "the file", f"is a JSON {type(raw).__name__}, not an object")
        return {}
    meta = dict(raw)
    for name in _DICTS:
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            _drop(meta, path, name, "is not an object")
    if isinstance(meta.get("model_info"), dict):
        info = meta["model_info"]
        bad = [k for k in ("dtype", "device", "path") if info.get(k) is not None and not isinstance(info[k], str)]
        if bad:
            meta["model_info"] = {k: v for k, v in info.items() if k not in bad}
            _warn(path, f"model_info.{bad[0]}", "is not a string")
    if meta.get("sessions") is not None:
        meta["sessions"] = _sessions(meta["sessions"], path)
    if meta.get("model_config") is not None and not _model_config_ok(meta["model_config"]):
        _drop(meta, path, "model_config", "is not a model config")
    if meta.get("calibration") is not None and not _calibration_ok(meta["calibration"]):
        _drop(meta, path, "calibration", "is not a calibration")
    prediction = meta.get("prediction")
    if isinstance(prediction, dict):
        if prediction.get("engine_s") is not None and not _number(prediction["engine_s"]):
            _drop(meta, path, "prediction", "has an engine_s that is not a number")
        elif prediction.get("measured_steps") is not None and not isinstance(prediction["measured_steps"], dict):
            _drop(meta, path, "prediction", "has measured_steps that are not an object")
    return meta


def _sessions(sessions, path: Path) -> list[dict]:
    if not isinstance(sessions, list):
        _warn(path, "sessions", "is not a list; ignored")
        return []
    good = [s for s in sessions if isinstance(s, dict) and all(_number(s.get(k)) for k in SESSION_NUMBERS)
            and (s.get("warmup_steps") is None or isinstance(s["warmup_steps"], int))
            and not isinstance(s.get("warmup_steps"), bool)]
    if len(good) != len(sessions):
        _warn(path, "sessions", f"{len(sessions) - len(good)} of {len(sessions)} are not sessions; ignored")
    return good


def _model_config_ok(d) -> bool:
    from costmodel.flops import from_dict

    if not isinstance(d, dict):
        return False
    try:
        from_dict(d)
    except (TypeError, ValueError):
        return False
    return True


def _calibration_ok(d) -> bool:
    """The two numbers the roofline divides by, and every other field of a Calibration it holds of its type."""
    from costmodel.calibrate import FIELD_CHECKS

    return (isinstance(d, dict) and all(_number(d.get(k)) and d[k] > 0 for k in ("matmul_flops", "memory_bandwidth"))
            and all(check(d[k]) for k, check in FIELD_CHECKS.items() if k in d))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _drop(meta: dict, path: Path, name: str, why: str) -> None:
    del meta[name]
    _warn(path, name, f"{why}; ignored")


def _warn(path: Path, field: str, why: str) -> None:
    log.warning("run trace %s: %s %s", path, field, why)
