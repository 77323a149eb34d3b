"""How a peer runner answers its request (``answer``): one timed run, or rounds while it stays loaded (the request's
``held``); standard library only, since the runners import it inside the peer venvs (a script's own directory is
on its ``sys.path``).

A held runner loads and warms up once, writes ``RESULT.ready`` (its load and warm-up seconds), then runs one round
for each ``go`` line on its stdin, writing round k's result to ``RESULT.k``; any other line, or the end of stdin,
stops it. Each file appears whole (written aside, then renamed), so the bench may poll for it. Between rounds the
bench times the other systems, so every system's rounds run in the same minutes of the machine.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable


def write_whole(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def serve_rounds(result_path: str, ready: dict, run_round: Callable[[], dict]) -> int:
    """Answer ``go`` lines with rounds until told to stop; returns how many rounds ran."""
    write_whole(result_path + ".ready", ready)
    k = 0
    for line in sys.stdin:
        if line.strip() != "go":
            break
        write_whole(f"{result_path}.{k}", run_round())
        k += 1
    return k


def answer(req: dict, result_path: str, ready: dict, fresh_round: Callable[[], dict]) -> None:
    """``fresh_round()`` times the workload from an empty prefix cache and returns the result. Held: rounds on the
    bench's signal. Otherwise one timed run into ``result_path``, after an untimed one with ``warm_workload`` (a
    peer's first run at the workload's shapes can take twice its later ones)."""
    if req.get("held"):
        serve_rounds(result_path, ready, fresh_round)
        return
    warm_s = None
    if req.get("warm_workload"):
        t = time.monotonic()
        fresh_round()
        warm_s = time.monotonic() - t
    write_whole(result_path, {**fresh_round(), "warm_workload_s": warm_s})
