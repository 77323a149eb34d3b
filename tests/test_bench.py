"""bench (`batchgen bench`): the quick preset on a tiny random Llama runs every system and gives a
well-formed table and JSON with consistent token counts. No timing assertions: speeds here are noise."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.options import BenchOptions, options_from
from bench.result import SystemResult
from bench.run import run_bench
from bench.systems.registry import PEER_SYSTEMS, SYSTEMS
from bench.table import format_table, ratios, save_json
from bench.workloads import build_prompts, make_workload
from costmodel.stats import percentile
from tests.model_utils import save_tiny, tiny_hf_model, tiny_tokenizer

IN_PROCESS = tuple(s for s in SYSTEMS if s not in PEER_SYSTEMS)     # the peers' venvs: tests/test_bench_peers.py


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny")
    save_tiny(tiny_hf_model("llama"), path)
    return str(path)


@pytest.fixture(scope="module")
def quick_result(tiny_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("BATCHGEN_CACHE_DIR", str(tmp_path_factory.mktemp("bench_cache")))   # quick calibration, not ~
    try:
        opts = options_from("shared-prefix", quick=True, model=tiny_dir, dtype="float32", log=False,
                            systems=IN_PROCESS)
        partials = []
        result = run_bench(opts, partials.append)
    finally:
        mp.undo()
    return opts, result, partials


def test_prompts_are_deterministic_grouped_and_exact_length():
    tok = tiny_tokenizer()
    w = make_workload("shared-prefix", quick=True, n=7, groups=3, prefix_tokens=40, doc_tokens=12)
    prompts = build_prompts(tok, w)
    assert prompts == build_prompts(tok, w)
    assert [p.group for p in prompts] == sorted(p.group for p in prompts)          # planned order
    assert sorted(p.index for p in prompts) == list(range(7))
    assert all(len(p.token_ids) == w.prompt_tokens == 52 for p in prompts)
    assert all(p.token_ids[0] == tok.bos_token_id for p in prompts)
    heads = {p.group: p.token_ids[:40] for p in prompts}
    assert all(p.token_ids[:40] == heads[p.group] for p in prompts)                 # shared within a group
    assert len(set(heads.values())) == 3                                             # distinct across groups
    assert len({p.token_ids[40:] for p in prompts}) == 7                            # every document differs


def test_no_prefix_shape_has_only_bos_in_common():
    tok = tiny_tokenizer()
    w = make_workload("long-prompt", quick=True)
    prompts = build_prompts(tok, w)
    assert w.prefix_tokens == 0 and all(len(p.token_ids) == w.doc_tokens + 1 for p in prompts)
    assert len({p.token_ids for p in prompts}) == w.n


def test_quick_runs_every_system_with_consistent_counts(quick_result):
    opts, result, _ = quick_result
    w = opts.workload
    systems = {s["label"]: s for s in result["systems"]}
    assert set(s["system"] for s in result["systems"]) == set(IN_PROCESS)
    ran = [s for s in result["systems"] if not s["skipped"]]
    assert {"batchgen", "batchgen-nocache", "hf-generate bs=4"} <= {s["label"] for s in ran}
    for s in ran:
        assert s["num_requests"] == w.n
        assert s["output_tokens"] == w.n * w.output_tokens, s["label"]
        assert s["prompt_tokens"] == w.n * w.prompt_tokens, s["label"]
        assert s["wall_s"] > 0 and s["output_tokens_per_s"] > 0
        assert s["total_tokens_per_s"] > s["output_tokens_per_s"]
        assert s["ttft"]["p50"] <= s["ttft"]["p90"] and s["tpot"]["p50"] <= s["tpot"]["p90"]
        assert s["mfu"] is not None and s["mfu"] > 0
        assert s["match_rate"] is not None
    on, off = systems["batchgen"], systems["batchgen-nocache"]
    assert 0 < on["cached_tokens"] <= on["prompt_tokens"] - w.n                     # last token always computed
    assert on["hit_rate"] == pytest.approx(on["cached_tokens"] / on["prompt_tokens"])
    assert off["cached_tokens"] == 0 and off["hit_rate"] == 0
    assert on["flops"] < off["flops"]                                                # the cache saved compute
    assert on["match_rate"] == 1.0 and off["match_rate"] == 1.0                      # float32 greedy: same tokens
    assert on["extra"]["preemptions"] == 0 and on["extra"]["steps"] >= w.output_tokens
    # how close to the limit: on the roofline of the format each ran (float32 here; int8 weights: the int8 peak)
    assert on["limits"]["format"] == "float32/float32/kv-float32" and on["limits"]["calibration_dtype"] == "float32"
    assert on["prefill_peak_fraction"] == on["prefill_mfu"] > 0 and on["decode_bound_fraction"] == on["decode_mbu"]
    q8 = systems["batchgen-int8"]
    if not q8["skipped"]:
        assert q8["limits"]["format"].startswith("int8/") and q8["limits"]["calibration_dtype"] == "int8"
        assert "int8" in result["env"]["calibrations"]
    assert systems["hf-generate bs=4"]["limits"] is None


def test_ratios_table_and_json(quick_result, tmp_path):
    _, result, partials = quick_result
    r = result["ratios"]
    assert r["best_transformers"].startswith("hf-")
    for key in ("batchgen_vs_best_transformers", "batchgen_nocache_vs_best_transformers",
                "batchgen_vs_batchgen_nocache"):
        assert r[key] > 0
    table = format_table(result)
    for s in result["systems"]:
        assert s["label"] in table
    assert "vs best transformers" in table and "TTFT50 s" in table
    assert "how close to the limit" in table and "batchgen (float32/float32/kv-float32): prefill " in table
    assert "hf-generate bs=4: n/a (no step stats)" in table
    path = save_json(result, tmp_path / "b.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert len(partials) == len(result["systems"])                                  # saved after each system
    assert [s["label"] for s in partials[-1]["systems"]] == [s["label"] for s in result["systems"]]


def test_ratios_skip_missing_and_skipped_systems():
    on = SystemResult("batchgen", "batchgen", wall_s=2.0)
    hf4 = SystemResult("hf-generate", "hf-generate bs=4", wall_s=10.0)
    hf8 = SystemResult("hf-generate", "hf-generate bs=8", wall_s=8.0)
    cb = SystemResult("hf-cb", "hf-cb", skipped="not here")
    r = ratios([on, hf4, hf8, cb])
    assert r["best_transformers"] == "hf-generate bs=8" and r["batchgen_vs_best_transformers"] == 4.0
    assert "batchgen_nocache_vs_best_transformers" not in r
    assert percentile([3, 1, 2], 50) == 2 and percentile([1, 2], 90) == pytest.approx(1.9)
    assert percentile([], 50) is None


def test_unknown_shape_and_system_are_errors():
    with pytest.raises(ValueError, match="unknown workload shape"):
        make_workload("nope")
    with pytest.raises(ValueError, match="unknown system"):
        run_bench(BenchOptions(workload=make_workload("shared-prefix", quick=True), systems=("nope",), log=False))


def test_cli_bench(tiny_dir, tmp_path):
    from batchgen.cli import main
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--quick", "--model", tiny_dir, "--dtype", "float32",
                                    "--systems", "batchgen,hf-generate", "--no-roofline", "--n", "4",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "batchgen (prefix cache on) vs best transformers" in res.output
    data = json.loads(out.read_text())
    assert [s["label"] for s in data["systems"]] == ["batchgen", "hf-generate bs=4"]
    assert data["workload"]["n"] == 4 and all(s["output_tokens"] == 4 * 6 for s in data["systems"])
    assert data["systems"][0]["mfu"] is None                                         # --no-roofline
    bad = CliRunner().invoke(main, ["bench", "--quick", "--systems", "nope"])
    assert bad.exit_code == 2 and "unknown nope" in bad.output


def test_default_system_ratios_and_line():
    """batchgen-default (a job's defaults) is compared with the float path and llama.cpp, and the table says what
    quantization auto resolved to."""
    on = SystemResult("batchgen", "batchgen", wall_s=30.0)
    dflt = SystemResult("batchgen-default", "batchgen-default", wall_s=20.0, extra={"quantization": "int8"})
    peer = SystemResult("llama.cpp", "llama.cpp", wall_s=120.0)
    r = ratios([on, dflt, peer])
    assert r["batchgen_default_vs_batchgen"] == 1.5 and r["batchgen_default_vs_llama_cpp"] == 6.0
    result = {"workload": {"shape": "x", "n": 1, "groups": 1, "prefix_tokens": 1, "doc_tokens": 1,
                           "output_tokens": 1},
              "env": {"model": "m", "dtype": "bfloat16", "threads": 2}, "ratios": r,
              "systems": [s.to_dict() for s in (on, dflt, peer)]}
    table = format_table(result)
    assert "batchgen defaults (quantization int8) vs batchgen bfloat16: 1.50x wall" in table
    assert "batchgen defaults vs llama.cpp: 6.00x" in table


def test_structured_systems_same_output_tokens_and_ratio_line(quick_result):
    """batchgen-structured / batchgen-default-structured: the same workload with every request constrained to
    STRUCTURED_SCHEMA, the same output tokens (the schema's JSON stays open), compared with their twins."""
    opts, result, _ = quick_result
    by = {s["system"]: s for s in result["systems"]}
    for st in ("batchgen-structured", "batchgen-default-structured"):
        assert by[st]["output_tokens"] == opts.workload.n * opts.workload.output_tokens
        assert set(by[st]["extra"]["structured"]) >= {"forced_tokens", "forced_share", "masks_applied", "mask_time_s"}
    assert result["ratios"]["batchgen_structured_vs_batchgen"] > 0
    assert "batchgen-structured (JSON schema) vs batchgen (same output tokens)" in format_table(result)


def test_structured_ratio_and_line_from_numbers():
    on = SystemResult("batchgen-default", "batchgen-default", wall_s=10.0, extra={"decode_tokens_per_s": 100.0})
    st = SystemResult("batchgen-default-structured", "batchgen-default-structured", wall_s=12.5,
                      extra={"decode_tokens_per_s": 90.0, "structured": {"forced_tokens": 96, "forced_share": 0.25,
                                                                          "masks_applied": 7, "mask_time_s": 0.01}})
    r = ratios([on, st])
    assert r["batchgen_default_structured_vs_batchgen_default"] == 0.8
    assert r["batchgen_default_structured_decode_tokens_per_s_ratio"] == 0.9
    result = {"workload": {"shape": "x", "n": 1, "groups": 1, "prefix_tokens": 1, "doc_tokens": 1,
                           "output_tokens": 1},
              "env": {"model": "m", "dtype": "bfloat16", "threads": 2}, "ratios": r,
              "systems": [s.to_dict() for s in (on, st)]}
    line = ("batchgen-default-structured (JSON schema) vs batchgen-default (same output tokens): 0.80x throughput, "
            "0.90x decode tokens/s; 96 forced tokens (25% of the output), 7 masks, 0.010 s masking")
    assert line in format_table(result)


def test_cli_structured_flag_needs_a_twin():
    from batchgen.cli import main
    bad = CliRunner().invoke(main, ["bench", "--quick", "--structured", "--systems", "hf-generate"])
    assert bad.exit_code == 2 and "--structured needs batchgen or batchgen-default" in bad.output
