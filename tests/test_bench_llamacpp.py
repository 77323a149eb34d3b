"""bench/systems/llamacpp.py on a dummy model, without llama.cpp: a fake ``llama_cpp`` module stands in, slower
or failing per GGUF type, so the type probe (each type's file written once, the fastest runs, a failure reported,
the choice kept) and the sweep's llama.cpp rows are held. The real check of the files against llama.cpp's tokens
is done by hand (bench/dummy_gguf.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types

import pytest

from bench.options import options_from
from bench.systems import llamacpp
from bench.workloads import BenchPrompt

TINY = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16"}


class FakeLlama:
    """Greedy 'tokens' (last prompt token + k) % 97; FAKE_LLAMA_SLOW seconds per token and FAKE_LLAMA_FAIL (a
    type: the load fails) by the file's type."""
    loaded: list[str] = []
    checked: list[str] = []          # types decoded in the (faked) child process

    def __init__(self, model_path, **kw):
        type_ = model_path.removesuffix(".gguf").rsplit("-", 1)[1]
        FakeLlama.loaded.append(type_)
        if os.environ.get("FAKE_LLAMA_FAIL") in (type_, "all"):
            raise ValueError(f"Failed to load model from file: {model_path}")
        self.delay = json.loads(os.environ.get("FAKE_LLAMA_SLOW", "{}")).get(type_, 0.0)

    def generate(self, tokens, **kw):
        k = 0
        while True:
            time.sleep(self.delay)
            yield (tokens[-1] + k) % 97
            k += 1

    def close(self):
        pass


@pytest.fixture
def fake(tmp_path, monkeypatch):
    mod = types.SimpleNamespace(__version__="0.0-fake", Llama=FakeLlama, llama_print_system_info=lambda: b"FAKE")
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setenv("BATCHGEN_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv("FAKE_LLAMA_FAIL", raising=False)
    monkeypatch.setenv("FAKE_LLAMA_SLOW", "{}")
    monkeypatch.delenv("FAKE_LLAMA_CRASH", raising=False)
    # the child process's two-token decode, faked: FAKE_LLAMA_CRASH (a type, or "all") crashes there
    def decode_problem(path, threads, timeout=600.0):
        type_ = path.stem.rsplit("-", 1)[1]
        FakeLlama.checked.append(type_)
        if os.environ.get("FAKE_LLAMA_CRASH") in (type_, "all"):
            return f"crashed (SIGSEGV) in a two-token decode of {path.name}"
        return None
    monkeypatch.setattr(llamacpp, "decode_problem", decode_problem)
    FakeLlama.loaded = []
    FakeLlama.checked = []
    cfg = tmp_path / "tiny-qwen2"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(TINY))
    opts = options_from("shared-prefix", quick=True, model=str(cfg), dtype="float32", log=False, roofline=False,
                        systems=("llama.cpp",))
    assert opts.load_format == "dummy"                 # a directory with only a config.json
    prompts = [BenchPrompt(i, i % 2, tuple(range(3 + i, 40 + i))) for i in range(4)]
    return opts, prompts


@pytest.mark.parametrize("slow", ["q8_0", "f16"])
def test_the_fastest_type_runs_and_the_choice_is_kept(fake, monkeypatch, slow):
    opts, prompts = fake
    monkeypatch.setenv("FAKE_LLAMA_SLOW", json.dumps({slow: 0.02}))
    res = llamacpp.run_llama_cpp(opts, prompts)
    fast = next(t for t in llamacpp.DUMMY_TYPES if t != slow)
    assert not res.skipped and res.extra["dtype"] == fast and res.label == f"llama.cpp {fast}"
    assert FakeLlama.loaded == [*llamacpp.DUMMY_TYPES, fast]            # each probed, then the fastest ran
    assert FakeLlama.checked == list(llamacpp.DUMMY_TYPES)              # each checked once, before its probe
    probes = res.extra["dtype_probes"]
    # probed second, the slow one is stopped at PROBE_CUTOFF times the fast one's wall time
    assert probes[slow] > probes[fast] >= 0 if slow == llamacpp.DUMMY_TYPES[0] else probes[slow].startswith("slower")
    for t in llamacpp.DUMMY_TYPES:                                       # each type written, once
        assert llamacpp.dummy_gguf_path(opts.model, t).is_file()
    T = opts.workload.output_tokens
    assert res.outputs == [[(p.token_ids[-1] + k) % 97 for k in range(T)] for p in prompts]
    assert res.output_tokens == len(prompts) * T and res.extra["load_s"] >= 0
    FakeLlama.loaded, FakeLlama.checked = [], []
    monkeypatch.setenv("FAKE_LLAMA_SLOW", json.dumps({fast: 0.02}))       # kept: not probed again
    again = llamacpp.run_llama_cpp(opts, prompts)
    assert again.extra["dtype"] == fast and FakeLlama.loaded == [fast] and "kept" in again.extra["dtype_probes"]
    assert FakeLlama.checked == [fast]                                   # a kept choice is checked on this build
    decode = dataclasses.replace(opts, workload=dataclasses.replace(opts.workload, shape="short-prompt"))
    assert llamacpp.run_llama_cpp(decode, prompts).extra["dtype"] == slow     # chosen per shape: probed again
    FakeLlama.loaded = []
    llamacpp.run_llama_cpp(dataclasses.replace(opts, quick=False), prompts)    # a quick run's choice is its own
    assert FakeLlama.loaded == [*llamacpp.DUMMY_TYPES, slow]


def test_a_type_that_fails_is_reported_and_every_type_failing_is_a_skipped_row(fake, monkeypatch, tmp_path):
    opts, prompts = fake
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "q8_0")
    res = llamacpp.run_llama_cpp(opts, prompts)
    assert res.extra["dtype"] == "f16"
    assert res.extra["dtype_probes"]["q8_0"].startswith("failed to load: Failed to load model from file")
    for kept in (tmp_path / "peers" / "choices").iterdir():
        kept.unlink()
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "all")
    res = llamacpp.run_llama_cpp(opts, prompts)
    assert res.skipped.startswith("every type failed: q8_0: failed to load") and "f16: failed to load" in res.skipped


def test_a_gguf_that_cannot_be_written_fails_its_type_not_the_bench(fake, monkeypatch):
    """A full disk while writing the dummy weights (a 1.5B f16 GGUF is 3 GB): that type is reported failed and the
    others still run; none written is a skipped row."""
    from bench import dummy_gguf
    opts, prompts = fake
    real = dummy_gguf.write_gguf

    def full_disk(cfg, out, type_="q8_0", seed=0, bad=("f16",)):
        if type_ in bad:
            raise OSError(28, "No space left on device")
        return real(cfg, out, type_, seed)
    monkeypatch.setattr(dummy_gguf, "write_gguf", full_disk)
    res = llamacpp.run_llama_cpp(opts, prompts)
    assert not res.skipped and res.extra["dtype"] == "q8_0"
    assert res.extra["dtype_probes"]["f16"] == "could not write its GGUF: [Errno 28] No space left on device"
    monkeypatch.setattr(dummy_gguf, "write_gguf", lambda *a, **kw: full_disk(*a, **kw, bad=llamacpp.DUMMY_TYPES))
    res = llamacpp.run_llama_cpp(dataclasses.replace(opts, quick=False), prompts)
    assert res.skipped.startswith("every type failed: q8_0: could not write its GGUF")


def test_without_llama_cpp_the_row_says_why(fake, monkeypatch):
    opts, prompts = fake
    monkeypatch.setitem(sys.modules, "llama_cpp", None)               # import fails
    assert "llama-cpp-python not installed" in llamacpp.run_llama_cpp(opts, prompts).skipped


def test_the_sweep_runs_llama_cpp_in_its_cache_on_shapes(fake):
    from bench.sweep import SWEEP, format_sweep, sweep_row

    assert all("llama.cpp" in s.systems and "openvino" in s.systems for s in SWEEP if "cache off" not in s.label)
    opts, prompts = fake
    res = llamacpp.run_llama_cpp(opts, prompts)
    ours = {"system": "batchgen-default", "wall_s": res.wall_s * 2, "label": "b", "skipped": None, "extra": {}}
    row = sweep_row(SWEEP[0], SWEEP[0].sizes, {"systems": [ours, {**res.to_dict(), "system": "llama.cpp"}]}, 1.0)
    assert row["systems"]["llama.cpp"]["dtype"] == res.extra["dtype"]
    assert f"({res.extra['dtype']})" in format_sweep("tiny", "cpu", [row])


def test_a_type_that_crashes_llama_cpp_is_a_failed_probe_not_the_end_of_the_bench(fake, monkeypatch, tmp_path):
    """A GGUF type whose two-token decode crashes in the child process (ggml's AMX-INT8 Q8_0 path on an AMX Xeon) is
    never loaded in the bench's process: reported as its probe's failure, the other type runs; every type crashing is
    a skipped row."""
    opts, prompts = fake
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "q8_0")
    res = llamacpp.run_llama_cpp(opts, prompts)
    assert res.extra["dtype"] == "f16" and "q8_0" not in FakeLlama.loaded
    assert res.extra["dtype_probes"]["q8_0"] == "crashed (SIGSEGV) in a two-token decode of " + \
        llamacpp.dummy_gguf_path(opts.model, "q8_0").name
    for kept in (tmp_path / "peers" / "choices").iterdir():
        kept.unlink()
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "all")
    FakeLlama.loaded = []
    res = llamacpp.run_llama_cpp(opts, prompts)
    assert res.skipped.startswith("every type failed: q8_0: crashed (SIGSEGV)") and FakeLlama.loaded == []


@pytest.mark.parametrize("code, want", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "crashed (SIGSEGV) in a two-token decode of m.gguf"),
    ("import sys\nsys.exit('Failed to load model from file')\n",
     "failed a two-token decode of m.gguf: Failed to load model from file"),
    ("import sys\nassert sys.argv[1:] == ['m.gguf', '2']\n", None),
])
def test_the_child_decode_tells_a_crash_from_a_failure_and_a_success(monkeypatch, code, want):
    """decode_problem runs _CHECK_CODE in a child with the GGUF and the thread count: a signal is a crash, a non-zero
    exit a failure with the child's last line, exit 0 nothing."""
    monkeypatch.setattr(llamacpp, "_CHECK_CODE", code)
    assert llamacpp.decode_problem(llamacpp.Path("m.gguf"), 2) == want
