"""Measure the planner: the same jobs with the prefix-aware plan vs rows in input order vs shuffled, with the
engine's prefix cache on and off. Every run goes to a fresh output directory; numbers are side by side in one
process run, so ratios (not absolute times) are what to read.

    python -m bench.plan_orders jobs/*.yaml [--orders planned,input,shuffled] [--kv-cache-memory BYTES]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

from pipeline.run.runner import RunOptions, run_jobs
from pipeline.run.validate import load_valid_jobs


def _rewrite(job_file: str, out_dir: Path, caching: bool, kv_bytes: int | None) -> Path:
    job = yaml.safe_load(Path(job_file).read_text())
    name = Path(job["output"]["path"]).name
    job["output"]["path"] = str(out_dir / name)
    job.pop("schedule", None)
    engine = dict(job.get("engine") or {})
    engine["enable_prefix_caching"] = caching
    if kv_bytes:
        engine["kv_cache_memory"] = kv_bytes
    job["engine"] = engine
    dst = out_dir / Path(job_file).name
    dst.write_text(yaml.safe_dump(job, sort_keys=False))
    return dst


def run_config(job_files: list[str], order: str, caching: bool, kv_bytes: int | None, root: Path) -> dict:

    out_dir = root / f"{order}-{'cache' if caching else 'nocache'}"
    out_dir.mkdir(parents=True)
    files = [str(_rewrite(f, out_dir, caching, kv_bytes)) for f in job_files]
    t0 = time.monotonic()
    reports = run_jobs(load_valid_jobs(files), options=RunOptions(quiet=True, order=order, record_history=False,
                                                                   state_dir=str(root / "state")))
    wall = time.monotonic() - t0
    prompt = cached = out = rows = 0
    run_wall = 0.0
    for f in files:
        m = json.loads(Path(yaml.safe_load(Path(f).read_text())["output"]["path"] + ".manifest.json").read_text())
        tr = m["this_run"]
        rows += tr.get("computed", 0)
        run_wall = max(run_wall, tr.get("engine_s") or 0.0)
        prompt += tr.get("prompt_tokens", 0)
        cached += tr.get("cached_tokens", 0)
        out += tr.get("output_tokens", 0)
    del reports
    wall = run_wall or wall          # plan + compute + write, model load excluded
    return {"order": order, "prefix_cache": caching, "rows": rows, "wall_s": wall,
            "computed_prompt_tokens": prompt - cached, "hit_rate": cached / prompt if prompt else 0.0,
            "tokens_per_s": (prompt - cached + out) / wall, "all_tokens_per_s": (prompt + out) / wall}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job_files", nargs="+")
    ap.add_argument("--orders", default="planned,input,shuffled")
    ap.add_argument("--no-nocache", action="store_true", help="skip the prefix-cache-off runs")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (a small pool shows eviction)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-plan-") as tmp:
        for caching in ([True] if a.no_nocache else [True, False]):
            for order in a.orders.split(","):
                r = run_config(a.job_files, order, caching, a.kv_cache_memory, Path(tmp))
                results.append(r)
                print(f"[bench-plan] {order:9s} cache={'on ' if caching else 'off'} {r['wall_s']:7.1f} s  "
                      f"hit {r['hit_rate']:6.1%}  {r['all_tokens_per_s']:7.0f} prompt+output tok/s", flush=True)
    base = next((r for r in results if r["order"] == "planned" and r["prefix_cache"]), results[0])
    print(f"\n{'order':10s} {'cache':6s} {'rows':>5s} {'wall s':>8s} {'hit rate':>9s} {'computed tok':>13s} "
          f"{'tok/s (all)':>12s} {'wall vs planned+cache':>22s}")
    for r in results:
        print(f"{r['order']:10s} {'on' if r['prefix_cache'] else 'off':6s} {r['rows']:5d} {r['wall_s']:8.1f} "
              f"{r['hit_rate']:9.1%} {r['computed_prompt_tokens']:13d} {r['all_tokens_per_s']:12.0f} "
              f"{r['wall_s'] / base['wall_s']:22.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
