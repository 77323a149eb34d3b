"""The peers in their own venvs (vLLM, OpenVINO; bench/systems/peer.py), without either installed: a fake peer
python stands in for each venv's and answers the request with deterministic tokens, so the request/result
protocol, the environment, the failure row, the missing-venv error and the registry are held. No timing
assertions."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.options import options_from
from bench.result import SystemResult
from bench.run import run_bench
from bench.systems import peer
from bench.systems.registry import BENCH_EXTRA_SYSTEMS, BENCH_SYSTEMS, PEER_SYSTEMS, SYSTEMS
from bench.table import agreement, format_table, ratios
from bench.workloads import build_prompts
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent

# The stand-in for a peer venv's python: called as `python RUNNER REQUEST RESULT`, it keeps what it got and
# answers as a runner would (output token k of prompt i: (last prompt token + i + k) % 97).
FAKE = '''#!{python}
import json, os, sys
runner, req_path, res_path = sys.argv[1:4]
name = os.path.basename(runner).removesuffix("_runner.py")
here = os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0])))
req = json.load(open(req_path))
keep = {{k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                      "PYTHONPATH")}}
json.dump({{"runner": runner, "request": req, "env": keep}}, open(os.path.join(here, "seen.json"), "w"))
with open(os.path.join(here, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"dtype": req.get("dtype"), "probe": req.get("probe"), "n": len(req["prompts"]),
                        "model": os.path.basename(req["model"]), "max_tokens": req["max_tokens"]}}) + "\\n")
if os.environ.get("FAKE_PEER_FAIL"):
    print("RuntimeError: no kernel for this CPU", file=sys.stderr)
    sys.exit(3)
probe_s = json.loads(os.environ.get("FAKE_PEER_PROBE", "{{}}")).get(req.get("dtype"), 1.0)
if req.get("probe") and probe_s == "hang":
    import time
    time.sleep(600)
if req.get("probe") and probe_s == "fail":
    print(f"RuntimeError: {{req['dtype']}} is not supported here", file=sys.stderr)
    sys.exit(4)
n = req["max_tokens"]
outs = [[(p[-1] + i + k) % 97 for k in range(n)] for i, p in enumerate(req["prompts"])]
cached = [0 if i == 0 or req["groups"][i] != req["groups"][i - 1] else len(p) // 2
          for i, p in enumerate(req["prompts"])] if name == "vllm" else None
result = {{"peer": name, "version": "0.0-fake", "load_s": 1.5, "warmup_s": 0.25, "generate_s": 2.0,
          "probe_s": probe_s if req.get("probe") else None, "dtype": req.get("dtype"), "platform": "FakePlatform",
          "outputs": outs, "prompt_tokens": [len(p) for p in req["prompts"]], "cached_tokens": cached}}
if req.get("held"):       # the real protocol (bench/peers/held.py); round k takes FAKE_PEER_ROUNDS[k] seconds
    sys.path.insert(0, os.path.dirname(runner))
    from held import serve_rounds
    times, done = json.loads(os.environ.get("FAKE_PEER_ROUNDS", "[]")), []
    def one():
        if os.environ.get("FAKE_PEER_DIE_AT") == str(len(done)):
            sys.exit(5)
        done.append(times[len(done)] if len(done) < len(times) else 2.0)
        return {{**result, "generate_s": done[-1]}}
    n = serve_rounds(res_path, {{"load_s": 1.5, "warmup_s": 0.25}}, one)
    open(os.path.join(here, "held_rounds.txt"), "a").write(f"{{n}}\\n")
    sys.exit(0)
json.dump(result, open(res_path, "w"))
'''


@pytest.fixture
def peers(tmp_path, monkeypatch, tiny_llama_dir):
    """A peers dir with fake vllm and openvino venvs and the tiny model's OpenVINO 'exports'."""
    root = tmp_path / "peers"
    for name in PEER_SYSTEMS:
        py = root / name / "bin" / "python"
        py.parent.mkdir(parents=True)
        py.write_text(FAKE.format(python=sys.executable))
        py.chmod(0o755)
    for fmt in ("fp16", "int8"):
        (root / "models" / f"{Path(tiny_llama_dir).name}-ov-{fmt}").mkdir(parents=True)
    monkeypatch.setenv("BATCHGEN_PEERS_DIR", str(root))
    monkeypatch.delenv("FAKE_PEER_FAIL", raising=False)
    for var in ("FAKE_PEER_PROBE", "FAKE_PEER_ROUNDS", "FAKE_PEER_DIE_AT"):
        monkeypatch.delenv(var, raising=False)
    return root


def _calls(peers, venv="vllm"):
    path = peers / venv / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _opts(model, systems, **kw):
    return options_from("shared-prefix", quick=True, model=model, dtype="float32", log=False, roofline=False,
                        systems=systems, **kw)


def test_registry_lists_the_peers_as_extra_systems():
    assert PEER_SYSTEMS == ("vllm", "vllm-nocache", "openvino")
    assert set(PEER_SYSTEMS) <= set(BENCH_EXTRA_SYSTEMS) and not set(PEER_SYSTEMS) & set(BENCH_SYSTEMS)
    assert set(PEER_SYSTEMS) <= set(SYSTEMS) and set(peer.PEERS) == set(PEER_SYSTEMS)
    for name in PEER_SYSTEMS:
        assert (peer.RUNNERS / f"{peer.PEERS[name].venv}_runner.py").is_file()
    assert not peer.PEERS["vllm-nocache"].prefix_caching
    assert peer.peer_python("vllm-nocache") == peer.peer_python("vllm")


def test_runners_import_only_their_peer_numpy_and_the_standard_library():
    """The runners run inside the peer venvs: nothing of ours (batchgen, bench, engine ...) and no torch."""
    allowed = {"vllm_runner": {"vllm", "held"}, "openvino_runner": {"openvino", "openvino_genai", "numpy", "held"},
               "held": set()}       # held.py: their rounds' protocol
    for name, extra in allowed.items():
        tree = ast.parse((peer.RUNNERS / f"{name}.py").read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert mods - extra <= set(sys.stdlib_module_names) | {"__future__"}, (name, mods)


def test_round_trip_through_fake_peers(peers, tiny_llama_dir):
    opts = _opts(tiny_llama_dir, ("vllm", "openvino"))
    result = run_bench(opts)
    w = opts.workload
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), w, opts.seed)
    seen = json.loads((peers / "openvino" / "seen.json").read_text())
    req = seen["request"]
    assert seen["runner"] == str(peer.RUNNERS / "openvino_runner.py")
    assert req["prompts"] == [list(p.token_ids) for p in prompts]            # the same token ids, planned order
    assert req["groups"] == [p.group for p in prompts] and req["max_tokens"] == w.output_tokens
    assert req["model"] == str(peers / "models" / f"{Path(tiny_llama_dir).name}-ov-fp16")
    assert req["prefix_caching"] is True and req["threads"] >= 1 and req["warmup"]
    vreq = json.loads((peers / "vllm" / "seen.json").read_text())
    assert vreq["request"]["model"] == str(tiny_llama_dir)                    # an HF directory: loaded as it is
    assert vreq["env"]["HF_HUB_OFFLINE"] == "1" and vreq["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert vreq["env"]["VLLM_CPU_OMP_THREADS_BIND"] and vreq["env"]["PYTHONPATH"] is None

    rows = {s["system"]: s for s in result["systems"]}
    assert list(rows) == ["vllm", "openvino"]
    for name, s in rows.items():
        assert not s["skipped"], s["skipped"]
        assert s["num_requests"] == w.n and s["output_tokens"] == w.n * w.output_tokens
        assert s["prompt_tokens"] == w.n * w.prompt_tokens
        assert s["wall_s"] == 2.0 and s["extra"]["load_s"] == 1.5 and s["extra"]["version"] == "0.0-fake"
        assert Path(s["extra"]["log"]).is_file()
    vllm, ov = rows["vllm"], rows["openvino"]
    first_of_group = {p.group: i for i, p in reversed(list(enumerate(prompts)))}
    want_cached = sum(len(p.token_ids) // 2 for i, p in enumerate(prompts) if first_of_group[p.group] != i)
    assert vllm["cached_tokens"] == want_cached and vllm["hit_rate"] == pytest.approx(want_cached /
                                                                                     vllm["prompt_tokens"])
    assert ov["cached_tokens"] == 0 and ov["hit_rate"] is None                # not reported: n/a, not 0 %
    table = format_table(result)
    # both dtypes probed equal: the first listed runs, and the table names it
    assert "vllm float32 0.0-fake: load 1.5 s, warm-up 0.2 s (not in wall)" in table and "openvino" in table
    assert ("fastest of its dtypes: float32 (probes: float32 1.00 s, bfloat16 1.00 s); platform FakePlatform"
            in table)


def test_outputs_are_per_prompt_and_agreement_counts_them(peers, tiny_llama_dir):
    opts = _opts(tiny_llama_dir, ("vllm",))
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), opts.workload, opts.seed)
    res = peer.run_peer("vllm", opts, prompts, [[1, 2, 3]], threads=1)
    T = opts.workload.output_tokens
    assert res.outputs == [[(p.token_ids[-1] + i + k) % 97 for k in range(T)] for i, p in enumerate(prompts)]
    on = SystemResult("batchgen", "batchgen", wall_s=1.0, output_tokens=res.output_tokens,
                      outputs=[list(o) for o in res.outputs])
    on.outputs[0][-1] += 1
    agreement([on, res])
    assert res.match_rate == pytest.approx((len(prompts) - 1) / len(prompts))
    assert ratios([on, res])["batchgen_vs_vllm"] == 2.0


def test_a_peer_runs_in_the_dtype_its_probe_found_fastest_and_keeps_the_choice(peers, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"bfloat16": 7.0, "float32": 1.0}))
    opts = _opts(tiny_llama_dir, ("vllm",))
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), opts.workload, opts.seed)
    res = peer.run_peer("vllm", opts, prompts, [[1, 2, 3]], threads=1)
    probes = [c for c in _calls(peers) if c["probe"]]
    assert [c["dtype"] for c in probes] == ["float32", "bfloat16"]
    assert all(c["n"] == min(peer.PROBE_PROMPTS, len(prompts)) for c in probes)
    assert _calls(peers)[-1] == {"dtype": "float32", "probe": False, "n": len(prompts),
                                 "model": Path(tiny_llama_dir).name, "max_tokens": opts.workload.output_tokens}
    assert res.label == "vllm float32" and res.extra["dtype"] == "float32"
    assert res.extra["dtype_probes"] == {"bfloat16": 7.0, "float32": 1.0}
    assert res.extra["platform"] == "FakePlatform"
    # kept per peer, model and CPU: the next run probes nothing, even when the times would now say otherwise
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"bfloat16": 0.5, "float32": 1.0}))
    again = peer.run_peer("vllm-nocache", opts, prompts, [[1, 2, 3]], threads=1)
    assert again.extra["dtype"] == "float32" and len([c for c in _calls(peers) if c["probe"]]) == 2


def test_a_dtype_that_fails_its_probe_is_reported_and_the_other_runs(peers, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"bfloat16": "fail", "float32": 3.0}))
    opts = _opts(tiny_llama_dir, ("vllm",))
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), opts.workload, opts.seed)
    res = peer.run_peer("vllm", opts, prompts, [[1, 2, 3]], threads=1)
    assert res.extra["dtype"] == "float32"
    assert "bfloat16 is not supported here" in res.extra["dtype_probes"]["bfloat16"]
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"bfloat16": "fail", "float32": "fail"}))
    for kept in (peers / "choices").iterdir():
        kept.unlink()
    res = peer.run_peer("vllm", opts, prompts, [[1, 2, 3]], threads=1)
    assert res.skipped.startswith("every dtype failed: float32: failed (exit 4")
    assert "bfloat16: failed (exit 4" in res.skipped


def test_a_dtype_whose_weights_do_not_fit_in_memory_is_not_probed(peers, tiny_llama_dir, monkeypatch):
    """Llama-3.1-8B in float32 is 30 GB: on a 24 GB machine that probe is reported, not run."""
    import engine.memory
    from engine.loader import load_model_config
    from engine.loader.dummy import param_count
    params = param_count(load_model_config(peer.resolve_model(tiny_llama_dir)))
    monkeypatch.setattr(engine.memory, "available_memory_bytes", lambda: int(3 * params / peer.PEER_MEMORY_SHARE))
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"bfloat16": 2.0, "float32": 1.0}))
    opts = _opts(tiny_llama_dir, ("vllm",))
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), opts.workload, opts.seed)
    res = peer.run_peer("vllm", opts, prompts, [[1, 2, 3]], threads=1)
    assert [c["dtype"] for c in _calls(peers) if c["probe"]] == ["bfloat16"]
    assert res.extra["dtype"] == "bfloat16"
    assert res.extra["dtype_probes"]["float32"].startswith("not probed: its weights in float32 take")


def test_openvino_probes_its_weight_formats_each_in_its_own_export(peers, tiny_llama_dir, monkeypatch):
    """OpenVINO's dtypes are its IR's weight formats (setup.sh exports both): each probe loads its own directory,
    with the shape's output tokens (up to PROBE_DECODE_TOKENS: int8 decodes faster), the fastest runs, the choice is
    kept per shape, and a missing export names the setup to run."""
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"fp16": 2.0, "int8": 1.0}))
    opts = _opts(tiny_llama_dir, ("openvino",))
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), opts.workload, opts.seed)
    res = peer.run_peer("openvino", opts, prompts, [[1, 2, 3]], threads=1)
    stem = Path(tiny_llama_dir).name
    assert [(c["dtype"], c["model"]) for c in _calls(peers, "openvino") if c["probe"]] == [
        ("fp16", f"{stem}-ov-fp16"), ("int8", f"{stem}-ov-int8")]
    assert _calls(peers, "openvino")[-1]["model"] == f"{stem}-ov-int8" and not _calls(peers, "openvino")[-1]["probe"]
    assert res.label == "openvino int8" and res.extra["dtype_probes"] == {"fp16": 2.0, "int8": 1.0}
    T = opts.workload.output_tokens
    assert {c["max_tokens"] for c in _calls(peers, "openvino") if c["probe"]} == {min(T, peer.PROBE_DECODE_TOKENS)}
    other = dataclasses.replace(opts, workload=dataclasses.replace(opts.workload, shape="long-output"))
    peer.run_peer("openvino", other, prompts, [[1, 2, 3]], threads=1)              # another shape: probed again
    peer.run_peer("openvino", opts, prompts, [[1, 2, 3]], threads=1)               # this one: kept
    assert len([c for c in _calls(peers, "openvino") if c["probe"]]) == 4
    (peers / "models" / f"{stem}-ov-int8").rmdir()
    with pytest.raises(peer.PeerMissing, match=r"ov-int8 missing.*bash bench/peers/setup.sh openvino"):
        peer.check_peer("openvino", tiny_llama_dir)


def test_a_peer_that_fails_is_a_row_saying_why(peers, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_FAIL", "1")
    result = run_bench(_opts(tiny_llama_dir, ("vllm",)))
    (s,) = result["systems"]
    assert s["skipped"].startswith("every dtype failed: float32: failed (exit 3")
    assert "no kernel for this CPU" in s["skipped"] and "skipped: every dtype failed" in format_table(result)


def test_missing_venv_or_model_says_which_setup_to_run(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("BATCHGEN_PEERS_DIR", str(tmp_path / "none"))
    with pytest.raises(peer.PeerMissing, match=r"bash bench/peers/setup.sh vllm"):
        run_bench(_opts(tiny_llama_dir, ("batchgen", "vllm")))             # before anything runs
    py = tmp_path / "none" / "openvino" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    with pytest.raises(peer.PeerMissing, match=r"not converted .*bash bench/peers/setup.sh openvino"):
        peer.check_peer("openvino", tiny_llama_dir)
    from batchgen.cli import main
    res = CliRunner().invoke(main, ["bench", "--quick", "--model", tiny_llama_dir, "--dtype", "float32",
                                    "--systems", "batchgen,vllm", "--no-roofline"])
    assert res.exit_code == 2 and "bash bench/peers/setup.sh vllm" in res.output, res.output


def test_vllm_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_PEERS_DIR", str(tmp_path))
    for var in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    lib = tmp_path / "vllm" / "lib" / "libiomp5.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    env = peer.peer_env("vllm", 1)
    cpu = min(os.sched_getaffinity(0))
    assert env["LD_PRELOAD"] == str(lib) and env["VLLM_CPU_OMP_THREADS_BIND"] == f"{cpu}-{cpu}"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in env
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")                        # a set variable wins
    assert peer.peer_env("vllm", 1)["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert "LD_PRELOAD" not in peer.peer_env("openvino", 1)


def test_setup_script_refuses_an_unknown_peer():
    res = subprocess.run(["bash", str(ROOT / "bench" / "peers" / "setup.sh"), "nope"], capture_output=True,
                         text=True, env={**os.environ, "BATCHGEN_PEERS_DIR": "/nonexistent-peers"})
    assert res.returncode == 2 and "choose vllm or openvino" in res.stderr


def test_a_peer_runs_again_beside_the_busy_loops(peers, tiny_llama_dir, monkeypatch):
    """--contend N runs each peer a second time inside ``bench.contend.contention`` (as batchgen's systems)."""
    import contextlib

    import bench.run
    entered = []

    @contextlib.contextmanager
    def fake_contention(n):
        entered.append(n)
        yield
    monkeypatch.setattr(bench.run, "contention", fake_contention)
    opts = dataclasses.replace(_opts(tiny_llama_dir, ("vllm",)), contend=2)
    res = next(r for r in run_bench(opts)["systems"] if r["system"] == "vllm")
    assert entered == [2] and res["extra"]["contend"] == 2
    assert res["extra"]["contended_wall_s"] == 2.0 and res["extra"]["contention_ratio"] == pytest.approx(1.0)
    assert res["extra"]["contended_same_tokens"] is True


def test_a_dummy_model_runs_in_batchgen_and_the_peer_gets_the_same_weights(peers, tmp_path):
    """--model NAME of bench/models: load_format dummy for batchgen, the prompts from WordIds (no tokenizer), and
    vLLM's checkpoint of the same made-up weights written once under the peers dir."""
    from bench.dummy_checkpoint import MARK
    from bench.options import bench_model, bench_models

    assert {"qwen2.5-0.5b-instruct", "llama-3.2-1b-instruct", "qwen2.5-1.5b-instruct"} <= set(bench_models())
    assert bench_model("qwen2.5-0.5b-instruct") == (str(ROOT / "bench" / "models" / "qwen2.5-0.5b-instruct"),
                                                    "dummy")
    assert bench_model("gemma-3-270m") == ("gemma-3-270m", "auto")
    cfg = tmp_path / "tiny-qwen2"
    cfg.mkdir()
    cfg.joinpath("config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}))
    opts = _opts(str(cfg), ("batchgen", "vllm"), load_format="dummy")
    result = run_bench(opts)
    rows = {s["system"]: s for s in result["systems"]}
    assert not rows["batchgen"]["skipped"] and not rows["vllm"]["skipped"], rows
    req = json.loads((peers / "vllm" / "seen.json").read_text())["request"]
    assert req["model"] == str(peers / "models" / "tiny-qwen2-dummy-bf16")
    assert json.loads((Path(req["model"]) / MARK).read_text())["dtype"] == "bfloat16"
    assert rows["vllm"]["prompt_tokens"] == rows["batchgen"]["prompt_tokens"]
    assert all(1000 <= t < 2048 or t == 1 for p in req["prompts"] for t in p)       # WordIds within the vocabulary


def test_size_sweep_rows_ratios_and_table(peers, tiny_llama_dir):
    """bench.sweep: each shape sized for the model (documents scaled down for a larger one), its systems side by
    side, peer seconds over ours as the ratio, skipped systems named under the table."""
    from bench.sweep import SWEEP, SweepShape, format_sweep, run_sweep, sized

    big = sized(SWEEP[0], 1.5e9)
    assert (big["n"], big["groups"]) == (3, 2)                     # 8 documents / 3: two of them share a prefix
    assert (sized(SWEEP[0], 4e9)["n"], sized(SWEEP[0], 4e9)["groups"]) == (2, 1)
    assert sized(SWEEP[2], 8e9)["n"] == SWEEP[2].sizes["groups"]   # nothing shared: one document a group
    assert sized(SWEEP[4], 8e9) == SWEEP[4].sizes                  # decode shapes keep their rows
    shapes = (SweepShape("shared-prefix", "shared-prefix", dict(n=4, groups=2, prefix_tokens=32, doc_tokens=8,
                                                                output_tokens=3), ("batchgen", "vllm")),
              SweepShape("cache off", "shared-prefix", dict(n=4, groups=2, prefix_tokens=32, doc_tokens=8,
                                                            output_tokens=3), ("batchgen-nocache", "vllm-nocache")))
    seen = []
    rows = run_sweep(_opts(tiny_llama_dir, ()), 0.5e9, shapes=shapes, peers=("vllm",), on_result=seen.append)
    assert [r["label"] for r in rows] == ["shared-prefix", "cache off"] and len(seen) == 2
    assert list(rows[1]["systems"]) == ["batchgen-nocache"]                      # vllm-nocache not set up: left out
    ours = rows[0]["systems"]["batchgen"]["wall_s"]
    assert rows[0]["ratios"] == {"vllm": round(2.0 / ours, 3)}
    assert rows[0]["systems"]["vllm"]["dtype"] == "float32"
    table = format_sweep("tiny", "a CPU", rows)
    assert table.startswith("Model tiny; CPU a CPU;")
    assert "| shared-prefix | 2, 2, 32, 8, 4 |" in table                     # quick: a smoke size
    assert "2.0 s (float32)" in table and "vllm / ours" in table
    only = run_sweep(_opts(tiny_llama_dir, ()), 0.5e9, shapes=shapes[:1], peers=("vllm",), only=("hf-generate",))
    assert list(only[0]["systems"]) == ["batchgen"]          # --systems: the shape's batchgen system always runs


def test_a_dtype_probe_is_short(peers, tiny_llama_dir):
    from bench.workloads import BenchPrompt

    long = [BenchPrompt(i, 0, tuple(range(1, 2000))) for i in range(5)]
    req = peer.peer_request("vllm", _opts(tiny_llama_dir, ("vllm",)), long, [[1]], 2, "float32", probe=True)
    assert len(req["prompts"]) == peer.PROBE_PROMPTS and req["max_tokens"] == peer.PROBE_TOKENS
    assert {len(p) for p in req["prompts"]} == {peer.PROBE_PROMPT_TOKENS} and req["dtype"] == "float32"
    assert req["warm_workload"] is False          # a probe is short; a real run first runs its workload untimed
    full = peer.peer_request("vllm", _opts(tiny_llama_dir, ("vllm",)), long, [[1]], 2, "float32")
    assert len(full["prompts"]) == 5 and {len(p) for p in full["prompts"]} == {1999} and not full["probe"]
    assert full["warm_workload"] is True


def test_a_probe_far_slower_than_the_fastest_so_far_is_stopped(peers, tiny_llama_dir, monkeypatch):
    """vLLM's bf16 on a CPU without bf16 units ran for over 13 minutes at 1.5B: a later dtype's probe is killed
    (with every process it started) once it has taken PROBE_CUTOFF times the fastest probe's wall time, and is
    reported as slower, never chosen."""
    import time
    monkeypatch.setenv("FAKE_PEER_PROBE", json.dumps({"bfloat16": "hang", "float32": 1.0}))
    monkeypatch.setattr(peer, "PROBE_CUTOFF", 5.0)
    opts = _opts(tiny_llama_dir, ("vllm",))
    prompts = build_prompts(load_tokenizer(peer.resolve_model(tiny_llama_dir)), opts.workload, opts.seed)
    t = time.monotonic()
    res = peer.run_peer("vllm", opts, prompts, [[1, 2, 3]], threads=1)
    assert time.monotonic() - t < 120
    assert res.extra["dtype"] == "float32"
    assert res.extra["dtype_probes"]["bfloat16"].startswith("slower: stopped after")


def test_sweep_rounds_gives_every_shape_at_least_that_many(peers, tiny_llama_dir, monkeypatch):
    """--sweep-rounds N: every chosen shape runs at least N interleaved rounds (the decode shapes keep more)."""
    from click.testing import CliRunner

    import bench.sweep
    from batchgen.cli import main
    seen = {}
    monkeypatch.setattr(bench.sweep, "run_sweep", lambda opts, params, shapes, **kw: seen.update(
        {s.label: s.repeats for s in shapes}) or [])
    monkeypatch.setattr(bench.sweep, "format_sweep", lambda *a: "")
    r = CliRunner().invoke(main, ["bench", "--model", str(tiny_llama_dir), "--size-sweep", "--sweep-rounds", "2",
                                  "--sweep-only", "shared-prefix,decode 8 rows"])
    assert r.exit_code == 0, r.output
    assert seen == {"shared-prefix": 2, "decode 8 rows": 3}
